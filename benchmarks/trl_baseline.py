"""TRL side of the longrl-vs-TRL GRPO memory/speed benchmark.

Measures ONE TRL GRPO optimisation step (reference log-prob pass + policy forward/backward through
``GRPOTrainer.compute_loss``) on a fabricated batch, using TRL's own code paths (TRL 1.15.x).
No generation, no reward functions, no optimizer step: those are identical work for both sides and
are left out of the measurement.

Public API
----------
``build_random_model(shape, device, dtype, attn_implementation="sdpa")`` -> random-weight causal LM
``make_tokenizer(model)``                      -> minimal in-memory tokenizer TRL accepts
``apply_lora(model, r=32, alpha=64)``          -> PEFT LoRA on all linear projections (not lm_head)
``make_batch(G, P, C, vocab_size, device)``    -> fabricated GRPO batch dict
``trl_step(model, tokenizer, batch, *, layout, beta, reps)`` -> {"ref_s", "policy_s", "peak_gpu_gib", "oom", ...}
``release_trl(model)``                         -> undo TRL's patches on the model (fused head, "ref" adapter)

One ``trl_step`` call == one training step. Warm-up and the median over ``reps`` are the caller's job
(``reps`` is accepted for API symmetry and echoed back; it does not loop). The GRPOTrainer is built on
the first call for a given (model, layout, beta, G) and cached on the model, so later calls time only
the step. Gradient checkpointing: ``trl_step`` enables it itself (as ``Trainer.train()`` would),
so the caller need not; it is harmless if the caller already did.

Run ``python benchmarks/trl_baseline.py`` for a CPU self-test with the "tiny" shape.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import tempfile
import time
import types
from typing import Any

import warnings

import torch

# transformers 5.2x renamed gradient_checkpointing -> activation_checkpointing; TRL 1.15 still uses the
# old names, which spams FutureWarnings on every reference pass. Silence just those.
warnings.filterwarnings("ignore", message=r".*deprecated and will be removed in v6.*", category=FutureWarning)

__all__ = [
    "SHAPES",
    "build_random_model",
    "make_tokenizer",
    "apply_lora",
    "make_batch",
    "trl_step",
    "release_trl",
    "LORA_TARGETS",
]

# --------------------------------------------------------------------------------------------------
# `datasets` fallback. TRL 1.15 imports `datasets` at module import time (grpo_trainer.py, utils.py,
# base_trainer.py) and GRPOTrainer.__init__ insists on `isinstance(train_dataset, datasets.Dataset)`.
# The real package is shipped as a wheel (.whl/datasets-*.whl); this stub is only a safety net for a
# machine where `import datasets` fails (e.g. an incompatible pyarrow). It provides just what TRL's
# GRPO import path and constructor touch. Set LONGRL_TRL_FORCE_DATASETS_STUB=1 to force it (testing).
# --------------------------------------------------------------------------------------------------

DATASETS_STUB_USED = False


def _install_datasets_stub() -> None:
    global DATASETS_STUB_USED

    class Dataset(torch.utils.data.Dataset):
        def __init__(self, data: dict[str, list]):
            self._data = dict(data)
            self.column_names = list(self._data)
            self.cache_files = []

        @classmethod
        def from_dict(cls, mapping, **_):
            return cls(mapping)

        @classmethod
        def from_list(cls, rows, **_):
            keys = list(rows[0]) if rows else []
            return cls({k: [r[k] for r in rows] for k in keys})

        def __len__(self):
            return len(next(iter(self._data.values()))) if self._data else 0

        def __getitem__(self, i):
            if isinstance(i, str):
                return self._data[i]
            return {k: v[i] for k, v in self._data.items()}

        def __iter__(self):
            for i in range(len(self)):
                yield self[i]

        def map(self, *a, **k):  # pragma: no cover - not used by GRPO
            return self

        def remove_columns(self, cols):  # pragma: no cover
            cols = [cols] if isinstance(cols, str) else cols
            return Dataset({k: v for k, v in self._data.items() if k not in cols})

    class IterableDataset(torch.utils.data.IterableDataset):
        pass

    class DatasetDict(dict):
        pass

    class IterableDatasetDict(dict):
        pass

    def concatenate_datasets(dsets, *a, **k):  # pragma: no cover
        out: dict[str, list] = {}
        for d in dsets:
            for key, v in d._data.items():
                out.setdefault(key, []).extend(v)
        return Dataset(out)

    class Hasher:  # pragma: no cover
        @staticmethod
        def hash(x):
            return str(hash(repr(x)))

    import importlib.machinery

    mod = types.ModuleType("datasets")
    mod.__version__ = "0.0.0-stub"
    mod.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    mod.Dataset, mod.IterableDataset = Dataset, IterableDataset
    mod.DatasetDict, mod.IterableDatasetDict = DatasetDict, IterableDatasetDict
    mod.concatenate_datasets = concatenate_datasets
    mod.interleave_datasets = concatenate_datasets
    mod.load_dataset = None
    fp = types.ModuleType("datasets.fingerprint")
    fp.__spec__ = importlib.machinery.ModuleSpec("datasets.fingerprint", None)
    fp.Hasher = Hasher
    mod.fingerprint = fp
    sys.modules["datasets"] = mod
    sys.modules["datasets.fingerprint"] = fp
    DATASETS_STUB_USED = True


def _import_trl():
    """Import trl (and datasets, or the stub if datasets cannot be imported)."""
    if "trl.trainer.grpo_trainer" not in sys.modules:
        if os.environ.get("LONGRL_TRL_FORCE_DATASETS_STUB") == "1":
            _install_datasets_stub()
        else:
            try:
                import datasets  # noqa: F401
            except Exception as e:  # noqa: BLE001 - any import failure -> stub
                print(f"[trl_baseline] `import datasets` failed ({type(e).__name__}: {e}); using stub", file=sys.stderr)
                for k in [k for k in sys.modules if k == "datasets" or k.startswith("datasets.")]:
                    del sys.modules[k]
                _install_datasets_stub()
    import trl

    grpo_mod = importlib.import_module("trl.trainer.grpo_trainer")
    return trl, grpo_mod


# --------------------------------------------------------------------------------------------------
# Random-weight models of real architectures
# --------------------------------------------------------------------------------------------------

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # Qwen/Qwen2.5-1.5B
    "qwen2.5-1.5b": dict(
        arch="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct (dimensions only): the real model of the speculative and learning runs
    "smollm2-135m": dict(
        arch="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0),
        bos_token_id=1,
        eos_token_id=2,
    ),
    # CPU test shape (llama architecture)
    "tiny": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# meta-llama/Llama-3.1-70B (dimensions only; the multi-GPU and 4-bit scale runs): the 8B's vocabulary, RoPE and ids
SHAPES["llama-3.1-70b"] = {**SHAPES["llama-3.1-8b"], "hidden_size": 8192, "intermediate_size": 28672,
                           "num_hidden_layers": 80, "num_attention_heads": 64}

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_config(shape: str, attn_implementation: str):
    import transformers

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    rope = spec.pop("rope_parameters")
    fields = getattr(cls, "__dataclass_fields__", None) or {}
    import inspect

    if "rope_parameters" in fields or "rope_parameters" in inspect.signature(cls.__init__).parameters:
        spec["rope_parameters"] = rope
    else:  # transformers 4.x style
        spec["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            spec["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    spec["pad_token_id"] = 0
    spec["use_cache"] = False
    spec["attention_dropout"] = 0.0
    cfg = cls(**spec)
    cfg._attn_implementation = attn_implementation
    return cfg


def build_random_model(shape: str, device, dtype=torch.bfloat16, attn_implementation: str = "sdpa"):
    """Random-weight causal LM of a real architecture, created directly on ``device`` in ``dtype``.

    Weights come from the model's own ``_init_weights`` (normal, std=initializer_range=0.02), run on the
    target device (fast on GPU; ~16 GB of bf16 for the 8B shape). No download. Returns the bare model
    (no LoRA; see ``apply_lora``), in train mode, ``use_cache=False``.
    """
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    cfg = _make_config(shape, attn_implementation)
    device = torch.device(device)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            try:
                model = transformers.AutoModelForCausalLM.from_config(
                    cfg, dtype=dtype, attn_implementation=attn_implementation
                )
            except TypeError:  # older transformers: torch_dtype
                model = transformers.AutoModelForCausalLM.from_config(
                    cfg, torch_dtype=dtype, attn_implementation=attn_implementation
                )
    finally:
        torch.set_default_dtype(old_dtype)
    # Parameters are already on device in `dtype`; rotary inv_freq buffers stay fp32 as in from_pretrained.
    model.to(device=device)
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.train()
    return model


def make_tokenizer(model=None, *, pad_token_id: int | None = None, eos_token_id: int | None = None):
    """Minimal in-memory fast tokenizer (a ``PreTrainedTokenizerBase``) that GRPOTrainer accepts.

    TRL only needs pad/eos/bos ids from it here (we never tokenise text: the batch is token ids).
    Special-token ids are aligned with the model config (pad=0, eos/bos from the config).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = model.config if model is not None else None
    pad = pad_token_id if pad_token_id is not None else (getattr(cfg, "pad_token_id", None) or 0)
    eos = eos_token_id if eos_token_id is not None else getattr(cfg, "eos_token_id", 2)
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    bos = getattr(cfg, "bos_token_id", None)
    bos = 1 if bos is None else bos
    specials = {pad: "<pad>", eos: "<eos>"}
    if bos not in specials:
        specials[bos] = "<bos>"
    n = max(max(specials) + 1, 8)
    unk_id = n  # place <unk> after the specials
    vocab = {f"<t{i}>": i for i in range(n + 1)}
    for i, tok in specials.items():
        vocab.pop(f"<t{i}>")
        vocab[tok] = i
    vocab.pop(f"<t{unk_id}>")
    vocab["<unk>"] = unk_id
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token=specials.get(bos, "<bos>"),
        unk_token="<unk>",
        padding_side="left",
        truncation_side="left",
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tok


def apply_lora(model, r: int = 32, alpha: int | None = None, targets: list[str] | None = None):
    """Wrap ``model`` with a fresh LoRA adapter on all linear projections (never lm_head: TRL rejects it).

    Uses ``peft.get_peft_model`` with defaults, i.e. exactly what GRPOTrainer does when given a
    ``peft_config`` (adapter weights upcast to fp32 on a bf16 base, B=0 so the adapter starts as identity).
    """
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=0.0,
        target_modules=list(targets or LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def make_batch(G: int, P: int, C: int, vocab_size: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fabricated GRPO batch: no padding, random token ids, zero-mean advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab_size, (1, P), generator=g).expand(G, P).contiguous()
    completion = torch.randint(3, vocab_size, (G, C), generator=g)
    adv = torch.randn(G, generator=g)
    adv = (adv - adv.mean()) / (adv.std() + 1e-4)
    return {
        "prompt_ids": prompt.to(device),
        "completion_ids": completion.to(device),
        "advantages": adv.float().to(device),
    }


# --------------------------------------------------------------------------------------------------
# Trainer construction (cached per model)
# --------------------------------------------------------------------------------------------------

_CACHE_ATTR = "_trl_baseline_trainers"


def _gc_enable(model, kwargs):
    """Enable gradient checkpointing like Trainer.train() does (name differs across transformers 5.x)."""
    if getattr(model, "is_gradient_checkpointing", False):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):  # newer transformers 5.x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _dummy_reward(completions, **kwargs):  # never called: we do not generate
    return [0.0 for _ in completions]


def _get_trainer(model, tokenizer, *, layout: str, beta: float, G: int, C: int, ref_adapter: bool, bf16):
    on_cuda = next(model.parameters()).is_cuda
    bf16 = on_cuda if bf16 is None else bool(bf16)
    key = (layout, float(beta), G, ref_adapter, bf16)
    cache = model.__dict__.setdefault(_CACHE_ATTR, {})
    if key in cache:
        trainer = cache[key]
        # only the "dr_grpo" loss reads it; kept in step with the batch for fidelity
        trainer.max_completion_length = trainer.args.max_completion_length = C
        return trainer

    trl, grpo_mod = _import_trl()
    from trl import GRPOConfig, GRPOTrainer

    # GRPOTrainer.__init__ sends a usage ping (background thread); the GPU machine is offline.
    import huggingface_hub.constants as hf_constants

    hf_constants.HF_HUB_DISABLE_TELEMETRY = True

    if layout == "default":
        bs, ga = G, 1
    elif layout == "frugal":
        bs, ga = 1, G
    else:
        raise ValueError(f"layout must be 'default' or 'frugal', got {layout!r}")

    base = model.get_base_model()
    # TRL patches base.forward (fused LM head) on every construction; drop a previous patch so the
    # patches do not nest when several trainers are built on one model.
    base.__dict__.pop("forward", None)
    had_ref = "ref" in model.peft_config

    outdir = tempfile.mkdtemp(prefix="trl_baseline_")
    args = GRPOConfig(
        output_dir=outdir,
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        num_generations=G,
        max_completion_length=C,
        beta=beta,
        gradient_checkpointing=True,
        bf16=bf16,
        use_cpu=not on_cuda,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    Dataset = sys.modules["datasets"].Dataset
    train_dataset = Dataset.from_dict({"prompt": ["x"] * G})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_dummy_reward,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )
    # GRPOTrainer, given an already-wrapped PeftModel and beta != 0, copies the adapter into a frozen
    # "ref" adapter and uses it as the reference. Given a peft_config instead (the documented path), the
    # reference is the base model with adapters disabled. Default: mimic the documented path.
    if not ref_adapter and not had_ref and "ref" in model.peft_config:
        model.delete_adapter("ref")
        model.set_adapter("default")
    # Trainer.train() would set these; we drive the step by hand.
    trainer.current_gradient_accumulation_steps = ga
    _gc_enable(model, trainer.args.gradient_checkpointing_kwargs)
    trainer._bench = dict(bs=bs, ga=ga, grpo_mod=grpo_mod)
    cache[key] = trainer
    return trainer


def release_trl(model) -> None:
    """Undo what building GRPOTrainers did to ``model`` (use before handing the model to longrl)."""
    cache = model.__dict__.pop(_CACHE_ATTR, {})
    cache.clear()
    base = model.get_base_model()
    base.__dict__.pop("forward", None)
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
        model.set_adapter("default")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# The measured step
# --------------------------------------------------------------------------------------------------


def _sync(on_cuda: bool):
    if on_cuda:
        torch.cuda.synchronize()


def trl_step(
    model,
    tokenizer,
    batch: dict[str, torch.Tensor],
    *,
    layout: str,
    beta: float,
    reps: int = 1,
    ref_adapter: bool = False,
    bf16: bool | None = None,
) -> dict:
    """One TRL GRPO training step on a fabricated batch; returns timings and peak memory.

    model:   PEFT-wrapped causal LM on its device (see ``apply_lora``). Gradient checkpointing is
             enabled here if it is not already on.
    batch:   {"prompt_ids": Long[G, P], "completion_ids": Long[G, C], "advantages": Float[G]}, no padding.
    layout:  "default" -> per_device_train_batch_size=G, gradient_accumulation_steps=1
             "frugal"  -> per_device_train_batch_size=1, gradient_accumulation_steps=G
    beta:    KL coefficient; 0.0 -> TRL skips the reference pass entirely (ref_s = 0.0).
    reps:    not looped over (one call == one step); echoed back. Warm up + median is the caller's job.
    ref_adapter: False (default) -> reference = base model with adapters disabled (TRL's path when it
             wraps the model itself from a peft_config). True -> keep TRL's frozen "ref" adapter copy
             (TRL's path when handed an already-wrapped PeftModel with beta != 0).
    bf16:    GRPOConfig(bf16=...) i.e. accelerate bf16 autocast; None -> True on CUDA, False on CPU.

    Returns {"ref_s", "policy_s", "peak_gpu_gib", "oom", "loss", "layout", "beta", "G", "P", "C",
    "micro_batches", "reps"}; on OOM times/loss are None and oom is True. peak_gpu_gib is
    torch.cuda.max_memory_allocated() over the whole step (reset at its start; None on CPU); it
    includes the model weights and everything already resident. Gradients are zeroed (set to None)
    at the start, like optimizer.zero_grad(), and left populated at the end; no optimizer step.
    """
    prompt_ids = batch["prompt_ids"]
    completion_ids = batch["completion_ids"]
    advantages = batch["advantages"]
    G, P = prompt_ids.shape
    C = completion_ids.shape[1]
    device = prompt_ids.device
    on_cuda = device.type == "cuda"

    trainer = _get_trainer(model, tokenizer, layout=layout, beta=beta, G=G, C=C, ref_adapter=ref_adapter, bf16=bf16)
    grpo_mod = trainer._bench["grpo_mod"]
    bs, ga = trainer._bench["bs"], trainer._bench["ga"]
    disable_gradient_checkpointing = grpo_mod.disable_gradient_checkpointing
    use_adapter = grpo_mod.use_adapter
    split_tensor_dict = grpo_mod.split_tensor_dict

    out = dict(layout=layout, beta=beta, G=G, P=P, C=C, micro_batches=ga, reps=reps,
               ref_s=None, policy_s=None, peak_gpu_gib=None, oom=False, loss=None)

    model.train()
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    state = {}
    try:
        # Generation-batch tensors exactly as _generate_and_score_completions builds them (no padding).
        prompt_mask = torch.ones_like(prompt_ids, dtype=torch.long)
        completion_mask = torch.ones_like(completion_ids, dtype=torch.long)
        num_items_in_batch = trainer.accelerator.gather(completion_mask.sum()).sum()
        gen = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "num_items_in_batch": num_items_in_batch,
        }
        state["gen"] = gen

        # (a) reference pass: verbatim from GRPOTrainer._generate_and_score_completions (TRL 1.15).
        # old_per_token_logps is NOT computed there for these layouts (gradient_accumulation_steps %
        # (steps_per_generation * num_iterations) == 0 and no vLLM), so it is not computed here either.
        _sync(on_cuda)
        t0 = time.perf_counter()
        if beta != 0.0:
            prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
                unwrapped = trainer.accelerator.unwrap_model(trainer.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    ref_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                        trainer.model, prompt_completion_ids, attention_mask, C, batch_size=bs
                    )
            gen["ref_per_token_logps"] = ref_logps
            del prompt_completion_ids, attention_mask
        _sync(on_cuda)
        out["ref_s"] = time.perf_counter() - t0 if beta != 0.0 else 0.0

        # (b) policy: what Trainer.training_step does per micro-batch (compute_loss + accelerator.backward),
        # over TRL's split of the generation batch into steps_per_generation (= gradient_accumulation_steps)
        # micro-batches. Loss scaling for accumulation is done inside TRL's _compute_loss.
        chunks = split_tensor_dict(gen, trainer.args.steps_per_generation)
        total = 0.0
        _sync(on_cuda)
        t0 = time.perf_counter()
        for mb in chunks:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, mb, num_items_in_batch=num_items_in_batch)
            trainer.accelerator.backward(loss)
            total += loss.detach()
            del loss
        _sync(on_cuda)
        out["policy_s"] = time.perf_counter() - t0
        out["loss"] = float(total)
        del chunks
    except torch.OutOfMemoryError:
        out.update(oom=True, ref_s=None, policy_s=None, loss=None)
        model.zero_grad(set_to_none=True)
    finally:
        if on_cuda:
            out["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        state.clear()
        trainer._metrics["train"].clear()
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------------
# CPU self-test
# --------------------------------------------------------------------------------------------------


def _reference_loss_and_grads(model, batch, beta):
    """Independent plain-PyTorch DAPO loss with TRL 1.15 defaults: ratio = exp(logp - logp.detach()) (== 1, so
    clipping is inactive), k3 KL multiplied by the ratio (use_bias_correction_kl=True), sum / total tokens."""
    model.zero_grad(set_to_none=True)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    C = batch["completion_ids"].shape[1]
    tgt = batch["completion_ids"]

    def logps():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -C - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad(), model.disable_adapter():
        ref = logps()
    pol = logps()
    A = batch["advantages"].unsqueeze(1)
    ratio = torch.exp(pol - pol.detach())
    per_tok = -ratio * A
    if beta:
        per_tok = per_tok + beta * (torch.exp(ref - pol) - (ref - pol) - 1) * ratio
    loss = per_tok.sum() / per_tok.numel()
    loss.backward()
    g = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return loss.item(), g


def _selftest():
    """CPU check. TRL 1.15's log-prob head is a Triton kernel, so run with Triton's interpreter:
    TRITON_INTERPRET=1 PYTHONPATH=<dir with triton> python benchmarks/trl_baseline.py"""
    import math

    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("selftest needs `triton` importable (TRL 1.15 computes log-probs with a Triton kernel); "
                 "on CPU: pip install --target /tmp/tri triton; TRITON_INTERPRET=1 PYTHONPATH=/tmp/tri python ...")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on CPU set TRITON_INTERPRET=1")
    import trl

    G, P, C = 4, 16, 24
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # fp32 tiny model either way (bf16=False)
    rows, grads = [], {}
    for layout in ("default", "frugal"):
        for beta in (0.0, 0.04):
            torch.manual_seed(0)
            model = apply_lora(build_random_model("tiny", dev, torch.float32))
            with torch.no_grad():  # non-trivial adapter so policy != reference and the KL term is non-zero
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.05)
            tok = make_tokenizer(model)
            batch = make_batch(G, P, C, model.config.vocab_size, dev)
            batch["advantages"] = torch.tensor([1.0, -0.3, 0.7, 0.2], device=dev)  # non-zero mean: loss != 0
            ref_loss, ref_g = _reference_loss_and_grads(model, batch, beta)
            r = trl_step(model, tok, batch, layout=layout, beta=beta, reps=1, bf16=False)
            lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
            with_grad = [n for n, p in lora if p.grad is not None and p.grad.abs().sum() > 0]
            frozen_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
            g = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.grad is not None])
            assert not r["oom"] and math.isfinite(r["loss"]), r
            assert len(with_grad) == len(lora) > 0, (len(with_grad), len(lora))
            assert not frozen_grad, frozen_grad[:3]
            assert model.is_gradient_checkpointing
            assert "ref" not in model.peft_config
            assert abs(r["loss"] - ref_loss) < 1e-5, (r["loss"], ref_loss)
            grel = ((g - ref_g).norm() / ref_g.norm()).item()
            assert grel < 1e-4, (layout, beta, grel)
            r2 = trl_step(model, tok, batch, layout=layout, beta=beta, reps=1, bf16=False)  # cached trainer
            assert abs(r2["loss"] - r["loss"]) < 1e-5, (r, r2)
            grads[(layout, beta)] = g
            rows.append((layout, beta, r["loss"], ref_loss, grel, r["ref_s"], r["policy_s"], len(with_grad), len(lora)))
            release_trl(model)
            assert "forward" not in model.get_base_model().__dict__
    print(f"trl {trl.__version__}  datasets stub: {DATASETS_STUB_USED}  device: {dev}")
    for row in rows:
        print("layout=%-7s beta=%.2f loss=%+.6f (plain-torch %+.6f, grad rel diff %.1e) ref_s=%.3f policy_s=%.3f "
              "lora_grads=%d/%d" % row)
    for beta in (0.0, 0.04):
        d, f = grads[("default", beta)], grads[("frugal", beta)]
        print(f"beta={beta}: default vs frugal grad rel diff {((d - f).norm() / d.norm()).item():.1e}")
    print("SELFTEST OK")


if __name__ == "__main__":
    _selftest()
