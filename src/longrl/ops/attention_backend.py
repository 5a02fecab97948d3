"""Which of PyTorch's fused attention kernels (SDPA backends) training tries first, on CUDA.

PyTorch picks an SDPA backend by a fixed priority among those that support the call. On some GPUs cuDNN's
kernels beat the flash kernels PyTorch prefers; ``model.sdpa_backends`` puts the listed backends first, in that
order, with the others after them (so a call none of the listed ones supports still runs).

Grouped-query models need one more step: transformers calls SDPA with ``enable_gqa=True`` (fewer key/value heads
than query heads), which only the flash backend accepts, so a cuDNN or memory-efficient priority would silently
change nothing. When one of those is listed first, the model's attention becomes ``longrl_sdpa_mha``:
transformers' own SDPA function on keys/values repeated to the query heads,

    k, v [B, Hkv, T, D] → [B, Hq, T, D]   (head h reads key head h // (Hq / Hkv), as GQA does)

which every backend accepts (transient cost: 2 · T · Hq · D elements per layer call). With
``model.grouped_attention_backward`` (and flash first, or nothing listed), training attends through
``longrl_sdpa_grouped`` instead (ops/grouped_attention.py): PyTorch's flash kernels, the backward of long calls run
one key head group at a time. With nothing listed, PyTorch's own choice for transformers' enable_gqa call can be
cuDNN's kernels on some GPUs and versions (:func:`training_attention_kernel` reads which).

The switch of a model's attention function itself: ops/sdpa_variant.py.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .grouped_attention import grouped_backward
from .sdpa_variant import register_sdpa_variant, sdpa_variant

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # PyTorch's own order, the tail after the listed ones
NO_GQA_BACKENDS = ("cudnn", "efficient")  # reject enable_gqa with fewer key/value heads
MHA_SDPA = "longrl_sdpa_mha"


def backend_order(names: list[str]) -> list:
    """The listed backends first, in order, then the rest in PyTorch's default order."""
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if unknown:
        raise ValueError(f"unknown SDPA backend(s) {unknown}; known: {sorted(SDPA_BACKENDS)}")
    ordered = list(dict.fromkeys(names)) + [n for n in DEFAULT_ORDER if n not in names]
    return [SDPA_BACKENDS[n] for n in ordered]


def repeats_kv(names: list[str]) -> bool:
    """Whether this ``model.sdpa_backends`` order runs grouped-query models on ``longrl_sdpa_mha`` (cuDNN or
    memory-efficient first; the planner counts the repeated keys/values)."""
    return bool(names) and names[0] in NO_GQA_BACKENDS


def grouped_backward_applies(names: list[str]) -> bool:
    """Whether this ``model.sdpa_backends`` order lets training attend through ops/grouped_attention.py (flash
    kernels called directly): nothing listed, or flash first."""
    return not names or names[0] == "flash"


def training_attention_kernel(names: list[str], heads: int, kv_heads: int, head_dim: int,
                              device: str | torch.device | None = None) -> str:
    """'cudnn' or 'flash': whose backward the training attention of a model with these heads runs, for the
    planner's count of its transients (memory/planner.py: attention_backward_bytes). The first listed backend when
    ``model.sdpa_backends`` names cuDNN or flash; else what PyTorch's own choice is for transformers' call on
    ``device`` (CUDA: a 128-token causal bf16 call laid out as transformers hands it over, read off its autograd
    node; PyTorch puts cuDNN first on some GPUs and versions); 'flash' without CUDA or for any other backend."""
    if names and names[0] in ("cudnn", "flash"):
        return names[0]
    if names or device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "flash"
    index = torch.device(device).index
    return _default_training_kernel(torch.cuda.current_device() if index is None else index, heads, kv_heads,
                                    head_dim)


@functools.lru_cache(maxsize=None)
def _default_training_kernel(index: int, heads: int, kv_heads: int, head_dim: int) -> str:
    def heads_first(n):  # [1, T, n, D] viewed as [1, n, T, D], as transformers passes q, k, v
        return torch.zeros(1, 128, n, head_dim, device=f"cuda:{index}", dtype=torch.bfloat16).transpose(1, 2)

    with torch.inference_mode(False), torch.enable_grad():  # the backward's kernel is named by the autograd node
        q = heads_first(heads).requires_grad_()
        out = torch.nn.functional.scaled_dot_product_attention(q, heads_first(kv_heads), heads_first(kv_heads),
                                                               is_causal=True, enable_gqa=kv_heads != heads)
        return "cudnn" if "cudnn" in out.grad_fn.name().lower() else "flash"


def repeat_kv_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] → [B, Hkv · groups, T, D], each key/value head repeated for its group of query heads."""
    if groups == 1:
        return t
    B, H, T, D = t.shape
    return t[:, :, None].expand(B, H, groups, T, D).reshape(B, H * groups, T, D)


def sdpa_mha_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with keys/values repeated to the query heads first (see the module
    docstring); query [B, Hq, q, D], key/value [B, Hkv, k, D] → ([B, q, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1:  # a decode step (transformers' generate): its own GQA path, no copy of the cache
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups = query.shape[1] // key.shape[1]
    view = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True))
    return sdpa_attention_forward(view, query, repeat_kv_heads(key, groups), repeat_kv_heads(value, groups),
                                  attention_mask, **kwargs)


def register_mha_sdpa() -> None:
    register_sdpa_variant(MHA_SDPA, sdpa_mha_attention)


@contextlib.contextmanager
def sdpa_priority(names: list[str], device_type: str, model=None, grouped: bool = False):
    """Context in which SDPA tries ``names`` first (CUDA only; nothing changes on CPU). With ``model`` (a
    transformers or PEFT model on SDPA attention): cuDNN or memory-efficient first, its attention is
    ``longrl_sdpa_mha`` inside the context; with ``grouped`` (model.grouped_attention_backward) and nothing listed
    or flash first, it is ``longrl_sdpa_grouped`` (grouped_attention.grouped_backward); back to what it was
    after."""
    if device_type != "cuda":
        yield
        return
    with contextlib.ExitStack() as stack:
        if names:
            stack.enter_context(sdpa_kernel(backend_order(names), set_priority=True))
        if model is not None and grouped and grouped_backward_applies(names):
            stack.enter_context(grouped_backward(model))
        elif model is not None and repeats_kv(names):
            stack.enter_context(sdpa_variant(model, MHA_SDPA, sdpa_mha_attention))
        yield
