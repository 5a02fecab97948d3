"""Completions for a list of prompts and what reward functions read of them, shared by training, ``longrl eval``
and ``longrl generate``: the sampling parameters of a ``generation:`` config, the sampler of a model, one call
that samples through either backend, and the (prompts, completions, columns) a reward function is called with."""

from __future__ import annotations

import logging

from .hf_generate import generate_completions
from .sampler import Rollout, Sampler
from .sampling import SamplingParams, stop_token_ids

log = logging.getLogger(__name__)


def sampling_params(gen, tokenizer, seed: int, max_new_tokens: int | None = None,
                    temperature: float | None = None) -> SamplingParams:
    """The sampler's parameters for generation config ``gen`` (stop tokens: EOS unless ignored, and
    ``gen.stop_token_ids``); ``max_new_tokens`` / ``temperature`` override the config's."""
    return SamplingParams(max_new_tokens=max_new_tokens or gen.max_completion_length,
                          temperature=gen.temperature if temperature is None else temperature, top_p=gen.top_p,
                          top_k=gen.top_k, min_p=gen.min_p, repetition_penalty=gen.repetition_penalty,
                          stop_token_ids=tuple(stop_token_ids(gen, tokenizer)), stop_strings=tuple(gen.stop_strings),
                          seed=seed)


def inference_sampler(model, tokenizer, gen, max_length: int) -> Sampler | None:
    """longrl's sampler for inference with ``gen``'s settings (its own KV budget), or None (with the reason
    logged) when ``gen.backend`` is hf or the model needs transformers' generate."""
    from .attention import unsupported_reason
    from ..models import base_model

    if gen.backend != "longrl":
        return None
    reason = unsupported_reason(base_model(model).config, max_length)
    if reason:
        log.warning("longrl's sampler does not support %s: sampling with transformers' generate", reason)
        return None
    return Sampler(model, tokenizer, kv_cache_bytes=int(gen.kv_cache_gib * 2**30) if gen.kv_cache_gib > 0 else None,
                   cuda_graphs=gen.cuda_graphs, sync_every=gen.sync_every, fast_decode=gen.fast_decode,
                   fuse_lora=gen.fuse_lora, nf4_kernel=gen.nf4_kernel, pack_projections=gen.pack_projections)


def sample(model, tokenizer, prompt_ids: list[list[int]], num_generations: int, gen, params: SamplingParams,
           sampler: Sampler | None, device) -> Rollout:
    """``num_generations`` completions per prompt (contiguous per prompt) through ``sampler``, or through
    transformers' generate when it is None (with ``gen``'s settings; ``params`` then gives only the length, the
    temperature, the seed and the sequence ids)."""
    if sampler is not None:
        return sampler.generate(prompt_ids, num_generations, params)
    if params.max_new_tokens != gen.max_completion_length or params.temperature != gen.temperature:
        from dataclasses import replace

        gen = replace(gen, max_completion_length=params.max_new_tokens, temperature=params.temperature)
    return generate_completions(model, tokenizer, prompt_ids, num_generations, gen, device, params=params)


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
