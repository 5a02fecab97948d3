"""Rollouts through transformers' ``generate`` on the training weights (LoRA applied, no second copy)."""

from __future__ import annotations

import torch

from ..policy import compute_context
from .sampler import Rollout
from .sampling import stop_index, stop_token_ids


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate_completions(model, tokenizer, prompt_ids: list[list[int]], num_generations: int, gen_cfg,
                         device, batch_size: int = 256) -> Rollout:
    """``num_generations`` sampled completions per prompt (contiguous per prompt), in eval mode. Honours the
    same stop rules as longrl's sampler: EOS (unless ``ignore_eos``), ``stop_token_ids`` and ``stop_strings``."""
    from transformers import GenerationConfig

    stop_ids = set(stop_token_ids(gen_cfg, tokenizer))
    stop_strings = tuple(gen_cfg.stop_strings)
    generation_config = GenerationConfig(
        do_sample=True, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
        top_k=gen_cfg.top_k or None, min_p=gen_cfg.min_p or None, repetition_penalty=gen_cfg.repetition_penalty,
        max_new_tokens=gen_cfg.max_completion_length, eos_token_id=sorted(stop_ids) or None,
        pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )  # stop strings are cut afterwards: transformers' StopStringCriteria cannot read every tokenizer's vocab
    expanded = [p for p in prompt_ids for _ in range(num_generations)]
    was_training = model.training
    model.eval()
    completions, truncated = [], []
    try:
        for start in range(0, len(expanded), batch_size):
            chunk = expanded[start:start + batch_size]
            ids, mask = _left_pad(chunk, tokenizer.pad_token_id, device)
            with compute_context(model):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config)
            for row in out[:, ids.shape[1]:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), None)
                j = stop_index(row[:cut], stop_strings, tokenizer.decode)
                if j is not None:
                    cut = j + 1
                completions.append(row[:cut] if cut is not None else row)
                truncated.append(cut is None)
    finally:
        model.train(was_training)
    return Rollout(expanded, completions, truncated)
