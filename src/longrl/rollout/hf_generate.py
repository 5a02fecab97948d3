"""Rollouts through transformers' ``generate`` on the training weights (LoRA applied, no second copy).

Tokens are drawn as longrl's sampler draws them (``sampling.next_tokens``: repetition penalty, temperature, top-k,
top-p, min-p, then one uniform number keyed by (seed, global sequence id, position)), inside a logits processor
that leaves only the drawn token possible, so that ``generate``'s greedy pick returns it. A completion therefore
depends on its sequence id and not on its batch, its rank or its order: data-parallel ranks sample what one
process samples, as with longrl's sampler.

Prompts with images (families whose ``hf_generate`` is set: Gemma 3) go to ``generate`` as their token ids with the
image features computed once per prompt (models/vision/features.py, the tower's one call for its G completions),
through the forward's ``mm_encoder_outputs`` (transformers' pre-encoded image input; a transformers without it, such
as 5.17, gets each row's pixel values instead and runs the tower once per completion), and, where the family's image
tokens attend both ways, ``token_type_ids`` (1 at each image placeholder, left-padded as the ids), from which
transformers builds the prefill's image-block masks; its decode steps are causal.
"""

from __future__ import annotations

import inspect

import torch
from transformers import LogitsProcessor

from ..models.loading import base_model
from ..models.policy import compute_context
from ..models.vision import FAMILIES, FeatureCache, VisionFamily, require_vision
from .sampler import Rollout
from .sampling import SamplingParams, next_tokens, sampling_params, stop_index, stop_token_ids


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def check_image_generate(family) -> VisionFamily:
    """``family`` (a VisionFamily), after a ValueError unless transformers' generate takes its prompts with images."""
    if not family.hf_generate:
        takes = ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items() if f.hf_generate)
        raise ValueError(f"prompts with images of {family.name} models are sampled by longrl's sampler only "
                         f"(generation.backend: longrl); transformers' generate takes them for {takes}")
    return family


def takes_encoder_outputs(model) -> bool:
    """Whether the model's forward takes pre-encoded image features (``mm_encoder_outputs``: transformers ≥ 5.2x);
    else generate gets each row's pixel values and runs the tower once per row."""
    return "mm_encoder_outputs" in inspect.signature(base_model(model).forward).parameters


def _image_inputs(features: FeatureCache, chunk_vision: list, ids: torch.Tensor) -> dict:
    """generate's keyword arguments for a chunk of left-padded prompts ``ids`` [b, W] whose VisionPrompts (or None)
    are ``chunk_vision``: ``mm_encoder_outputs`` (the features of every placeholder, row by row, [N, H]; on a
    transformers without it, the rows' image tensors, concatenated in row order) and, for a family whose image
    tokens attend both ways, ``token_type_ids`` [b, W] (1 at the placeholders)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    width = ids.shape[1]
    types = torch.zeros_like(ids)
    prompts = [p for p in chunk_vision if p is not None]
    for row, prompt in enumerate(chunk_vision):
        if prompt is not None:
            types[row, width - len(prompt) + prompt.image_positions.to(ids.device)] = 1
    if takes_encoder_outputs(features.model):
        embeds = torch.cat([features.get(p).embeds for p in prompts])  # [N, H]
        out = {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=embeds)}}
    else:
        dtype = next(p.dtype for p in features.model.parameters() if p.is_floating_point())
        out = {k: torch.cat([p.image_inputs[k] for p in prompts]) for k in prompts[0].image_inputs}
        out = {k: v.to(ids.device, dtype) if v.is_floating_point() else v.to(ids.device) for k, v in out.items()}
    if features.family.image_blocks:
        out["token_type_ids"] = types
    return out


class KeyedDraw(LogitsProcessor):
    """The next token of each row drawn by ``sampling.next_tokens`` (keyed by the rows' global sequence ids and
    the number of tokens generated so far); the scores returned are 0 at it and −inf elsewhere."""

    def __init__(self, params: SamplingParams, sequence_ids: list[int], prompt_starts: list[int], width: int,
                 device):
        self.params, self.width = params, width  # width: the left-padded prompts' length
        self.sequences = torch.tensor(sequence_ids, dtype=torch.long, device=device)  # [B]
        self.starts = torch.tensor(prompt_starts, dtype=torch.long, device=device)[:, None]  # [B, 1] first real token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen = None
        if self.params.repetition_penalty != 1.0:  # the tokens of each row's prompt and completion (not its padding)
            real = torch.arange(input_ids.shape[1], device=input_ids.device)[None] >= self.starts  # [B, W]
            seen = torch.zeros(scores.shape, dtype=torch.long, device=scores.device).scatter_add_(
                1, input_ids, real.long()) > 0  # [B, V]
        position = torch.full_like(self.sequences, input_ids.shape[1] - self.width)  # [B] tokens generated so far
        tokens, _ = next_tokens(scores, self.params, self.sequences, position, seen)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


@torch.no_grad()
def generate_completions(model, tokenizer, prompt_ids: list[list[int]], num_generations: int, gen_cfg,
                         device, batch_size: int = 256, params: SamplingParams | None = None,
                         vision: list | None = None) -> Rollout:
    """``num_generations`` sampled completions per prompt (contiguous per prompt), in eval mode. Honours the
    same stop rules as longrl's sampler: EOS (unless ``ignore_eos``), ``stop_token_ids`` and ``stop_strings``.
    ``params``: the seed and the sequences' global ids (``sequence_ids``) that key the draws (None: ``gen_cfg``'s
    settings with a seed drawn from torch's generator); the sampling settings are always ``gen_cfg``'s.
    ``vision``: per prompt its VisionPrompt (whose input_ids are the prompt's) or None (module docstring)."""
    from transformers import GenerationConfig, LogitsProcessorList

    seed = params.seed if params is not None else int(torch.randint(2 ** 62, ()))
    keyed = sampling_params(gen_cfg, tokenizer, seed=seed)
    stop_ids = set(stop_token_ids(gen_cfg, tokenizer))
    stop_strings = tuple(gen_cfg.stop_strings)
    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=gen_cfg.max_completion_length, eos_token_id=sorted(stop_ids),
        pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )  # [] (ignore_eos, no stop ids): no stop, not the model's EOS. The draw is KeyedDraw's; stop strings are cut
    # afterwards: transformers' StopStringCriteria cannot read every tokenizer's vocab
    expanded = [p for p in prompt_ids for _ in range(num_generations)]
    features = None
    if vision is not None and any(v is not None for v in vision):
        family = check_image_generate(require_vision(base_model(model).config))
        if any(v is not None and list(p) != v.input_ids for p, v in zip(prompt_ids, vision)):
            raise ValueError("a prompt's token ids are not its VisionPrompt's input_ids")
        features = FeatureCache(model, family)  # each prompt's features once, for its G completions
        vision = [v for v in vision for _ in range(num_generations)]
    was_training = model.training
    model.eval()
    completions, truncated = [], []
    try:
        for start in range(0, len(expanded), batch_size):
            chunk = expanded[start:start + batch_size]
            ids, mask = _left_pad(chunk, tokenizer.pad_token_id, device)
            draw = KeyedDraw(keyed, [params.sequence_id(start + i) if params else start + i for i in range(len(chunk))],
                             [ids.shape[1] - len(p) for p in chunk], ids.shape[1], ids.device)
            with compute_context(model):
                images = {}
                if features is not None and any(v is not None for v in vision[start:start + batch_size]):
                    images = _image_inputs(features, vision[start:start + batch_size], ids)
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config,
                                     logits_processor=LogitsProcessorList([draw]), **images)
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
