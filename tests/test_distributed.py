"""Data-parallel GRPO on CPU process groups (gloo): N processes give the one-process run on the same global
batch (per-step metrics and final weights), for LoRA, a 4-bit base, grouped rows (train.shared_prompt) and full
weights sharded by FSDP2, and for each whole-step statistic (the batch reward std, GDPO's batch normalisation, the
high-entropy quantile, the entropy bonus, several optimizer steps per rollout batch) and both rollout backends, and
with images (the vision demo's GRPO and SFT: each rank encodes its own prompts' images); a checkpoint made on 2
processes resumes on 1 and on 3 with the uninterrupted trajectory; only rank 0 writes outputs; a failing rank
ends the job with its error, quickly. The spawned jobs are few and shared by the assertions (they cost most of
this file's time): one spawn of 3 processes serves every equality and resume assertion, and each run combines
several of the options."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longrl.config import load_config
from longrl.config.demo import demo_config
from longrl.training.distributed import World, rank_prompts, shard
from longrl.training.reporting import read_metrics
from longrl.compat.trl import GRPOTrainer

# 3 prompts on 2 or 3 ranks (an uneven split), micro-batches of 5 that cross the groups of 4
QUICK = ["train.prompts_per_step=3", "grpo.num_generations=4", "train.micro_batch_size=5", "train.max_steps=2",
         "output.progress_bar=false", "output.tensorboard=false", "generation.max_completion_length=12",
         "output.log_completions=2", "output.logging_steps=1", "distributed.timeout_s=60"]  # a hang fails in a minute
# LoRA (DDP): global B, the batch std, the KL, old log-probs, the entropy quantile over every rank's tokens, the
# entropy bonus's global normaliser; rollouts through transformers' generate (keyed by global sequence id)
LORA = ["lora.enabled=true", "lora.r=4", "grpo.loss_type=grpo", "grpo.scale_rewards=batch", "grpo.beta=0.05",
        "grpo.top_entropy_quantile=0.5", "grpo.entropy_coef=0.01", "generation.backend=hf", "output.save_steps=1"]
# full weights (FSDP2): two optimizer steps per rollout batch (each step's prompts split across the ranks),
# GDPO's batch normalisation of the two reward functions, a KL reference (each rank's own frozen copy of the initial
# weights, through the host placement's prefetch path: rebuilt when resumed on 1 and 3 processes)
FULL = ["lora.enabled=false", "grpo.loss_type=dapo", "grpo.steps_per_generation=2",
        "grpo.multi_objective_aggregation=normalize_then_sum", "train.max_steps=4", "output.save_steps=2",
        "grpo.beta=0.05", "grpo.reference_placement=host"]
# grouped rows (a prompt once for its completions in the reference and policy passes): each rank's prompts whole on
# that rank, so its groups are whole too
GROUPED = ["lora.enabled=true", "lora.r=4", "train.shared_prompt=true", "grpo.loss_type=grpo", "grpo.beta=0.05"]
# a 4-bit base (DDP over the adapters): a second iteration on the rollout batch (old log-probs)
QLORA = ["lora.enabled=true", "lora.r=4", "model.load_in_4bit=true", "model.dtype=bfloat16", "grpo.loss_type=dr_grpo",
         "grpo.num_iterations=2"]


def _cfg(out, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={out}", *overrides], base=demo_config())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainable(model) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
    return out


def _no_plots():
    """Training-curve plots off (matplotlib costs seconds a save; this file checks no plot)."""
    from longrl.training.reporting import RunReporter

    RunReporter.plot = lambda self: None


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    from longrl.training.reporting import RunReporter

    monkeypatch.setattr(RunReporter, "plot", lambda self: None)


TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _train(jobs, results: Path, rank: int, suffix: str = "") -> None:
    """Each job (name, [config file,] overrides) trains a run; rank 0 saves its metrics and final trainable weights
    to results/NAME{suffix}.pt."""
    for name, *config, overrides in jobs:
        if name.endswith("sft"):  # `longrl sft` (test_sft_two_processes_equal_one)
            from longrl.compat.trl import SFTTrainer

            trainer = SFTTrainer(load_config(config[0] if config else None, overrides, recipe="sft"))
        else:  # the vision demo's config for the vision runs, else the arithmetic demo's
            base = demo_config("vision" if name.startswith("vision") else "arithmetic")
            trainer = GRPOTrainer(load_config(config[0] if config else None, overrides, base=base))
        encoded = _record_encoded(trainer)
        history = trainer.train()
        weights = _trainable(trainer.model)
        if rank == 0:
            torch.save({"history": history, "weights": weights, "encoded": encoded,
                        "shared_prompt": getattr(trainer, "shared_prompt", None)}, results / f"{name}{suffix}.pt")


def _record_encoded(trainer) -> list:
    """What this process encodes images for, one entry a call (filled as it trains): a GRPO run's prompt rows
    (``PromptImages.prompts``), an SFT run's number of examples (``example_prompts``); empty for a text run."""
    from longrl.recipes import sft

    encoded = []
    if getattr(trainer, "images", None) is None:
        return encoded
    if isinstance(trainer, GRPOTrainer):
        prompts = trainer.images.prompts
        trainer.images.prompts = lambda data, rows: encoded.append(list(rows)) or prompts(data, rows)
    else:
        examples = getattr(sft.example_prompts, "__wrapped__", sft.example_prompts)  # (one wrap a process)

        def example_prompts(encoder, chosen):
            encoded.append(len(chosen))
            return examples(encoder, chosen)
        example_prompts.__wrapped__ = examples
        sft.example_prompts = example_prompts
    return encoded


def _wait_for(*flags: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in flags):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {[str(f) for f in flags]}")
        time.sleep(0.1)


def _process_logs(root: Path, lines: int = 40) -> str:
    """The last lines of each spawned process's stderr, for the failure's message."""
    tails = []
    for path in sorted(root.glob("process*.stderr")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(tails)


def _alone() -> None:
    """This process outside any process group (as one started without torchrun)."""
    for key in TORCHRUN_ENV:
        os.environ.pop(key, None)


def _worker(rank: int, port: int, root: str, two: list, single: list, cuts: list, three: list, one: list):
    """One of 3 spawned processes, in the environment torchrun sets. Ranks 0 and 1 train the ``two`` jobs as a
    2-process job while process 2 trains the ``single`` jobs alone (no process group); then rank 0 makes the
    ``cuts`` (copies of 2-process runs cut after their first checkpoint), all three resume some of them as the
    3-process ``three`` jobs, and then the others alone, the ``one`` jobs shared among the processes. Each
    process's stderr (with a traceback on a fatal signal) goes to ``process{rank}.stderr`` (``_process_logs``)."""
    import faulthandler

    from longrl.training.distributed import shutdown

    root = Path(root)
    log = open(root / f"process{rank}.stderr", "w", buffering=1)  # noqa: SIM115 (open while the process lives)
    os.dup2(log.fileno(), 2)  # C++ messages (gloo, std::terminate) too
    faulthandler.enable(log, all_threads=True)
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"  # a C++ error's own stack in its message
    results = root / "results"
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the trainers keep 1 thread (not the load-dependent automatic count): the
    #                                      same floating-point sums in every process, so the runs compare exactly
    _no_plots()
    if rank < 2:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank))
        _train(two, results, rank)
        shutdown()
        if rank == 0:
            for src, dst in cuts:
                _cut_after_first_checkpoint(Path(src), Path(dst))
            # the 3-process group's port, chosen now: one chosen at the start could since have been taken as a
            # local port by the 2-process group's many connections
            (root / "port.tmp").write_text(str(_free_port()))
            (root / "port.tmp").rename(root / "two.done")
    else:
        _alone()
        _train(single, results, 0, suffix="-single")
        (root / "single.done").touch()
    _wait_for(root / "two.done", root / "single.done")  # then every rank joins the 3-process group promptly
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=(root / "two.done").read_text(), RANK=str(rank),
                      WORLD_SIZE="3", LOCAL_RANK=str(rank))
    _train(three, results, rank, suffix="-three")
    shutdown()  # (no group without 3-process jobs)
    _alone()
    _train(one[rank::3], results, 0, suffix="-one")
    # Everything is saved: leave without the interpreter's finalization, where objects of torch's C++ side that
    # outlive their group have aborted a finished process (std::terminate, on CI's 2 cores)
    for stream in (sys.stdout, sys.stderr, log):
        stream.flush()
    os._exit(0)


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not (k.endswith("_time_s") or "_peak_gib" in k)}


def _assert_same_run(history, reference, weights=None, reference_weights=None, tol=1e-5):
    assert len(history) == len(reference)
    for got, want in zip(history, reference):
        got, want = _comparable(got), _comparable(want)
        assert got.keys() == want.keys()
        for k in want:
            a, b = got[k], want[k]
            if isinstance(b, float) and isinstance(a, float):
                assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=tol, abs=tol), (want["step"], k, a, b)
            else:
                assert a == b, (want["step"], k, a, b)
    if reference_weights is not None:
        assert weights.keys() == reference_weights.keys()
        for k in reference_weights:
            if k.endswith("k_proj.bias"):
                # a key bias adds one constant to each query's scores, which the softmax cancels: its gradient is
                # zero up to rounding, and Adam scales that rounding up to the learning rate's size, one way on one
                # process and another on two (1.9e-5 apart on a bias of 1.7e-5 at most, seen on one CPU); it stays
                # within those steps' reach (these runs: at most 2 steps of 3e-3 from a zero start)
                assert weights[k].abs().max() <= 1e-2 and reference_weights[k].abs().max() <= 1e-2, k
                continue
            torch.testing.assert_close(weights[k], reference_weights[k], rtol=tol, atol=tol, msg=k)


def test_shard_splits_every_item_once_in_order():
    for n in range(1, 12):
        for world in range(1, n + 1):
            blocks = [shard(n, r, world) for r in range(world)]
            assert blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
            sizes = [b - a for a, b in blocks]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_rank_prompts_split_every_step_across_the_ranks():
    P, S = 5, 3
    for world in (1, 2, 3, 5):
        shares = [rank_prompts(P, S, r, world) for r in range(world)]
        assert sorted(p for share in shares for p in share) == list(range(P * S))  # each prompt once
        for share in shares:  # the same count of every step, steps in order: a step is a contiguous block
            per_step = len(share) // S
            assert [p // P for p in share] == [s for s in range(S) for _ in range(per_step)]


def test_single_world_reductions_are_the_identity():
    w = World()
    t = torch.tensor([1.5, float("nan")])
    assert w.all_sum(t) is t and w.all_gather_cat(t) is t
    assert w.sum_floats({"a": 2}) == {"a": 2.0} and w.max_floats({"a": 3}) == {"a": 3.0}
    assert w.gather_floats(4.0) == [4.0] and w.broadcast_text("x") == "x"


def test_ddp_finds_unused_parameters_only_where_a_vision_part_trains():
    """DDP's search for unused parameters (a walk of the autograd graph each step) only where a step may leave some
    unused: a vision tower or projector parameter trains (full weights, or adapters in them)."""
    from longrl.models.tiny import build_tiny_model
    from longrl.models.tiny_vision import build_tiny_vision_model
    from longrl.training.distributed import _vision_trains

    model, _ = build_tiny_vision_model()
    assert _vision_trains(model)  # full weights: LLaVA's post_layernorm is never read
    for name, p in model.named_parameters():
        p.requires_grad = "multi_modal_projector" in name
    assert _vision_trains(model)
    for name, p in model.named_parameters():
        p.requires_grad = "language_model" in name or "lm_head" in name
    assert not _vision_trains(model)
    assert not _vision_trains(build_tiny_model()[0])


@pytest.fixture(scope="module")
def spawned_runs(tmp_path_factory):
    """LoRA (DDP over the adapters), full weights (FSDP2 per decoder layer) and, where bitsandbytes runs on the
    CPU, a 4-bit base, then `longrl sft` and the vision runs (``VISION``): each trained by one 2-process job and by
    one process alone; the LoRA and full-weight runs cut after their first checkpoint and resumed by one 3-process
    job. One spawn of 3 processes for all."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    root = tmp_path_factory.mktemp("spawned")
    runs = {"lora": LORA, "full": FULL, "grouped": GROUPED}
    if _bitsandbytes_cpu():
        runs["qlora"] = QLORA
    two = [(name, QUICK + extra + [f"output.output_dir={root / name}"]) for name, extra in runs.items()]
    single = [(name, QUICK + extra + [f"output.output_dir={root / 'single' / name}"]) for name, extra in runs.items()]
    for name, overrides in [("sft", SFT), *VISION.items()]:  # supervised and vision: one job each, no resume here
        two.append((name, overrides + [f"output.output_dir={root / name}"]))
        single.append((name, overrides + [f"output.output_dir={root / 'single' / name}"]))
    resumed = ["lora", "full"]
    cuts = [(str(root / name), str(root / ranks / name)) for name in resumed for ranks in ("three", "one")]
    three, one = ([(name, str(root / ranks / name / "config.yaml"), _resume(root / ranks / name)) for name in resumed]
                  for ranks in ("three", "one"))
    (root / "results").mkdir()
    try:
        mp.start_processes(_worker, args=(_free_port(), str(root), two, single, cuts, three, one), nprocs=3,
                           start_method="spawn")
    except ProcessException as e:  # a fatal signal or an exception in a process
        raise AssertionError(f"{e}\n{_process_logs(root)}") from e
    load = lambda stem: torch.load(root / "results" / f"{stem}.pt", weights_only=False)  # noqa: E731
    return root, runs, {name: {"two": load(name), "single": load(f"{name}-single"),
                               **({"three": load(f"{name}-three"), "one": load(f"{name}-one")} if name in resumed
                                  else {})} for name in [*runs, "sft", *VISION]}


def test_two_processes_equal_one(spawned_runs):
    """A 2-process run takes the 1-process run's steps on the same global batch: per-step metrics and final
    trainable weights within float tolerance (4-bit: within the bf16 base's rounding)."""
    root, runs, got = spawned_runs
    for name in runs:
        two, one = got[name]["two"], got[name]["single"]
        _assert_same_run(two["history"], one["history"], two["weights"], one["weights"],
                         tol=2e-2 if name == "qlora" else 1e-5)
    assert "high_entropy_ratio" in got["lora"]["two"]["history"][0]  # the options did run
    assert got["grouped"]["two"]["shared_prompt"] is True and got["lora"]["two"]["shared_prompt"] is False
    assert got["full"]["two"]["history"][-1]["kl"] > 0  # each rank's own reference: the policy moved from it
    # rank 0 alone wrote the outputs, once
    out = root / "lora"
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert len((out / "completions.jsonl").read_text().splitlines()) == 2 * 2  # 2 samples a step, from rank 0
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["world_size"] == 2
    assert not list(out.glob(".*checkpoint*"))  # no staging left behind
    # FSDP2: the full weights gathered into one model file, the optimizer as DCP shards of both ranks
    full = root / "full" / "checkpoint-4"
    assert (full / "model.safetensors").is_file() and not (full / "optimizer.pt").exists()
    assert sorted(p.name for p in (full / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


# `longrl sft`: 5 examples a step on 2 ranks (an uneven split, 2 and 3), micro-batches of 2 (crossing the split),
# 4 held-out examples (2 a rank)
SFT = ["model.device=cpu", "model.dtype=float32", "lora.enabled=true", "lora.r=4", "data.source=task:arithmetic_sft",
       "data.num_examples=40", "sft.max_length=16", "sft.examples_per_step=5", "train.micro_batch_size=2",
       "train.max_steps=2", "train.learning_rate=3e-3", "output.save_steps=1", "output.progress_bar=false",
       "output.report_to=[none]", "distributed.timeout_s=60"]


def test_sft_two_processes_equal_one_and_resume_on_one(spawned_runs, tmp_path):
    """`longrl sft` on 2 processes: each rank's share of the step's examples, the mean over the trained tokens of the
    whole step (the count all-reduced), gradients summed: the 1-process run's per-step metrics (loss, held-out loss)
    and final adapters; rank 0 alone wrote; its step-1 checkpoint resumes in one process on the same trajectory."""
    from longrl.compat.trl import SFTTrainer

    root, _, got = spawned_runs
    untimed = lambda ms: [{k: v for k, v in m.items() if not k.endswith("_per_s")} for m in ms]  # noqa: E731
    two, one = got["sft"]["two"], got["sft"]["single"]
    assert "eval/loss" in one["history"][-1] and one["history"][0]["trained_tokens"] > 5
    _assert_same_run(untimed(two["history"]), untimed(one["history"]), two["weights"], one["weights"], tol=1e-5)
    out = root / "sft"
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["world_size"] == 2
    cut = _cut_after_first_checkpoint(out, tmp_path / "cut")
    resumed = SFTTrainer(load_config(None, SFT + [f"output.output_dir={cut}", "output.resume=true"],
                                     recipe="sft")).train()
    _assert_same_run(untimed(resumed), untimed(one["history"][1:]))


# the vision demo's config (builtin:tiny-vision, task:shapes: each prompt a picture), made quick: GRPO with full
# weights (FSDP2; a KL reference) and with LoRA on the vision tower and projector (DDP: the policy's forward takes
# vision= through it); `longrl sft` on task:shapes_sft with full weights (DDP over every weight, the tower's among
# them; 5 examples on 2 ranks, micro-batches of 2, 4 held-out examples)
VISION = {
    "vision": QUICK + ["generation.max_completion_length=3", "grpo.beta=0.05"],
    "vision_lora": QUICK + ["generation.max_completion_length=3", "lora.enabled=true", "lora.r=4",
                            "lora.vision_modules=tower_and_projector"],
    "vision_sft": [o for o in SFT if not o.startswith(("lora.", "data.source="))]
    + ["model.name_or_path=builtin:tiny-vision", "data.source=task:shapes_sft", "sft.eval_examples=4",
       "lora.enabled=false"],
}


def test_vision_two_processes_equal_one(spawned_runs):
    """GRPO and SFT with images on 2 processes: the 1-process run's per-step metrics and final trainable weights,
    each rank encoding only its own prompts' (examples') images, whole groups on one rank."""
    from longrl.models.tiny_vision import build_tiny_vision_model

    _, _, got = spawned_runs
    untimed = lambda ms: [{k: v for k, v in m.items() if not k.endswith("_per_s")} for m in ms]  # noqa: E731
    for name in VISION:
        two, one = got[name]["two"], got[name]["single"]
        _assert_same_run(untimed(two["history"]), untimed(one["history"]), two["weights"], one["weights"])
    assert got["vision"]["two"]["history"][-1]["kl"] > 0
    # the vision tower trained: its adapters (B starts at 0), its weights (from the builtin model of seed 0)
    tower = {k: w for k, w in got["vision_lora"]["two"]["weights"].items() if "vision_tower" in k and "lora_B" in k}
    assert tower and all(w.abs().max() > 0 for w in tower.values())
    initial, _ = build_tiny_vision_model(seed=0)
    moved = [k for k, w in initial.state_dict().items()
             if "vision_tower" in k and not torch.equal(got["vision_sft"]["two"]["weights"][k], w)]
    assert "model.vision_tower.encoder.layers.0.mlp.fc1.weight" in moved
    # GRPO: each step rank 0 encodes the first of the step's 3 prompts (3 prompts on 2 ranks: 1 and 2), those
    # the one process draws first
    for name in ("vision", "vision_lora"):
        mine, every = got[name]["two"]["encoded"], got[name]["single"]["encoded"]
        assert [len(rows) for rows in every] == [3, 3] and mine == [rows[:1] for rows in every]
    # SFT: rank 0 encodes 2 of each step's 5 examples and 2 of the 4 held-out ones (after step 2)
    assert got["vision_sft"]["two"]["encoded"] == [2, 2, 2] and got["vision_sft"]["single"]["encoded"] == [5, 5, 4]


def _cut_after_first_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a run's output directory as a kill after its first save would have left it."""
    import shutil

    shutil.copytree(src, dst)
    for later in sorted(dst.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[1:]:
        shutil.rmtree(later)
    return dst


def _first_checkpoint_step(output_dir: Path) -> int:
    return min(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))


def test_two_process_checkpoint_resumes_on_one_and_three(spawned_runs):
    """Checkpoints of a 2-process job (LoRA: replicated; full weights: DCP shards) resumed on 1 process and on
    3: the steps after the checkpoint are those of the uninterrupted 2-process run."""
    root, _, got = spawned_runs
    for name in ["lora", "full"]:
        two = got[name]["two"]
        want = two["history"][_first_checkpoint_step(root / "three" / name):]
        assert want and len(want) < len(two["history"])
        for ranks in ("one", "three"):
            _assert_same_run(got[name][ranks]["history"], want, got[name][ranks]["weights"], two["weights"])
            assert [m["step"] for m in read_metrics(root / ranks / name)] == [m["step"] for m in two["history"]]


def _resume(output_dir: Path) -> list[str]:
    """Overrides that resume the job whose config.yaml (and checkpoints) are in ``output_dir``."""
    return [f"output.output_dir={output_dir}", "output.resume=true"]


FAILING_REWARD = """
import os, signal, time

calls = 0


def reward(prompts, completions, **kwargs):
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == 1:  # rank 1 dies in the first step; rank 0 waits on it
        print(f"rank 1 is going down at {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
"""


def test_a_killed_rank_ends_the_job_quickly_with_its_error(tmp_path):
    """Rank 1 is killed in step 1 while rank 0 is in a collective with it: the launcher ends the whole job,
    naming the rank and its signal, long before the process-group timeout would (full weights: no PEFT to
    import in the workers)."""
    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    out = tmp_path / "out"
    args = QUICK + ["lora.enabled=false", "train.max_steps=4", f"output.output_dir={out}",
                    f"rewards=[{{function: '{reward}:reward'}}]", "distributed.timeout_s=300"]
    proc = subprocess.run([sys.executable, "-m", "longrl", "train", str(_demo_yaml(tmp_path)),
                           "--nproc-per-node", "2", *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    ended = time.time()
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "rank 1 is going down" in log and "SIGKILL" in log, log[-3000:]
    killed = float(log.split("rank 1 is going down at ")[1].split()[0])
    assert ended - killed < 60, log[-3000:]  # ended by the launcher, not by the 300 s process-group timeout
    assert not list(out.glob("checkpoint-*"))  # nothing half-saved


def _demo_yaml(tmp_path) -> Path:
    path = tmp_path / "demo.yaml"
    path.write_text(demo_config().to_yaml())
    return path


def _bitsandbytes_cpu() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True
