"""Grouped rows for the log-prob passes: each prompt once, followed by its completions (ops/shared_prompt_attention.py).

Completions that share a prompt (the same token list) are laid out as one group, prompt + completion_1 + … +
completion_n, either back to back in one row (packed) or one group a row, right-padded. Position ids restart at P
for every completion, so completion g's tokens get the positions and (through the attention's mask) the context
they have in prompt + completion_g. The hidden state that predicts completion token j is the prompt's last token's
for j = 0 (shared by every completion of the group: its gradient sums theirs) and the completion's token j − 1
after that.

The attention runs through transformers' public interface: :func:`enable_shared_prompt` registers an attention
implementation that runs ops/shared_prompt_attention.py's function for grouped rows and the model's own for every
other call, and the layout travels as a keyword argument of the backbone's forward, which transformers passes down
to every attention call (the recompute of a checkpointed layer too). The plain twin passes the layout's mask as a
4-D attention mask to the model's own attention instead (:func:`mask_inputs`). Of a vision-language model only the
language model switches (its vision tower keeps its own attention); prompts with images are grouped by their
tokens and their images (models/policy.py scatters each group's image features into its prompt part).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..ops.shared_prompt_attention import LAYOUT_KWARG, PromptGroup, SharedPromptLayout, shared_prompt_sdpa
from ..ops.unwrap import base_model
from .vision.families import FAMILIES

PREFIX = "longrl_shared_prompt_on_"  # the attention implementation's name: this, then the one it wraps
# (text) model types whose attention is transformers' rotary self-attention through ALL_ATTENTION_FUNCTIONS with the
# forward's keyword arguments passed down (checked against the repeated layout in tests/test_shared_prompt.py; the
# Qwen-VL language models, mRoPE, in tests/test_vision_shared_prompt.py)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")


def group_by_prompt(prompt_ids: list[list[int]], keys: list | None = None) -> list[list[int]]:
    """Indices of the sequences, grouped by equal prompts, in order of first appearance. ``keys``: per sequence
    what must be equal too (a prompt's VisionPrompt, compared by identity: equal tokens, other images), or None."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        groups.setdefault((tuple(p), None if keys is None else keys[i]), []).append(i)
    return list(groups.values())


def unsupported_reason(config, max_tokens: int | None = None) -> str | None:
    """Why grouped rows would not be exact for a model of this transformers config (None: they are);
    ``max_tokens``: the longest prompt + completion, against a sliding window."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and family.image_blocks:
        return (f"{family.name}'s image tokens attend both ways (models/vision/masks.py), which the grouped rows' "
                "causal attention does not compute")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model_type {kind!r}: grouped rows are implemented for {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(text, "attention_dropout", 0.0):
        return f"attention_dropout={text.attention_dropout}: grouped rows attend without dropout"
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or []
    windowed = kind == "mistral" or getattr(text, "use_sliding_window", False) or "sliding_attention" in layer_types
    if windowed and window and max_tokens is not None and max_tokens > window:
        return (f"a sliding window of {window} tokens, shorter than the {max_tokens} tokens of a prompt and its "
                "completion")
    return None


@dataclass
class GroupedRows:
    """The backbone's inputs for grouped rows: token ids [rows, length], the layout, for each sequence the flat
    index (row × length + token) of the hidden state that predicts each of its completion tokens, and for each
    group of the layout the index of a sequence of it (whose prompt it holds)."""
    input_ids: torch.Tensor
    layout: SharedPromptLayout
    predictors: list[list[int]]
    firsts: list[int]


def grouped_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                 packed: bool, keys: list | None = None) -> GroupedRows:
    """Sequences (prompt_ids[i] + completion_ids[i]) as grouped rows: every group back to back in one row
    (``packed``) or one group a row, right-padded with ``pad_id``. Empty completions take no tokens. ``keys``:
    as in :func:`group_by_prompt` (sequences with equal prompt tokens but other keys are other groups)."""
    if any(len(p) < 1 for p in prompt_ids):
        raise ValueError("grouped rows need prompts of at least one token")
    groups = []  # (the first sequence's index, [sequence indices with tokens])
    for members in group_by_prompt(prompt_ids, keys):
        nonempty = [i for i in members if completion_ids[i]]
        if nonempty:
            groups.append((members[0], nonempty))
    if not groups:  # nothing to predict: one prompt alone keeps the forward (and its graph) well formed
        groups = [(0, [])]
    groups = [(first, prompt_ids[first], members) for first, members in groups]
    sizes = [len(p) + sum(len(completion_ids[i]) for i in members) for _, p, members in groups]
    rows, length = (1, sum(sizes)) if packed else (len(groups), max(sizes))
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    placed, predictors = [], [[] for _ in prompt_ids]
    at = 0
    for k, (_, prompt, members) in enumerate(groups):
        row, start = (0, at) if packed else (k, 0)
        group = PromptGroup(row, start, len(prompt), tuple(len(completion_ids[i]) for i in members))
        ids[row, start:start + len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        last = row * length + start + len(prompt) - 1  # the prompt's last token predicts each first token
        for i, s in zip(members, group.completion_starts()):
            c = completion_ids[i]
            ids[row, s:s + len(c)] = torch.tensor(c, dtype=torch.long)
            predictors[i] = [last] + list(range(row * length + s, row * length + s + len(c) - 1))
        placed.append(group)
        at += sizes[k]
    return GroupedRows(ids, SharedPromptLayout(tuple(placed), rows, length), predictors, [f for f, _, _ in groups])


def grouped_mask(rows: int, device) -> torch.Tensor:
    """The attention mask argument of a grouped forward: [rows, 1, 0, 0], empty. transformers takes a 4-D mask as
    it is (no mask is built, none of [L, L]); the shared-prompt attention reads the layout instead, and any other
    attention function fails on it (its shape broadcasts against no score matrix) rather than attend plainly."""
    return torch.ones(rows, 1, 0, 0, dtype=torch.bool, device=device)


def kernel_inputs(rows: GroupedRows, device) -> dict:
    """The backbone's keyword arguments for the flash-part kernel (the model under :func:`enable_shared_prompt`)."""
    return dict(input_ids=rows.input_ids.to(device), position_ids=rows.layout.positions().to(device),
                attention_mask=grouped_mask(rows.layout.rows, device), **{LAYOUT_KWARG: rows.layout})


def mask_inputs(model, rows: GroupedRows, device) -> dict:
    """The backbone's keyword arguments for the plain twin: the layout's mask as a 4-D attention mask, which
    transformers hands to the model's own attention unchanged (boolean for SDPA, additive for eager attention)."""
    mask = rows.layout.mask(device)  # [rows, 1, L, L]
    if attention_delegate(model) == "eager":
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return dict(input_ids=rows.input_ids.to(device), position_ids=rows.layout.positions().to(device),
                attention_mask=mask)


def _language_model(model):
    """The module whose attention grouped rows switch: the backbone (a vision-language model's language model; a
    text model's decoder, which shares the model's config)."""
    return base_model(model).get_decoder()


def attention_delegate(model) -> str:
    """The attention implementation ``model``'s language model runs for calls other than grouped rows (its own, or
    the one :func:`enable_shared_prompt` wraps)."""
    name = _language_model(model).config._attn_implementation
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def _attention(delegate: str):
    """The attention function installed as PREFIX + ``delegate``: grouped rows (the call carries LAYOUT_KWARG)
    through ops/shared_prompt_attention.py, every other call through ``delegate``'s function unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        if LAYOUT_KWARG in kwargs:
            return shared_prompt_sdpa(module, query, key, value, attention_mask, **kwargs)
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        function = ALL_ATTENTION_FUNCTIONS.get_interface(delegate, eager)
        return function(module, query, key, value, attention_mask, **kwargs)

    return attention


def enable_shared_prompt(model) -> None:
    """Install the shared-prompt attention on ``model``'s language model (transformers or PEFT; idempotent; a
    vision tower keeps its own): its attention implementation becomes PREFIX + the one it had, registered in
    transformers' AttentionInterface with that one's mask builder, which runs grouped rows and hands every other
    call to the implementation it had. It stays for the model's life (a checkpointed layer's recompute, in the
    backward, attends through the same function as its forward); :func:`disable_shared_prompt` restores the one it
    had."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    language = _language_model(model)
    delegate = language.config._attn_implementation
    if delegate.startswith(PREFIX):
        return
    name = PREFIX + delegate
    AttentionInterface.register(name, _attention(delegate))
    if delegate in ALL_MASK_ATTENTION_FUNCTIONS:  # else transformers builds no mask for it, nor for this one
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[delegate])
    language.set_attn_implementation(name)


def disable_shared_prompt(model) -> None:
    """Back to the attention implementation :func:`enable_shared_prompt` wrapped."""
    language = _language_model(model)
    if language.config._attn_implementation.startswith(PREFIX):
        language.set_attn_implementation(attention_delegate(model))
