"""Completions for a list of prompts and what reward functions read of them, shared by training, ``longrl eval``
and ``longrl generate``: the sampling parameters of a ``generation:`` config, the one builder of the sampler that
all three use (so every ``generation.*`` key acts on each), one call that samples through either backend, and the
(prompts, completions, columns) a reward function is called with."""

from __future__ import annotations

import logging

from ..models.loading import base_model
from .attention import unsupported_reason
from .hf_generate import generate_completions
from .sampler import Rollout, Sampler
from .sampling import SamplingParams, sampling_params

__all__ = ["build_sampler", "reward_inputs", "sample", "sampling_params"]

log = logging.getLogger(__name__)


def build_sampler(model, tokenizer, gen, *, max_length: int, memory_cap_bytes: int | None = None,
                  pack_projections: bool = True) -> Sampler | None:
    """longrl's sampler with every sampler setting of generation config ``gen`` (kv_cache_gib, kv_cache_dtype,
    cuda_graphs, sync_every, min_decode_batch, fast_decode, fuse_lora, nf4_kernel, nf4_halves, pack_projections,
    speculative, max_draft_tokens, speculative_schedule), or None when ``gen.backend`` is hf or the model needs transformers'
    generate for sequences of ``max_length`` tokens (the reason logged).
    ``memory_cap_bytes``: the run's GPU budget (train.gpu_memory_gib), which the KV cache stays within;
    ``pack_projections`` False keeps the weights where they are whatever ``gen`` says (FSDP2's unsharded weights)."""
    if gen.backend != "longrl":
        return None
    reason = unsupported_reason(base_model(model).config, max_length)
    if reason:
        log.warning("longrl's sampler does not support %s: sampling with transformers' generate%s", reason,
                    "" if gen.speculative == "off" else " (no speculative rollouts)")
        return None
    return Sampler(model, tokenizer, kv_cache_bytes=int(gen.kv_cache_gib * 2**30) if gen.kv_cache_gib > 0 else None,
                   memory_cap_bytes=memory_cap_bytes, kv_cache_dtype=gen.kv_cache_dtype, cuda_graphs=gen.cuda_graphs,
                   sync_every=gen.sync_every, min_decode_batch=gen.min_decode_batch, fast_decode=gen.fast_decode,
                   fuse_lora=gen.fuse_lora, nf4_kernel=gen.nf4_kernel, nf4_halves=gen.nf4_halves,
                   pack_projections=gen.pack_projections and pack_projections,
                   speculative=gen.speculative, max_draft_tokens=gen.max_draft_tokens,
                   speculative_schedule=gen.speculative_schedule)


def sample(model, tokenizer, prompt_ids: list[list[int]], num_generations: int, gen, params: SamplingParams,
           sampler: Sampler | None, device, vision: list | None = None) -> Rollout:
    """``num_generations`` completions per prompt (contiguous per prompt) through ``sampler``, or through
    transformers' generate when it is None (with ``gen``'s settings; ``params`` then gives only the length, the
    temperature, the seed and the sequence ids). ``vision``: per prompt its VisionPrompt or None (transformers'
    generate takes them for the families rollout/hf_generate.py names)."""
    if sampler is not None:
        return sampler.generate(prompt_ids, num_generations, params, vision=vision)
    if params.max_new_tokens != gen.max_completion_length or params.temperature != gen.temperature:
        from dataclasses import replace

        gen = replace(gen, max_completion_length=params.max_new_tokens, temperature=params.temperature)
    return generate_completions(model, tokenizer, prompt_ids, num_generations, gen, device, params=params,
                                vision=vision)


def reward_inputs(rows: list[dict], prompt_column: str, num_generations: int, tokenizer, rollout: Rollout):
    """(prompts [P·G], completions [P·G], columns) for reward functions: each row's prompt repeated G times, the
    decoded completions (as ``[{"role": "assistant", "content": ...}]`` for chat prompts, as TRL passes them), and
    the rows' other columns with ``completion_ids`` and ``truncated``."""
    G = num_generations
    prompts = [row[prompt_column] for row in rows for _ in range(G)]
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != prompt_column}
    columns["completion_ids"] = rollout.completion_ids
    columns["truncated"] = rollout.truncated
    return prompts, completions, columns
