"""The whole GRPO step of a vision-language model on one GPU: Qwen2.5-VL-7B's shape (random weights, no download),
LoRA r=32 on the language model, G=8, one 1,024 × 1,024 image a prompt (issue 44's measurement).

The model is built from Qwen2.5-VL-7B-Instruct's numbers written below (SHAPES: the language model and the
32-layer vision tower with its window attention), the processor from its known image settings (patch 14, merge 2,
temporal patch 2, min/max pixels, CLIP's mean and std) over a tokenizer built in code that holds Qwen's special
tokens at their real ids ("<tN>" words are token N). Each prompt is one user message: a random-pixel RGB image
(seeded, one per prompt) then --prompt-len random text tokens; completions of exactly --completion tokens
(generation.ignore_eos), a random reward, beta 0.04 (the reference pass), loss dapo, offloaded checkpointing
pinned (--auto-layout: the planner decides), as in grpo_e2e.py. Every arm runs in a fresh process of its own
(this program with --child), so an out-of-memory or a crash in one arm cannot poison the next; per arm: time and
peak GPU memory per phase (the trainer's phase metrics: generation, rewards, reference, update), the whole step,
and how often the vision tower ran in each phase (calls and images through it, counted by a hook on the tower).

Modes (--arms, --probe):
  (a) --budget-gib 15 --load-in-4bit --completion 2048: the whole step inside train.gpu_memory_gib=15 (a 16 GB
      card), NF4 base (the tower and projector kept 16-bit), time and peak per phase.
  (b) --budget-gib 22 --load-in-4bit --probe: the longest completions that fit (8 completions of one prompt):
      doubling from --probe-start, then bisecting down to --probe-resolution tokens, each length a fresh process.
      A length fits when the whole step finishes; it does not when it runs out of memory or the planner refuses it
      before the weights load; a probe stopped by the time limit settles nothing. Each probe is written to
      RESULTS/<stem>_probes.json as it ends; --probe-state FILE continues a search from an earlier call's file.
  (c) --arms longrl,per-completion,trl --prompts 4 --completion 2048 (bf16): longrl as it runs (each prompt's
      VisionPrompt shared by its G completions: the tower once per prompt); `per-completion`: the same trainer with
      the batch's vision list built with a copy of the VisionPrompt per completion (features not shared: the tower
      runs once per completion in the step's passes; done in this program by replacing
      longrl.recipes.grpo.repeat_groups, src/ unchanged); `trl`: TRL 1.15's GRPOTrainer.train() on the same model
      shape, LoRA targets, data (an `image` column) and reward, its transformers `generate` path, completions
      forced by min_new_tokens, gradient checkpointing, bf16.

    python benchmarks/vision_grpo.py --budget-gib 15 --load-in-4bit --completion 2048                 # (a)
    python benchmarks/vision_grpo.py --budget-gib 22 --load-in-4bit --probe --deadline 560            # (b)
    python benchmarks/vision_grpo.py --arms longrl,per-completion,trl --prompts 4 --completion 2048     # (c)
    python benchmarks/vision_grpo.py --smoke      # every mode on the CPU, tiny shape; writes to /tmp only

Output: RESULTS/vision_grpo_<shape>_<P>x<G>x<L>_<gpu><tag>.{json,md} (RESULTS = benchmarks/results or
$LONGRL_RESULTS_DIR), with the command, GPU, versions and date; the probe: ..._probe.{json,md} and _probes.json.
Arms from separate calls merge: --merge A.json B.json writes one table (an arm given twice: the later file's).
--smoke runs (a), (b) (lengths 8 → 32) and (c) on the CPU with SHAPES["tiny"] (2 layers, hidden 64, 56-px images),
TRL too when it imports (PYTHONPATH=/tmp/trl_site after `pip install --no-deps --target /tmp/trl_site trl==1.15.0`),
and writes under /tmp/vision_grpo_smoke: a CPU smoke run is never a result.

On the GPU machine (one H200; Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, peft, accelerate, torchvision,
Pillow; no bitsandbytes, TRL or datasets). Here, in the checkout's root, once:

    printf '/.whl/\\n' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        trl==1.15.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_24_x86_64 -d /tmp/bnb bitsandbytes==0.50.2
    unzip -q -o /tmp/bnb/bitsandbytes-0.50.2-*.whl -d .whl/bnb-0.50.2-slim && find .whl/bnb-0.50.2-slim \\
        -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda13*.so' -delete  # CUDA 13 + CPU libraries
    du -sh .whl                                                                        # must stay under 64 MiB

Device calls, kind nvidia-h200, each with carry [".whl"] and timeout_s 600, one mode a call; each command begins
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD/.whl/bnb-0.50.2-slim:$PWD/src PYTHONUNBUFFERED=1 LONGRL_RESULTS_DIR=$OUT &&
then:
  (a) python3 benchmarks/vision_grpo.py --budget-gib 15 --load-in-4bit --completion 2048 --deadline 560
  (b) python3 benchmarks/vision_grpo.py --budget-gib 22 --load-in-4bit --probe --deadline 560
      It starts at 16,384 (the issue's target). To continue in a further call, put the _probes.json that came back
      into the checkout (mkdir -p .whl/state && cp <files_at>/vision_grpo_*_probes.json .whl/state/) and add
      --probe-state .whl/state/<that file>; a probe the deadline cut short is tried again there.
  (c) python3 benchmarks/vision_grpo.py --arms longrl,per-completion,trl --prompts 4 --completion 2048 --deadline 570
      If the arms do not all finish in one call, run the missing ones in the next (--arms trl, the same flags) and
      join the files here: python benchmarks/vision_grpo.py --merge <first>.json <second>.json.
      The TRL arm first checks that transformers' generate, called TRL's way, reuses its KV cache (grpo_e2e.py's
      check; it did with this model on 5.17 and 5.25 on the CPU) and stops with an error if not: then run --arms trl
      on transformers 5.24 (python3 -m pip download --no-deps ... -d .whl/tf524 transformers==5.24.0 peft==0.21.2,
      installed with --target /tmp/site_tf524 and PYTHONPATH=/tmp/site_tf524:... before the rest), as
      device_run.sh's with_tf524 does for grpo_e2e's TRL anchor.
--deadline (seconds from the program's start) bounds every arm and probe: each process gets the time left, and one
cut short is recorded as stopped by the deadline, never as a figure. Measured on one H100 on 2026-12-06
(benchmarks/results/gpu_session_2026-12-06b.md): the program's deadline must end inside the call's own limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (HERE, ROOT / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

T0 = time.perf_counter()
GIB = 2 ** 30
STEM = "vision_grpo"
SMOKE_DIR = Path(tempfile.gettempdir()) / "vision_grpo_smoke"

# Qwen's special tokens and their ids in Qwen2.5-VL's tokenizer (added tokens after the 151,643 BPE tokens)
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
                    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
                    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
                    "<|image_pad|>": 151655, "<|video_pad|>": 151656}
# Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json
SHAPES = {
    "qwen2.5-vl-7b": dict(
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, sliding_window=32768,
                  max_window_layers=28, attention_dropout=0.0,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24])),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                    out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu"),
        special=QWEN_SPECIAL_IDS, bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>",
        image=dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                   image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711]),
        image_px=1024,
    ),
    # CPU smoke shape: 2 decoder layers of hidden 64, a 2-block tower, 56-px images (4 × 4 patches, 4 image tokens)
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=640, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, attention_dropout=0.0,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2])),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, out_hidden_size=64,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                    fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu"),
        special={t: 600 + k for k, t in enumerate(QWEN_SPECIAL_IDS)}, bos="<|endoftext|>", eos="<|im_end|>",
        pad="<|endoftext|>",
        image=dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                   image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711]),
        image_px=56,
    ),
}
ROLE_WORDS = ("system", "user", "assistant")  # the chat template's role names, words of their own
# Qwen's chat format: an image part is <|vision_start|><|image_pad|><|vision_end|> (the processor repeats the pad
# once per image token)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PHASES = ("generation", "rewards", "reference", "update")
ARMS = ("longrl", "per-completion", "trl")


# ---------------------------------------------------------------------------------------------- model and data
def build_tokenizer(shape: dict):
    """A word-level fast tokenizer: "<tN>" is token N (N below the first special id), Qwen's special tokens at their
    ids, the role words after them; words split at whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = shape["special"]
    first = min(special.values())
    vocab = {f"<t{i}>": i for i in range(first)}
    vocab.update(special)
    top = max(special.values())
    vocab.update({w: top + 1 + k for k, w in enumerate(ROLE_WORDS)})
    unk = "<t3>"  # never drawn (prompt tokens start at 4)
    assert max(vocab.values()) < shape["text"]["vocab_size"]
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=shape["bos"], eos_token=shape["eos"],
                                  pad_token=shape["pad"], unk_token=unk,
                                  extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    tok.chat_template = CHAT_TEMPLATE
    for t, i in special.items():
        assert tok.convert_tokens_to_ids(t) == i, (t, i)
    return tok


def build_processor(shape: dict, tok):
    """Qwen2.5-VL's processor from its image settings over ``tok`` (images only: no video processor)."""
    import transformers as tf

    image_cls = getattr(tf, "Qwen2VLImageProcessorPil", None) or tf.Qwen2VLImageProcessor
    s = shape["image"]
    image_processor = image_cls(patch_size=s["patch_size"], merge_size=s["merge_size"],
                                temporal_patch_size=s["temporal_patch_size"], min_pixels=s["min_pixels"],
                                max_pixels=s["max_pixels"], image_mean=s["image_mean"], image_std=s["image_std"])

    class Qwen2_5_VLProcessor(tf.Qwen2_5_VLProcessor):  # images only (the video processor wants torchvision)
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)


def build_config(shape: dict, tok, attn: str):
    import transformers as tf

    sp = shape["special"]
    text = dict(shape["text"], bos_token_id=sp[shape["bos"]], eos_token_id=sp[shape["eos"]],
                pad_token_id=sp[shape["pad"]])
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=dict(shape["vision"]),
                              image_token_id=sp["<|image_pad|>"], video_token_id=sp["<|video_pad|>"],
                              vision_start_token_id=sp["<|vision_start|>"], vision_end_token_id=sp["<|vision_end|>"],
                              tie_word_embeddings=False)
    cfg._attn_implementation = attn
    return cfg


def build_model(shape: dict, tok, device, dtype):
    """A random-weight Qwen2.5-VL of ``shape`` created on ``device`` in ``dtype`` (the model's own initialisation),
    SDPA attention, in train mode, its generation config holding the special ids."""
    import torch
    import transformers as tf

    cfg = build_config(shape, tok, "sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tf.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(old)
    model.to(device)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (cfg.text_config.bos_token_id, cfg.text_config.eos_token_id,
                                                            cfg.text_config.pad_token_id)
    model.train()
    return model


def make_rows(n: int, prompt_len: int, image_px: int, first_special: int, seed: int = 0) -> list[dict]:
    """``n`` rows {"prompt": ``prompt_len`` random "<tN>" words, "image": a random-pixel RGB image}, seeded."""
    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, first_special, (prompt_len,), generator=g).tolist()
        pixels = torch.randint(0, 256, (image_px, image_px, 3), generator=g, dtype=torch.uint8).numpy()
        rows.append({"prompt": " ".join(f"<t{i}>" for i in ids), "image": Image.fromarray(pixels, "RGB")})
    return rows


def prompt_tokens(processor, config, rows) -> list[dict]:
    """Each row's prompt as longrl encodes it: total tokens, image tokens, the image grid."""
    from longrl.models.vision import encode_prompt

    out = []
    for row in rows:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["prompt"]}]}]
        p = encode_prompt(processor, config, messages, [row["image"]])
        out.append(dict(tokens=len(p.input_ids), image_tokens=int(p.image_positions.numel()),
                        grid_thw=p.image_inputs["image_grid_thw"].tolist()[0]))
    return out


def lora_target_names(model) -> list[str]:
    """The language model's linear layers that longrl's LoRA targets (lora.vision_modules none): TRL gets the same."""
    from longrl.models.vision import vision_family
    from longrl.models.vision.adapters import lora_targets

    return lora_targets(model, vision_family(model.config), ["all-linear"], "none")


# ---------------------------------------------------------------------------------------------- tower counter
class TowerCounter:
    """Counts the vision tower's calls and the images through it (patch rows / patches per image), by phase."""

    def __init__(self, model, patches_per_image: int):
        from longrl.models import base_model

        self.phase = "outside"
        self.calls: dict[str, int] = {}
        self.images: dict[str, float] = {}
        self.per_image = patches_per_image
        tower = base_model(model).model.visual
        self.handle = tower.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("pixel_values"))
        self.calls[self.phase] = self.calls.get(self.phase, 0) + 1
        self.images[self.phase] = self.images.get(self.phase, 0) + x.shape[0] / self.per_image

    def reset(self):
        self.calls, self.images = {}, {}

    def totals(self) -> dict:
        return dict(calls=dict(self.calls), images=dict(self.images), calls_total=sum(self.calls.values()),
                    images_total=sum(self.images.values()))


# ---------------------------------------------------------------------------------------------- arms (children)
def per_completion_groups(prompts, num_generations):
    """repeat_groups with a copy of each VisionPrompt per completion (no shared or kept features): the tower then
    runs once per completion in the passes (the layout the once-per-group design saves)."""
    if prompts is None:
        return None
    return [dataclasses.replace(p, cached=None) if p is not None else None
            for p in prompts for _ in range(num_generations)]


def run_longrl(args, shape: dict, root: Path) -> dict:
    import torch

    from bench_setup import REWARD_FILE, bench_lora
    from longrl.config import Config, RewardSpec, validate
    from longrl.models import apply_lora, calibration_ids, quantize_model
    from longrl.models.vision import vision_family
    from longrl.models.vision.adapters import vision_module_prefixes
    import longrl.recipes.grpo as grpo_recipe

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tok = build_tokenizer(shape)
    processor = build_processor(shape, tok)
    model = build_model(shape, tok, dev, torch.bfloat16 if cuda else torch.float32)
    rows = make_rows(args.prompts, args.prompt_len, shape["image_px"], min(shape["special"].values()))
    encoded = prompt_tokens(processor, model.config, rows)
    quant = None
    if args.load_in_4bit:  # NF4 with dynamic 16-bit exceptions; the vision tower and projector stay 16-bit
        keep = vision_module_prefixes(model, vision_family(model.config))
        ids = calibration_ids(vocab_size=min(shape["special"].values())).to(dev)
        quant = quantize_model(model, ids, keep_under=keep).lines()
        print("\n".join(quant), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    lora = bench_lora()
    model = apply_lora(model, lora)
    reward = root / "reward.py"
    reward.write_text(REWARD_FILE)
    cfg = Config()
    cfg.model.offload_activations = None if args.auto_layout else True
    cfg.model.device = dev.type
    cfg.model.load_in_4bit = args.load_in_4bit
    cfg.train.gpu_memory_gib = args.budget_gib if cuda else 0.0  # the budget acts on CUDA (planner, cap)
    cfg.lora = lora
    cfg.data.source, cfg.data.shuffle = "memory:vision_grpo", False
    cfg.data.max_prompt_length = max(e["tokens"] for e in encoded)
    cfg.generation.max_completion_length, cfg.generation.ignore_eos = args.completion, True
    cfg.grpo.num_generations, cfg.grpo.beta, cfg.grpo.loss_type = args.G, 0.04, "dapo"
    cfg.train.prompts_per_step, cfg.train.max_steps, cfg.train.learning_rate = args.prompts, args.steps, 1e-5
    cfg.rewards = [RewardSpec(function=f"{reward}:random_reward")]
    cfg.output.output_dir, cfg.output.progress_bar, cfg.output.tensorboard = str(root / "run"), False, False
    cfg.output.log_completions, cfg.output.save_steps = 0, 0
    validate(cfg)
    if cuda and args.budget_gib:
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() <= args.budget_gib * GIB, "weights alone exceed the budget"
    if args.arm == "per-completion":
        grpo_recipe.repeat_groups = per_completion_groups
    per_image = encoded[0]["image_tokens"] * shape["image"]["merge_size"] ** 2
    counter = TowerCounter(model, per_image)
    towers = []

    class PerStep:  # the tower's calls of each step, then a fresh count
        def on_step_end(self, step, metrics):
            towers.append(counter.totals())
            counter.reset()

    trainer = grpo_recipe.GRPOTrainer(cfg, model=model, tokenizer=processor, rows=rows, callbacks=[PerStep()])
    phase = trainer._phase

    def counted_phase(name):  # the tower's calls by the phase they fall in
        counter.phase = name
        return phase(name)

    trainer._phase = counted_phase
    counter.reset()
    history = trainer.train()
    last = history[-1]
    n_seq = args.prompts * args.G
    train_tokens = sum(e["tokens"] for e in encoded) * args.G + n_seq * args.completion
    phases = {}
    for name in PHASES:
        t = last.get(f"{name}_time_s")
        tokens = {"generation": n_seq * args.completion, "reference": train_tokens, "update": train_tokens}.get(name)
        phases[name] = dict(seconds=t, tokens_per_s=tokens / t if tokens and t else None,
                            peak_gib=last.get(f"{name}_peak_gib"))
    peaks = [p["peak_gib"] for p in phases.values() if p["peak_gib"] is not None]
    cap = None
    if cuda and args.budget_gib:
        try:
            torch.empty(int((args.budget_gib + 1) * GIB), dtype=torch.uint8, device=dev)
            cap = "NOT enforced: an allocation past the budget succeeded"
        except torch.OutOfMemoryError:
            cap = "enforced: an allocation past the budget raised out-of-memory"
    plan = trainer.layout.plan
    return dict(arm=args.arm, phases=phases, step_seconds=last["step_time_s"],
                step_peak_gib=max(peaks) if peaks else None,
                tower=towers[-1], tower_per_step=towers, prompts_encoded=encoded, cap=cap, quantization=quant,
                weights_gib=sum(t.numel() * t.element_size() for t in model.parameters()) / GIB,
                kv_cache_gib=trainer.sampler.last_stats.get("kv_cache_bytes", 0) / GIB if trainer.sampler else None,
                sampler_stats={k: v for k, v in (trainer.sampler.last_stats if trainer.sampler else {}).items()
                               if isinstance(v, (int, float, str, bool))},
                layout=dict(offload=trainer.layout.offload_activations,
                            checkpointing=trainer.layout.gradient_checkpointing,
                            mlp_tile_tokens=trainer.layout.mlp_tile_tokens),
                predicted_training_gib=plan.predicted_gpu_bytes / GIB if plan is not None else None,
                plan=plan.table() if plan is not None else None,
                history=[{k: v for k, v in h.items() if not isinstance(v, str)} for h in history])


def run_trl(args, shape: dict, root: Path) -> dict:
    """TRL's own loop on the same shape, LoRA targets, rows and reward: GRPOTrainer.train() for --steps steps, P
    prompts × G completions an optimizer step (batches of at most 8 completions, the rest by accumulation),
    completions forced to --completion tokens (min_new_tokens), gradient checkpointing, bf16, beta 0.04."""
    import random

    import torch
    from peft import LoraConfig as PeftLoraConfig
    from transformers import TrainerCallback

    import trl_baseline as tb

    trl, _ = tb._import_trl()
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tok = build_tokenizer(shape)
    processor = build_processor(shape, tok)
    model = build_model(shape, tok, dev, torch.bfloat16 if cuda else torch.float32)
    model.config.use_cache = model.generation_config.use_cache = True
    rows = make_rows(args.prompts, args.prompt_len, shape["image_px"], min(shape["special"].values()))
    encoded = prompt_tokens(processor, model.config, rows)
    targets = lora_target_names(model)
    n_seq = args.prompts * args.G
    per_device = min(n_seq, 8)
    config = GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=per_device,
                        gradient_accumulation_steps=n_seq // per_device, num_generations=args.G,
                        max_completion_length=args.completion, generation_kwargs={"min_new_tokens": args.completion},
                        temperature=1.0, beta=0.04, loss_type="dapo", learning_rate=1e-5, max_steps=args.steps,
                        gradient_checkpointing=True, bf16=cuda, use_cpu=not cuda, report_to=[], logging_steps=1,
                        save_strategy="no", seed=0, dataloader_num_workers=0, shuffle_dataset=False)
    # TRL's multimodal rows: a conversational prompt and an `image` column (it puts the image part before the text,
    # the messages longrl builds from a plain prompt)
    data = {"prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows] * args.steps,
            "image": [r["image"] for r in rows] * args.steps}
    dataset = sys.modules["datasets"].Dataset.from_dict(data)
    per_image = encoded[0]["image_tokens"] * shape["image"]["merge_size"] ** 2
    counter = TowerCounter(model, per_image)
    times, peaks, towers = [], [], []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            counter.reset()
            counter.phase = "step"
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() / GIB)
            times.append(time.perf_counter() - self.start)
            towers.append(counter.totals())
            print(f"TRL step {len(times)}: {times[-1]:.2f} s, tower {towers[-1]}", flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [random.random() for _ in completions],
                          args=config, train_dataset=dataset, processing_class=processor,
                          peft_config=PeftLoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=targets,
                                                     task_type="CAUSAL_LM"),
                          callbacks=[StepClock()])
    from grpo_e2e import generate_reuses_kv_cache

    reuses = generate_reuses_kv_cache(trainer.model)  # TRL's way of calling generate (transformers 5.17: it does not)
    print(f"generate, called TRL's way, reuses its KV cache: {reuses}", flush=True)
    if not reuses:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__}'s generate, called as TRL calls it, re-runs the "
                           "whole sequence for every new token: run this arm on transformers 5.24 (see the docstring)")
    trainer.train()
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    return dict(arm="trl", trl=trl.__version__, datasets_stub=tb.DATASETS_STUB_USED, step_seconds=times[-1],
                generate_reuses_kv_cache=reuses,
                step_times=times, step_peak_gib=peaks[-1] if peaks else None, tower=towers[-1],
                tower_per_step=towers, mean_completion_length=lengths[-1] if lengths else None,
                prompts_encoded=encoded, lora_targets=len(targets))


def child(args) -> None:
    """One arm in this process; its record (or the error) goes to --child-out as JSON."""
    shape = SHAPES[args.shape]
    out = Path(args.child_out)
    record = dict(arm=args.arm, completion=args.completion, prompts=args.prompts)
    try:
        import peft
        from results_io import run_meta

        record["meta"] = run_meta(peft=peft.__version__, **trl_version())  # each arm's own versions
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            r = run_trl(args, shape, Path(tmp)) if args.arm == "trl" else run_longrl(args, shape, Path(tmp))
            r["wall_seconds"] = time.perf_counter() - start
        record.update(status="ok", result=r)
    except BaseException as e:  # noqa: BLE001 - the parent classifies it
        text = "".join(traceback.format_exception(e))
        print(text, file=sys.stderr, flush=True)
        record.update(status=classify(e, text), error=f"{type(e).__name__}: {e}"[:2000], traceback=text[-4000:])
    out.write_text(json.dumps(record, indent=2, default=str))
    if record["status"] != "ok":
        sys.exit(3)


def classify(e: BaseException, text: str) -> str:
    """out_of_memory (an allocation past the budget or the card), refused (the planner: the step cannot fit), error."""
    name = type(e).__name__
    if name == "PlanError" or "longrl.memory.planner.PlanError" in text or "PlanError:" in text:
        return "refused"
    if name == "OutOfMemoryError" or "CUDA out of memory" in text or "out of memory" in str(e).lower():
        return "out_of_memory"
    return "error"


# ---------------------------------------------------------------------------------------------- the parent
def time_left(args) -> float | None:
    return None if not args.deadline else args.deadline - (time.perf_counter() - T0)


def spawn(args, arm: str, completion: int, tmp: Path) -> dict:
    """Run one arm in a fresh process (the time left as its limit); its record, or why there is none."""
    out = tmp / f"{arm}_{completion}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--child-out", str(out), "--arm", arm,
           "--completion", str(completion),
           "--shape", args.shape, "--prompts", str(args.prompts), "--G", str(args.G),
           "--prompt-len", str(args.prompt_len), "--steps", str(args.steps), "--budget-gib", str(args.budget_gib)]
    cmd += ["--load-in-4bit"] * args.load_in_4bit + ["--auto-layout"] * args.auto_layout
    left = time_left(args)
    if left is not None and left < 30:
        return dict(arm=arm, completion=completion, status="not_run", error="deadline: under 30 s left")
    print(f"=== {arm}, {args.prompts} x {args.G} x {completion}: {' '.join(cmd[2:])}", flush=True)
    env = dict(os.environ)
    if arm == "trl" and not cuda_available():
        env.setdefault("TRITON_INTERPRET", "1")  # TRL's log-prob kernel is Triton's: its interpreter on the CPU
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=left, env=env).returncode
    except subprocess.TimeoutExpired:
        return dict(arm=arm, completion=completion, status="timeout", seconds=time.perf_counter() - start,
                    error=f"stopped by the deadline after {time.perf_counter() - start:.0f} s")
    if not out.exists():
        return dict(arm=arm, completion=completion, status="out_of_memory" if rc in (-9, 137) else "error",
                    error=f"the process exited {rc} without a record")
    record = json.loads(out.read_text())
    record["seconds"] = time.perf_counter() - start
    print(f"=== {arm} {completion}: {record['status']} after {record['seconds']:.0f} s", flush=True)
    return record


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def stem_of(args, suffix: str = "", length: str | None = None, gpu: str | None = None) -> str:
    """vision_grpo_<shape>_<P>x<G>x<length>_<gpu>[_4bit][_capN]<suffix><tag>; gpu: this machine's card (h100, h200,
    cpu) unless given."""
    from results_io import card_tag

    gpu = gpu or card_tag()
    base = "_4bit" if args.load_in_4bit else ""
    cap = f"_cap{args.budget_gib:g}" if args.budget_gib else ""
    length = str(args.completion) if length is None else length
    return f"{STEM}_{args.shape}_{args.prompts}x{args.G}x{length}_{gpu}{base}{cap}{suffix}{args.tag}"


def arms_main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        records = [spawn(args, arm, args.completion, Path(tmp)) for arm in args.arms]
    write_arms(args, records, stem_of(args))


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def write_arms(args, records: list[dict], stem: str, meta: dict | None = None) -> None:
    """The arms' table; ``meta``: the run's (date, GPU, versions, command), this process's when None."""
    from results_io import run_meta, write_result

    meta = meta or run_meta(**trl_version())
    ok = [r for r in records if r.get("status") == "ok"]
    first = ok[0]["result"] if ok else {}
    enc = (first.get("prompts_encoded") or [{}])[0]
    base = ("NF4 4-bit base (dynamic 16-bit exceptions; tower and projector 16-bit)" if args.load_in_4bit else
            "bf16" if meta["gpu"] != "CPU" else "float32 on the CPU")
    lines = [f"# Whole GRPO step, {args.shape} shape (random weights, {base}, LoRA r=32 on the language model), "
             f"{meta['gpu']}", "", f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}"
             + (f", TRL {meta['trl']}" if meta.get("trl") else "") + ".  ", f"`{meta['command']}`", "",
             f"{args.prompts} prompt(s) × {args.G} completions of exactly {args.completion} tokens; each prompt one "
             f"{SHAPES[args.shape]['image_px']} × {SHAPES[args.shape]['image_px']} random-pixel image "
             f"(grid {enc.get('grid_thw')}, {enc.get('image_tokens')} image tokens) and {args.prompt_len} text tokens "
             f"({enc.get('tokens')} prompt tokens in all); beta 0.04, loss dapo. Budget: train.gpu_memory_gib = "
             f"{args.budget_gib or 'none'}. Figures of step {args.steps} of {args.steps}; each arm a fresh "
             "process.", ""]
    lines += ["| arm | status | whole step s | step peak GiB | generation s | reference s | update s | "
              "tower calls / step (rollout, passes) | images through the tower / step |", "|---" * 9 + "|"]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r['arm']} | {r.get('status')}: {str(r.get('error', ''))[:120]} | | | | | | | |")
            continue
        x = r["result"]
        t = x["tower"]
        ph = x.get("phases") or {}
        if r["arm"] == "trl":
            split = f"{t['calls_total']} (one step: generate and every forward)"
        else:
            rollout = t["calls"].get("generation", 0)
            split = f"{t['calls_total']} ({rollout}, {t['calls_total'] - rollout})"
        lines.append(f"| {r['arm']} | ok | {_f(x['step_seconds'])} | {_f(x.get('step_peak_gib'))} | "
                     f"{_f(ph.get('generation', {}).get('seconds'))} | {_f(ph.get('reference', {}).get('seconds'))} | "
                     f"{_f(ph.get('update', {}).get('seconds'))} | {split} | {_f(t['images_total'], '{:.0f}')} |")
    described = {"longrl": "longrl as it runs: each prompt's VisionPrompt shared by its G completions (the tower once "
                           "per prompt in the rollout, its features kept for the passes while it is frozen)",
                 "per-completion": "the same trainer with the batch's vision list built with a copy of the "
                                   "VisionPrompt per completion (longrl.recipes.grpo.repeat_groups replaced in this "
                                   "program): the tower runs once per completion in the passes, each copy's "
                                   "features then kept for the rest of the step",
                 "trl": "TRL's GRPOTrainer.train(): the image repeated for every completion row, the tower run "
                        "in generate and in every forward (calls count batched forwards, images count "
                        "images through the tower)"}
    lines += ["", "Arms: " + "; ".join(f"**{r['arm']}**: {described[r['arm']]}" for r in records) + "."]
    versions = {r["arm"]: {k: r["meta"].get(k) for k in ("torch", "transformers", "peft", "trl") if r["meta"].get(k)}
                for r in records if r.get("meta")}
    lines += ["", "Versions per arm (each its own process): " + "; ".join(
        f"{arm}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for arm, vs in versions.items()) + "."]
    for r in ok:
        x = r["result"]
        if r["arm"] == "trl":
            lines += ["", f"**trl**: TRL {x.get('trl')} GRPOTrainer.train(), transformers `generate` (no vLLM), "
                      f"min_new_tokens, gradient checkpointing, LoRA r=32 on the same {x.get('lora_targets')} "
                      f"language-model layers; step peak from torch.cuda.max_memory_allocated over the step; mean "
                      f"completion length {x.get('mean_completion_length')}; all steps: "
                      f"{', '.join(f'{s:.1f}' for s in x['step_times'])} s."]
            continue
        lines += ["", f"**{r['arm']}** per phase:", "", "| phase | seconds | tokens/s | peak GPU GiB | tower calls |",
                  "|---|---|---|---|---|"]
        for name, p in x["phases"].items():
            lines.append(f"| {name} | {_f(p['seconds'])} | {_f(p['tokens_per_s'], '{:,.0f}')} | {_f(p['peak_gib'])} "
                         f"| {x['tower']['calls'].get(name, 0)} |")
        lines += ["", f"Weights {x['weights_gib']:.2f} GiB, KV cache {_f(x.get('kv_cache_gib'))} GiB, layout "
                  f"{x['layout']}, allocator cap {x.get('cap') or 'none'}; planner's training prediction "
                  f"{_f(x.get('predicted_training_gib'))} GiB. Peaks: the trainer resets the counter at each phase's "
                  "start; the step's peak is the largest phase peak."]
        if x.get("plan"):
            lines += ["", "```", x["plan"], "```"]
        if x.get("quantization"):
            lines += ["", "```", *x["quantization"], "```"]
    write_result(stem, {**meta, **vars(args), "records": records}, lines)


def trl_version() -> dict:
    try:
        import trl

        return {"trl": trl.__version__}
    except Exception:  # noqa: BLE001
        return {}


# ---------------------------------------------------------------------------------------------- the probe
def probe_main(args) -> Path:
    """Doubling from --probe-start while the step fits, then bisecting between the longest length that fits and the
    shortest that does not, to --probe-resolution tokens; each probe a fresh process; the state saved after each."""
    from results_io import RESULTS, run_meta

    state_path = Path(args.probe_state) if args.probe_state else None
    probes: list[dict] = json.loads(state_path.read_text())["probes"] if state_path else []
    out_state = RESULTS / f"{stem_of(args, '_probes', 'L')}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        while True:
            length = next_probe(probes, args.probe_start, args.probe_resolution, args.probe_max)
            if length is None:
                break
            r = spawn(args, "longrl", length, Path(tmp))
            res = r.get("result") or {}
            probes.append(dict(completion=length, status=r["status"], seconds=r.get("seconds"),
                               error=r.get("error"), step_seconds=res.get("step_seconds"),
                               step_peak_gib=res.get("step_peak_gib"),
                               phases=res.get("phases"), cap=res.get("cap")))
            out_state.write_text(json.dumps(dict(args=vars(args), meta=run_meta(), probes=probes), indent=2,
                                            default=str))
            if r["status"] not in ("ok", "out_of_memory", "refused"):
                break  # a timeout or an error settles nothing: stop here (a later call may continue)
    write_probe(args, probes, out_state)
    return out_state


def next_probe(probes: list[dict], start: int, resolution: int, most: int) -> int | None:
    """The next length to try: ``start`` first; double past the longest fit until one fails; then bisect (None:
    settled to ``resolution``, or past ``most``). Probes that settled nothing (timeout, error) are not counted: a
    continued search tries their length again."""
    fits = [p["completion"] for p in probes if p["status"] == "ok"]
    fails = [p["completion"] for p in probes if p["status"] in ("out_of_memory", "refused")]
    lo = max(fits, default=None)
    hi = min((f for f in fails if lo is None or f > lo), default=None)
    if lo is None and hi is None:
        return start
    if hi is None:
        nxt = lo * 2
        return nxt if nxt <= most else None
    if lo is None:  # nothing fits yet: halve
        nxt = hi // 2
        return nxt if nxt >= resolution else None
    if hi - lo <= resolution:
        return None
    mid = (lo + hi) // 2
    return mid - mid % resolution if mid - mid % resolution > lo else mid


def write_probe(args, probes: list[dict], state_path: Path, meta: dict | None = None) -> None:
    """The probe's table; ``meta``: the run's (date, GPU, versions, command), this process's when None."""
    from results_io import card_tag, run_meta, write_result

    meta = meta or run_meta()
    fits = [p["completion"] for p in probes if p["status"] == "ok"]
    fails = [p["completion"] for p in probes if p["status"] in ("out_of_memory", "refused")]
    longest = max(fits, default=None)
    shortest_fail = min((f for f in fails if longest is None or f > longest), default=None)
    base = "NF4 4-bit base" if args.load_in_4bit else "bf16"
    lines = [f"# Longest completions that fit, {args.shape} shape ({base}, LoRA r=32), {args.prompts} prompt × "
             f"{args.G} completions, train.gpu_memory_gib = {args.budget_gib or 'none'}, {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}.  ",
             f"`{meta['command']}`", "",
             "Each length a whole GRPO step (rollout + reference + update) in a fresh process; fits = the step "
             "finished; does not = out of memory inside the budget or refused by the planner before the weights "
             "loaded. Doubling from --probe-start, then bisecting to --probe-resolution "
             f"({args.probe_resolution}) tokens.", "",
             "| completion tokens | result | whole step s | step peak GiB | process s | note |",
             "|---|---|---|---|---|---|"]
    for p in probes:
        lines.append(f"| {p['completion']:,} | {p['status']} | {_f(p.get('step_seconds'))} | "
                     f"{_f(p.get('step_peak_gib'))} | {_f(p.get('seconds'), '{:.0f}')} | "
                     f"{str(p.get('error') or '')[:100]} |")
    lines += ["", f"Longest that fits: {longest if longest is not None else 'none found'}"
              + (f"; shortest longer one that does not: {shortest_fail}" if shortest_fail else
                 "; no longer length failed (the search ended on time or --probe-max)") + ". "
              + f"Probe state (for --probe-state): {state_path.name}."]
    write_result(stem_of(args, "_probe", "L", gpu=card_tag(meta["gpu"])),
                 {**meta, **vars(args), "probes": probes, "longest_fit": longest, "shortest_fail": shortest_fail},
                 lines)


# ---------------------------------------------------------------------------------------------- merge, smoke
def merge_main(args) -> None:
    """One table from the arms of several result files (an arm given twice: the later file's)."""
    from results_io import card_tag, run_meta

    by_arm: dict[str, dict] = {}
    payloads = [json.loads(Path(f).read_text()) for f in args.merge]
    setting = ("shape", "prompts", "G", "prompt_len", "completion", "steps", "budget_gib", "load_in_4bit")
    for f, payload in zip(args.merge, payloads):
        for k in (*setting, "gpu"):
            if payload.get(k) != payloads[0].get(k):
                raise SystemExit(f"--merge: {f} has {k}={payload.get(k)!r}, {args.merge[0]} {payloads[0].get(k)!r}")
        for r in payload["records"]:
            by_arm[r["arm"]] = r
    for k in (*setting, "tag"):
        setattr(args, k, payloads[-1][k])
    records = [by_arm[a] for a in ARMS if a in by_arm]
    args.arms = [r["arm"] for r in records]
    # the runs' own date, GPU and versions (not this machine's); the command: each run's, then the merge
    meta = {k: payloads[-1].get(k) for k in ("date", "gpu", "torch", "transformers", "python", "trl")}
    meta["date"] = ", ".join(sorted({p["date"] for p in payloads}))
    meta["command"] = "`; `".join([*(p["command"] for p in payloads), run_meta()["command"]])
    write_arms(args, records, stem_of(args, "_merged", gpu=card_tag(meta["gpu"])), meta)


def smoke_main(args) -> None:
    """Every mode on the CPU with the tiny shape; files under /tmp (never a result). Fails loudly on any error."""
    import results_io

    results_io.RESULTS = SMOKE_DIR
    for old in SMOKE_DIR.glob(f"{STEM}_*"):
        old.unlink()
    tiny = dict(shape="tiny", G=8, prompt_len=8, steps=1, tag="_smoke", probe_state=None, deadline=0)
    failures = []
    try:
        import trl  # noqa: F401

        have_trl = True
    except ImportError:
        have_trl = False
        print("smoke: trl does not import here; its arm is skipped (see the docstring)", flush=True)
    modes = [("a", dict(budget_gib=15.0, load_in_4bit=True, completion=16, prompts=1, arms=["longrl"])),
             ("c", dict(budget_gib=0.0, load_in_4bit=False, completion=16, prompts=2,
                        arms=["longrl", "per-completion"] + ["trl"] * have_trl))]
    for name, over in modes:
        a = argparse.Namespace(**{**vars(args), **tiny, **over})
        with tempfile.TemporaryDirectory() as tmp:
            records = [spawn(a, arm, a.completion, Path(tmp)) for arm in a.arms]
        write_arms(a, records, stem_of(a))
        failures += [f"({name}) {r['arm']}: {r.get('error')}" for r in records if r["status"] != "ok"]
        towers = {r["arm"]: r["result"]["tower"] for r in records if r["status"] == "ok"}
        if name == "c" and "longrl" in towers and "per-completion" in towers:
            want = dict(longrl=a.prompts, **{"per-completion": a.prompts + a.prompts * a.G})
            for arm, n in want.items():
                if towers[arm]["calls_total"] != n:
                    failures.append(f"(c) {arm}: {towers[arm]['calls_total']} tower calls, expected {n}")
    # (b): the probe on a tiny scale (on the CPU nothing runs out of memory: it doubles to --probe-max)
    a = argparse.Namespace(**{**vars(args), **tiny, "budget_gib": 22.0, "load_in_4bit": True, "completion": 0,
                              "prompts": 1, "probe_start": 8, "probe_max": 32, "probe_resolution": 4})
    state = json.loads(probe_main(a).read_text())
    # --merge: the (c) file's arms split in two files and joined again
    c_file = next(SMOKE_DIR.glob(f"{STEM}_tiny_2x8x16_cpu_smoke.json"))
    payload = json.loads(c_file.read_text())
    halves = []
    for k, recs in enumerate((payload["records"][:1], payload["records"][1:])):
        halves.append(SMOKE_DIR / f"{STEM}_half{k}.json")
        halves[-1].write_text(json.dumps({**payload, "records": recs}))
    merge_main(argparse.Namespace(**{**vars(args), "merge": [str(h) for h in halves]}))
    merged = json.loads(next(SMOKE_DIR.glob(f"{STEM}_tiny_2x8x16_cpu_merged_smoke.json")).read_text())
    if [r["arm"] for r in merged["records"]] != [r["arm"] for r in payload["records"]]:
        failures.append(f"merge: arms {[r['arm'] for r in merged['records']]}")
    got = [p["completion"] for p in state["probes"]]
    if got != [8, 16, 32] or any(p["status"] != "ok" for p in state["probes"]):
        failures.append(f"(b) probes {[(p['completion'], p['status']) for p in state['probes']]}")
    # the search's decisions, without processes
    assert next_probe([], 16384, 1024, 1 << 17) == 16384
    seq = [dict(completion=16384, status="ok"), dict(completion=32768, status="out_of_memory")]
    assert next_probe(seq, 16384, 1024, 1 << 17) == 24576
    seq += [dict(completion=24576, status="ok"), dict(completion=28672, status="refused")]
    assert next_probe(seq, 16384, 1024, 1 << 17) == 26624
    assert next_probe([dict(completion=16384, status="out_of_memory")], 16384, 1024, 1 << 17) == 8192
    assert next_probe([dict(completion=16384, status="timeout")], 16384, 1024, 1 << 17) == 16384
    assert next_probe(seq + [dict(completion=26624, status="ok"), dict(completion=27648, status="ok")], 16384,
                      1024, 1 << 17) is None
    print("smoke:", "FAILED\n  " + "\n  ".join(failures) if failures else "every mode ran", flush=True)
    print(f"smoke files (not results): {SMOKE_DIR}", flush=True)
    if failures:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="text tokens a prompt, besides its image's")
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=1, help="steps per arm; figures of the last")
    ap.add_argument("--budget-gib", type=float, default=0.0, help="train.gpu_memory_gib (0: none); files get _capN")
    ap.add_argument("--load-in-4bit", action="store_true", help="NF4 base (longrl arms); files get _4bit")
    ap.add_argument("--auto-layout", action="store_true", help="model.offload_activations null (the planner decides)")
    ap.add_argument("--arms", default="longrl", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--probe", action="store_true", help="(b): the longest completions that fit")
    ap.add_argument("--probe-start", type=int, default=16384)
    ap.add_argument("--probe-max", type=int, default=1 << 17)
    ap.add_argument("--probe-resolution", type=int, default=1024)
    ap.add_argument("--probe-state", help="an earlier call's _probes.json: continue its search")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds from the start for every arm/probe (0: none)")
    ap.add_argument("--merge", nargs="+", help="result JSON files whose arms make one table")
    ap.add_argument("--smoke", action="store_true", help="every mode on the CPU, tiny shape, files under /tmp")
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", default="longrl", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.child_out = args.child_out or str(Path(tempfile.gettempdir()) / "vision_grpo_child.json")
        return child(args)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        ap.error(f"--arms: {bad}; choose from {', '.join(ARMS)}")
    if args.load_in_4bit and "trl" in args.arms:
        ap.error("--load-in-4bit is for the longrl arms (TRL's arm runs the bf16 shape)")
    if args.merge:
        return merge_main(args)
    if args.smoke:
        return smoke_main(args)
    if args.probe:
        return probe_main(args)
    arms_main(args)


if __name__ == "__main__":
    main()
