"""Attention over grouped rows: one prompt followed by its completions, the prompt computed once for all of them.

A grouped row holds a prompt of P tokens, then completions of R_1, …, R_n tokens back to back. Token i attends to
token j when

    both are in the prompt and j ≤ i;  or i is in a completion and j is in the prompt;
    or both are in the same completion and j ≤ i

(the mask of :meth:`SharedPromptLayout.mask`), with positions 0 … P−1 for the prompt and P … P+R_g−1 for each
completion g. Every completion token thus sees exactly what it sees in its own prompt + completion sequence, so the
per-token results equal the repeated layout's, while the prompt's tokens are computed once instead of n times.

The fast path, :class:`SharedPromptAttention`, runs PyTorch's flash kernels on the parts and merges them by their
log-sum-exp; per group, with q, k, v split into the prompt p and the completions c = c_1 … c_n:

    o_p = causal(q_p, k_p, v_p)                                         the prompt, as in a plain forward
    (o_x, l_x) = full(q_c, k_p, v_p)                                     every completion over the prompt
    (o_g, l_g) = causal(q_cg, k_cg, v_cg)                                each completion over itself
    l_c = log(e^l_x + e^l_self),   o_c = e^(l_x − l_c) o_x + e^(l_self − l_c) o_self

Its backward runs each part's flash backward with the merged output and log-sum-exp, which is the exact gradient of
the merged softmax restricted to that part's keys (as ring attention does); the prompt's key and value gradients
sum the prompt part's and the cross part's, so over the whole group. Nothing of size L² exists. The plain twin,
:func:`reference_attention`, is SDPA with the boolean mask (O(L²) memory): for tests and for the calls the flash
kernels do not take (:func:`fast_path_applies`).

:func:`shared_prompt_sdpa` is the transformers attention function (``AttentionInterface``) that runs it; the layout
reaches it as the keyword argument ``longrl_shared_prompt`` that the model's forward passes down to its attention
(models/shared_prompt.py installs it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .grouped_attention import NEUTRAL_KWARGS

log = logging.getLogger(__name__)

LAYOUT_KWARG = "longrl_shared_prompt"  # the keyword argument carrying the layout to the attention function


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and its completions in a grouped row: the prompt at tokens [start, start + prompt) of row
    ``row``, then the completions of ``completions`` tokens each, back to back."""
    row: int
    start: int
    prompt: int
    completions: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.prompt + sum(self.completions)

    def completion_starts(self) -> list[int]:
        """The first token of each completion in the row."""
        starts, at = [], self.start + self.prompt
        for r in self.completions:
            starts.append(at)
            at += r
        return starts


@dataclass(frozen=True)
class SharedPromptLayout:
    """The grouped rows of one forward: ``rows`` rows of ``length`` tokens holding ``groups``; tokens outside
    every group are padding (they attend to themselves only and nothing attends to them)."""
    groups: tuple[PromptGroup, ...]
    rows: int
    length: int

    def __post_init__(self):
        for g in self.groups:
            if g.prompt < 1 or any(r < 1 for r in g.completions):
                raise ValueError(f"a grouped row needs a prompt and completions of at least one token: {g}")
            if not 0 <= g.row < self.rows or g.start < 0 or g.end > self.length:
                raise ValueError(f"group {g} is outside the rows [{self.rows}, {self.length}]")

    def positions(self) -> torch.Tensor:
        """Position ids [rows, length]: 0 … P−1 over the prompt, P … P+R_g−1 over completion g; 0 in padding."""
        pos = torch.zeros(self.rows, self.length, dtype=torch.long)
        for g in self.groups:
            pos[g.row, g.start:g.start + g.prompt] = torch.arange(g.prompt)
            for s, r in zip(g.completion_starts(), g.completions):
                pos[g.row, s:s + r] = torch.arange(g.prompt, g.prompt + r)
        return pos

    def max_position(self) -> int:
        return max(g.prompt + max(g.completions, default=0) for g in self.groups) - 1

    def mask(self, device=None) -> torch.Tensor:
        """[rows, 1, length, length] bool, True where query i attends to key j (the module docstring's rule)."""
        m = torch.zeros(self.rows, 1, self.length, self.length, dtype=torch.bool)
        covered = torch.zeros(self.rows, self.length, dtype=torch.bool)
        for g in self.groups:
            p = slice(g.start, g.start + g.prompt)
            m[g.row, 0, p, p] = torch.ones(g.prompt, g.prompt, dtype=torch.bool).tril()
            m[g.row, 0, g.start + g.prompt:g.end, p] = True
            for s, r in zip(g.completion_starts(), g.completions):
                m[g.row, 0, s:s + r, s:s + r] = torch.ones(r, r, dtype=torch.bool).tril()
            covered[g.row, g.start:g.end] = True
        pad = (~covered).nonzero()
        m[pad[:, 0], 0, pad[:, 1], pad[:, 1]] = True  # padding attends to itself (no empty softmax)
        return m.to(device) if device is not None else m

    def padding(self) -> torch.Tensor:
        """[rows, length] bool: tokens outside every group."""
        covered = torch.zeros(self.rows, self.length, dtype=torch.bool)
        for g in self.groups:
            covered[g.row, g.start:g.end] = True
        return ~covered


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SharedPromptLayout,
                        scale: float) -> torch.Tensor:
    """The plain twin: SDPA with the layout's boolean mask. q [B, Hq, L, D], k, v [B, Hkv, L, D] → [B, L, Hq, D],
    zero in padding."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask(q.device), scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    out = out.transpose(1, 2)  # [B, L, Hq, D]
    return out.masked_fill(layout.padding().to(q.device)[:, :, None, None], 0.0)


def _flash_forward(q, k, v, causal: bool, scale: float):
    """(out [B, Hq, T, D], lse [B, Hq, T], saved): PyTorch's flash attention forward of q [B, Hq, T, D] over k, v
    [B, Hkv, S, D]; ``saved``: what its backward takes besides these."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(do, q, k, v, out, lse, saved, causal: bool, scale: float):
    """(dq, dk, dv) of the flash call that returned ``saved``, given the output and log-sum-exp to use."""
    aten = torch.ops.aten
    lse = lse.contiguous()  # the CUDA kernels read it as a dense [B, H, T], with no strides: a slice is not
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    return aten._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                             0.0, causal, seed, offset, scale=scale)


def fast_path_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the flash kernels take these heads: the CPU's for any floating dtype; CUDA's for 16-bit q, k with a
    head dimension that is a multiple of 8 up to 256 on compute capability ≥ 8.0, Hq a multiple of Hkv."""
    if q.shape[1] % k.shape[1]:
        return False
    if q.device.type == "cpu":
        return q.dtype.is_floating_point
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    D = q.shape[-1]
    return D % 8 == 0 and D <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0)


def _merge(o_a, l_a, o_b, l_b):
    """(o, l): two attentions of the same queries over disjoint keys merged, o [B, H, T, D], l [B, H, T]:
    l = log(e^l_a + e^l_b), o = e^(l_a − l) o_a + e^(l_b − l) o_b (in the log-sum-exp's precision)."""
    l = torch.logaddexp(l_a, l_b)
    o = (torch.exp(l_a - l)[..., None] * o_a.to(l.dtype) + torch.exp(l_b - l)[..., None] * o_b.to(l.dtype))
    return o.to(o_a.dtype), l


class SharedPromptAttention(torch.autograd.Function):
    """o = attention of q [B, Hq, L, D] over k, v [B, Hkv, L, D] under the layout's mask, o [B, L, Hq, D], by the
    flash kernels on the parts of each group (module docstring); zero in padding."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SharedPromptLayout, scale: float):
        B, H, L, D = q.shape
        out = q.new_zeros(B, L, H, D)
        o = out.transpose(1, 2)  # [B, H, L, D] view, the layout transformers takes back
        lse = None
        saved = []  # per group: (prompt call, cross call, [completion calls])
        for g in layout.groups:
            b = slice(g.row, g.row + 1)
            p, c = slice(g.start, g.start + g.prompt), slice(g.start + g.prompt, g.end)
            o_p, l_p, s_p = _flash_forward(q[b, :, p], k[b, :, p], v[b, :, p], True, scale)
            if lse is None:
                lse = torch.zeros(B, H, L, dtype=l_p.dtype, device=q.device)
            o[b, :, p], lse[b, :, p] = o_p, l_p
            if not g.completions:  # a prompt alone
                saved.append((s_p, None, []))
                continue
            o_x, l_x, s_x = _flash_forward(q[b, :, c], k[b, :, p], v[b, :, p], False, scale)
            s_self = []
            for s0, r in zip(g.completion_starts(), g.completions):
                s = slice(s0, s0 + r)
                o_s, l_s, s_s = _flash_forward(q[b, :, s], k[b, :, s], v[b, :, s], True, scale)
                o[b, :, s], lse[b, :, s] = o_s, l_s
                s_self.append(s_s)
            o[b, :, c], lse[b, :, c] = _merge(o_x, l_x, o[b, :, c], lse[b, :, c])
            saved.append((s_p, s_x, s_self))
        ctx.save_for_backward(q, k, v, out, lse if lse is not None else q.new_zeros(0))
        ctx.layout, ctx.scale, ctx.calls = layout, scale, saved
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        o, do = out.transpose(1, 2), grad_out.transpose(1, 2)  # [B, H, L, D]
        # the gradients laid out as q, k, v come in ([B, L, H, D] in memory), zero in padding
        dq, dk, dv = (torch.zeros_like(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v))
        for g, (s_p, s_x, s_self) in zip(layout.groups, ctx.calls):
            b = slice(g.row, g.row + 1)
            p, c = slice(g.start, g.start + g.prompt), slice(g.start + g.prompt, g.end)
            dq_p, dk_p, dv_p = _flash_backward(do[b, :, p], q[b, :, p], k[b, :, p], v[b, :, p], o[b, :, p],
                                               lse[b, :, p], s_p, True, scale)
            if s_x is None:
                dq[b, :, p], dk[b, :, p], dv[b, :, p] = dq_p, dk_p, dv_p
                continue
            dq_x, dk_x, dv_x = _flash_backward(do[b, :, c], q[b, :, c], k[b, :, p], v[b, :, p], o[b, :, c],
                                               lse[b, :, c], s_x, False, scale)
            dq[b, :, p], dk[b, :, p], dv[b, :, p] = dq_p, dk_p + dk_x, dv_p + dv_x
            dq[b, :, c] = dq_x
            for s0, r, s_s in zip(g.completion_starts(), g.completions, s_self):
                s = slice(s0, s0 + r)
                dq_s, dk_s, dv_s = _flash_backward(do[b, :, s], q[b, :, s], k[b, :, s], v[b, :, s], o[b, :, s],
                                                   lse[b, :, s], s_s, True, scale)
                dq[b, :, s] += dq_s
                dk[b, :, s], dv[b, :, s] = dk_s, dv_s
        return dq, dk, dv, None, None


def shared_prompt_attention(q, k, v, layout: SharedPromptLayout, scale: float) -> torch.Tensor:
    """q [B, Hq, L, D], k, v [B, Hkv, L, D] → [B, L, Hq, D] under the layout's mask: the flash parts where
    :func:`fast_path_applies`, else the plain twin (with a warning on CUDA, where its [L, L] mask is large)."""
    if fast_path_applies(q, k):
        return SharedPromptAttention.apply(q, k, v, layout, float(scale))
    if q.device.type == "cuda" and not _warned:
        _warned.append(True)
        log.warning("grouped rows attend through the masked SDPA twin ([rows, L, L] mask): the flash kernels take "
                    "16-bit heads of a dimension that is a multiple of 8 up to 256 on compute capability >= 8.0, "
                    "got %s heads of %d", q.dtype, q.shape[-1])
    return reference_attention(q, k, v, layout, scale)


_warned: list = []  # the twin's warning, once a process


def shared_prompt_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """transformers' attention function for grouped rows: query [B, Hq, L, D], key/value [B, Hkv, L, D] →
    ([B, L, Hq, D], None), the layout from the keyword argument LAYOUT_KWARG (models/shared_prompt.py installs
    it). A call that would change the attention in a way the layout does not express (a mask, dropout, a softcap,
    sinks, a sliding window shorter than the rows' positions, a cache) raises instead of computing something
    else."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if not isinstance(layout, SharedPromptLayout):
        raise RuntimeError(f"grouped-row attention needs the keyword argument {LAYOUT_KWARG} (a SharedPromptLayout): "
                           "run the model through longrl.models.shared_prompt")
    window = kwargs.get("sliding_window")
    if window is not None and layout.max_position() >= window:
        raise NotImplementedError(f"shared-prompt rows with a sliding window of {window} tokens shorter than the "
                                  f"rows' {layout.max_position() + 1} positions")
    other = sorted(k for k, v in kwargs.items() if k not in NEUTRAL_KWARGS and v is not None and v is not False)
    mask = attention_mask is not None and attention_mask.numel() > 0  # grouped rows pass an empty [B, 1, 0, 0]
    if other or dropout or mask or key.shape[2] != query.shape[2]:
        raise NotImplementedError(f"shared-prompt rows attend without mask, dropout, cache or {other or 'other'} "
                                  "arguments")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return shared_prompt_attention(query, key, value, layout, scale), None
