"""Rollouts through transformers' ``generate`` on the training weights (LoRA applied, no second copy)."""

from __future__ import annotations

import torch

from ..policy import compute_context
from .sampler import Rollout


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
    """``num_generations`` sampled completions per prompt (contiguous per prompt), in eval mode."""
    from transformers import GenerationConfig

    eos_ids = tokenizer.eos_token_id
    eos_set = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    generation_config = GenerationConfig(
        do_sample=True, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
        top_k=gen_cfg.top_k or None, min_p=gen_cfg.min_p or None, repetition_penalty=gen_cfg.repetition_penalty,
        max_new_tokens=gen_cfg.max_completion_length, eos_token_id=list(eos_set), pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
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
                cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), None)
                completions.append(row[:cut] if cut is not None else row)
                truncated.append(cut is None)
    finally:
        model.train(was_training)
    return Rollout(expanded, completions, truncated)
