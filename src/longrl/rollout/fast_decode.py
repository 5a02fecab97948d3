"""A decode step of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) with its elementwise glue fused; also the
language model of a vision-language model whose text model is one of those (LLaVA, LLaVA-NeXT, Idefics3, SmolVLM) or
their mRoPE twins (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; see :func:`language_model` and :meth:`FastDecoder.rotary`).

The sampler's decode step is one token per sequence, so a decoder layer's cost outside its matrix products is
the number of kernels it launches. This runs the same computation as transformers' decoder layers for one
position per sequence, calling the model's own modules for everything with weights (the projections, so LoRA
adapters, fused or PEFT's, and 4-bit bases work unchanged; the embedding; the rotary embedding module, so every
RoPE scaling type is transformers' own) and :mod:`longrl.rollout.fused_ops` for the rest:

    h = embed(ids)
    per layer:  h, x = add_rmsnorm(h, δ)            q, k, v = q_proj(x), k_proj(x), v_proj(x)
                q = rotary_kv(q, k, v → cache)        δ = o_proj(attention(q, cache))
                h, x = add_rmsnorm(h, δ)              δ = down_proj(silu_mul(gate_proj(x), up_proj(x)))
    x = final_norm(h + δ)

It is used only for decode steps, only for the architectures above with a SiLU MLP, and only when the sampler
can run the model at all (prefill keeps transformers' forward). tests/test_fast_decode.py checks it against
transformers' forward for each architecture; tests/test_vision_fast_decode.py for each vision family (image features
and Qwen3-VL's deepstack enter at prompt positions only, in the prefill: a decode step reads token embeddings).

Between :meth:`FastDecoder.prepare_quantized` and :meth:`FastDecoder.release_quantized` (the sampler calls them
around a rollout), projections over a quantized base compute their base product with its kernel instead of calling
the module: a bitsandbytes NF4 base with :func:`longrl.ops.nf4_matmul.nf4_group_linear` (``generation.nf4_kernel``),
an FP8 base (models/fp8_linear.py) with :func:`longrl.ops.fp8_matmul.fp8_group_linear` (the sampler's
``fp8_kernel``), each reading the quantized weights directly. A projection whose adapters run through PEFT's own
forward, or whose shapes the kernel does not read, keeps the module call (the FP8 module dequantizes its whole
matrix, then multiplies: the fallback). With packing on, a layer's q/k/v, o, gate/up and down are grouped as in the
16-bit packed decode below, their stacked LoRA A rows read by the same product (nothing moved: the group holds the
codes' pointers, the scales and the A rows); otherwise each projection is a product of its own plus the fused LoRA
delta (:func:`longrl.rollout.lora_fusion.fused_adder`).

Between :meth:`FastDecoder.prepare_packing` and :meth:`FastDecoder.release_packing` (``generation.pack_projections``,
on by default) the base weights of each layer's q/k/v and of its gate/up projections
live in one buffer a group, as views (the parameters keep their objects and names), followed by the rows of their
stacked LoRA A matrices (rollout/lora_fusion.py); o_proj and down_proj get their own A rows appended likewise. A
decode step then reads each group with one product, e.g. [W_q; W_k; W_v; A_qkv] x, instead of three base products
and an A product; q/k/v's and gate/up's B products are added inside rotary_kv and decode_silu_mul (fused_ops.LoraFold),
o/down's by their adapters from the A x of their product: 4 base and 2 LoRA products a layer instead of 7 and 11.
Moving the weights costs one copy of them at each end of a rollout (never more than one group's worth of extra
memory); release gives every weight its own storage again.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.fp8_linear import FP8Linear
from ..models.vision import FAMILIES as VISION_FAMILIES
from ..ops.fp8_matmul import fp8_group, fp8_group_linear, fp8_groupable
from ..ops.nf4_halves import halves_ok
from ..ops.nf4_matmul import NF4Group, groupable, nf4_group, nf4_group_linear, set_halves
from .attention import DecodeMeta, decode_attend
from .fused_ops import LoraFold, add_rmsnorm, decode_silu_mul, rotary_kv
from .lora_fusion import fused_adder

PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
# sibling projections read by one product; a lone projection only when its adapter's A rows ride along
PACKED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                 ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


@dataclass(frozen=True)
class QuantKernel:
    """A quantized base's decode product: which base layers it reads and how a group of them becomes its operands."""

    name: str  # "nf4", "fp8": the sampler's statistics count the projections routed to each
    reason: Callable  # base layers → why they cannot be one group of this kernel (None: they can)
    operands: Callable  # (base layers, 16-bit rows after them or None, their biases) → the product's operands
    linear: Callable  # (x [B, in], operands) → [B, Σ out (+ rows)]


@functools.cache
def _linear4bit_class() -> type | None:
    """bitsandbytes' Linear4bit, or None where it does not import: looked up once (a failed import searches the
    whole path again each time: the sampler asks for every projection of every call)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # no 4-bit layers without bitsandbytes
        return None
    return Linear4bit


def _nf4_reason(bases: list) -> str | None:
    Linear4bit = _linear4bit_class()
    if Linear4bit is None:
        return "bitsandbytes is not installed"
    if not all(isinstance(b, Linear4bit) and getattr(b.weight, "quant_state", None) is not None for b in bases):
        return "not bitsandbytes 4-bit layers"
    return groupable([b.weight for b in bases])


def _fp8_reason(bases: list) -> str | None:
    if not all(isinstance(b, FP8Linear) for b in bases):
        return "not FP8 layers"
    return fp8_groupable([b.weight for b in bases], [b.weight_scale for b in bases])


NF4_KERNEL = QuantKernel("nf4", _nf4_reason, lambda bases, dense, biases: nf4_group([b.weight for b in bases], dense,
                                                                                     biases), nf4_group_linear)
FP8_KERNEL = QuantKernel("fp8", _fp8_reason,
                         lambda bases, dense, biases: fp8_group([b.weight for b in bases],
                                                                [b.weight_scale for b in bases], dense, biases),
                         fp8_group_linear)


@dataclass
class _Pack:
    """One layer's sibling projections packed: their base weights (and biases) as row blocks of ``weight``
    [Σ out (+ Σ r), in], the fused adapters' stacked A rows last when ``group`` is set."""

    bases: list  # their base nn.Linear layers, whose parameters are views into weight / bias
    weight: torch.Tensor
    bias: torch.Tensor | None
    bounds: list  # (start, stop) rows of each base
    adders: list  # each base's fused-adapter delta hook (lora_fusion.fused_adder) or None
    group: object = None  # lora_fusion._Group fed A x from rows [a_start:] of the product
    a_start: int = 0
    fold: tuple | None = None  # q/k/v or gate/up: (column offsets into A x, (s B)ᵀ each, r) for the glue kernel
    quant: object = None  # a quantized base's operands (NF4Group, FP8Group; ``weight`` is then None)
    kernel: QuantKernel | None = None  # the product reading ``quant``

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, in] → [B, Σ out (+ Σ r)]."""
        if self.quant is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return _quant_product(x, self.bases[0], self.kernel, self.quant)


def _quant_product(x: torch.Tensor, base, kernel: QuantKernel, operands) -> torch.Tensor:
    """As the quantized layer's forward: the product in the layer's compute dtype, the result in the input's."""
    return kernel.linear(x.to(base.compute_dtype or x.dtype), operands).to(x.dtype)

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# the text models of vision-language models (models/vision/families.py) whose decoder layers are those above: LLaVA,
# LLaVA-NeXT, Idefics3, SmolVLM build one of the first four; Qwen2-VL and Qwen2.5-VL a Qwen2 stack with mRoPE,
# Qwen3-VL a Qwen3 stack (q/k norms) with interleaved mRoPE
TEXT_MODELS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
MROPE_TEXT_MODELS = ("Qwen2VLTextModel", "Qwen2_5_VLTextModel", "Qwen3VLTextModel")


def language_model(causal_lm):
    """The decoder stack a decode step runs (embed_tokens, layers, norm, rotary_emb): a causal LM's ``model``; for a
    vision-language model of a supported family, its text model (``get_decoder()``: no vision tower). None for
    anything else."""
    if type(causal_lm).__name__ in SUPPORTED:
        return getattr(causal_lm, "model", None)
    if getattr(causal_lm.config, "model_type", None) in VISION_FAMILIES:
        return causal_lm.get_decoder()
    return None


def unsupported_reason(causal_lm) -> str | None:
    """Why :class:`FastDecoder` cannot run this transformers model (None: it can)."""
    name = type(causal_lm).__name__
    body = language_model(causal_lm)
    if body is None or (name not in SUPPORTED and type(body).__name__ not in TEXT_MODELS + MROPE_TEXT_MODELS):
        return f"architecture {name}" + (f" (language model {type(body).__name__})" if body is not None else "")
    cfg = body.config  # (a vision-language model's: its text config)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp"
    if not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    return None


class FastDecoder:
    """``FastDecoder(causal_lm)(ids [B], positions [B], meta) → final hidden states [B, d]``; Triton kernels when
    ``meta.use_triton``, their PyTorch twins otherwise. With ``meta.slots`` (attention.verify_meta) the B rows are a
    verify step's virtual rows: row b's key/value go to slot slots[b] at write_index[b], and it attends there."""

    def __init__(self, causal_lm):
        self.body = language_model(causal_lm)
        self.layers = list(self.body.layers[: self.body.config.num_hidden_layers])
        self.mrope = type(self.body).__name__ in MROPE_TEXT_MODELS
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.quant: dict = {}  # projection module → (base layer, its operands or None when grouped, delta hook or
        #                        None, QuantKernel), for one rollout
        self.quant_packs: dict = {}  # (layer index, first projection's name) → _Pack of quantized bases
        self.packs: dict = {}  # (layer index, first projection's name) → _Pack, for one rollout
        self.halves: list = []  # NF4Groups whose codes take the halves layout during the rollout

    def prepare_quantized(self, pack: bool = True, kernels: tuple = (NF4_KERNEL, FP8_KERNEL),
                          halves: bool = False) -> dict:
        """Route the projections over quantized bases through ``kernels``' products for the coming rollout (call
        inside the sampler's fused-LoRA context, before :meth:`prepare_packing` and before its graphs are captured),
        grouped by layer when ``pack`` (module docstring); returns how many projections each kernel took, by name.
        The operands (NF4's expanded block scales: 4 bytes per 64 parameters; the groups' copies of the A rows)
        live until :meth:`release_quantized`. ``halves``: the NF4 groups' codes re-paired in place into the halves
        layout (ops/nf4_halves.py) until then; a forward through the modules meanwhile runs inside
        :meth:`module_order`."""
        self.quant, self.quant_packs = {}, {}
        routed = {}  # module → (base, adder, kernel)
        for layer in self.layers:
            for parent, name in PROJECTIONS:
                module = getattr(getattr(layer, parent), name)
                base = getattr(module, "base_layer", module)
                # the kernel's layers and shapes; others keep the module call
                kernel = next((k for k in kernels if k.reason([base]) is None), None)
                if kernel is None:
                    continue
                adder = fused_adder(base)
                peft_runs = base is not module and adder is None and not getattr(module, "disable_adapters", False)
                if not peft_runs:  # (PEFT's forward adds the adapters: only the module call is right)
                    routed[module] = (base, adder, kernel)
        for i, layer in enumerate(self.layers):
            for parent, names in PACKED_GROUPS:
                modules = [getattr(getattr(layer, parent), n) for n in names]
                group = _quant_pack(modules, routed) if pack else None
                if group is not None:
                    self.quant_packs[(i, names[0])] = group
                for m in modules:
                    if m in routed:
                        base, adder, kernel = routed[m]
                        ops = None if group is not None else kernel.operands([base], None, [base.bias])
                        self.quant[m] = (base, ops, adder, kernel)
        counts = {k.name: 0 for k in kernels}
        for *_, kernel in self.quant.values():
            counts[kernel.name] += 1
        self.halves = [g for g in self._nf4_operands() if halves_ok(g.K)] if halves else []
        if self.halves:  # every group's 16 code values read to the host at once (one synchronisation, not one a group)
            for group, table in zip(self.halves, torch.stack([g.code.float() for g in self.halves]).tolist()):
                group.table = tuple(table)
        try:
            self.set_halves(True)
        except BaseException:  # (out of memory for the scratch: the groups already done go back)
            self.set_halves(False)
            raise
        return counts

    def _nf4_operands(self) -> list:
        """The NF4 groups of this rollout (packed and single), each once."""
        ops = [p.quant for p in self.quant_packs.values()] + [o for _, o, _, _ in self.quant.values()]
        return list({id(o): o for o in ops if isinstance(o, NF4Group)}.values())

    def set_halves(self, on: bool) -> None:
        """The halves groups' codes into the halves layout (on) or back into bitsandbytes' order; each group's
        weights change in place, only where their layout differs."""
        for group in self.halves:
            set_halves(group, on)

    @contextlib.contextmanager
    def module_order(self):
        """The NF4 weights in bitsandbytes' order for a forward through the modules (prefill, extend steps: they
        dequantize with bitsandbytes), in the halves layout again after it."""
        self.set_halves(False)
        try:
            yield
        finally:
            self.set_halves(True)

    def release_quantized(self) -> None:
        """The NF4 weights back in bitsandbytes' order, the routing dropped (callable again after a failure)."""
        self.set_halves(False)
        self.quant, self.quant_packs, self.halves = {}, {}, []

    def prepare_packing(self) -> int:
        """Pack each layer's q/k/v and gate/up base weights, and o/down's when they have fused adapters (see the
        module docstring), for the coming rollout (call inside the sampler's fused-LoRA context, after
        :meth:`prepare_nf4`, before graphs are captured); returns how many groups. Groups with another base (4-bit,
        biased unlike their siblings, other dtypes or widths) or whose adapters run through PEFT's own forward stay
        as they are."""
        self.release_packing()
        with torch.inference_mode(False), torch.no_grad():  # (parameters must never become inference tensors)
            for i, layer in enumerate(self.layers):
                for parent, names in PACKED_GROUPS:
                    modules = [getattr(getattr(layer, parent), n) for n in names]
                    pack = _pack_group(modules, self.quant)
                    if pack is not None:
                        self.packs[(i, names[0])] = pack
        _return_cached_blocks(any(p.weight.is_cuda for p in self.packs.values()))
        return len(self.packs) + len(self.quant_packs)

    def release_packing(self) -> None:
        """Every packed weight back in storage of its own, a group at a time: a group's buffer is freed with its
        last view before the next group's weights are copied (one group's worth of extra memory at most, while the
        rollout's KV cache may still be allocated). A group leaves the registry only once all its weights are out, so
        a release that fails part-way (out of memory) can be called again and finishes the job."""
        cuda = any(p.weight.is_cuda for p in self.packs.values())
        with torch.inference_mode(False), torch.no_grad():
            while self.packs:
                key = next(iter(self.packs))
                pack = self.packs[key]
                for base in pack.bases:
                    for param, buffer in ((base.weight, pack.weight), (base.bias, pack.bias)):
                        if param is not None and _shares_storage(param, buffer):
                            param.data = param.data.clone()
                del self.packs[key], pack  # the last references to this group's buffer
        _return_cached_blocks(cuda)

    def _project_folded(self, i: int, first: str, modules: list, x: torch.Tensor):
        """(the projections' outputs, the LoRA deltas the next glue kernel adds or None): with a packed group whose
        adapters fold (q/k/v → rotary_kv, gate/up → decode_silu_mul), the base outputs and A x from one product, the
        B products left to the kernel; otherwise the outputs with their deltas added."""
        pack = self.packs.get((i, first)) or self.quant_packs.get((i, first))
        if pack is None or pack.fold is None:
            return self._project_group(i, first, modules, x), None
        y = pack.product(x)  # [B, Σ out + Σ r]
        return [y[:, a:b] for a, b in pack.bounds], LoraFold(y[:, pack.a_start:], *pack.fold)

    def _project_group(self, i: int, first: str, modules: list, x: torch.Tensor) -> list:
        """The outputs of sibling projections (or a lone one; ``first``: the first one's name) on x [B, in]: one
        packed product, or a call each."""
        pack = self.packs.get((i, first)) or self.quant_packs.get((i, first))
        if pack is None:
            return [self._project(m, x) for m in modules]
        y = pack.product(x)  # [B, Σ out (+ Σ r)]
        if pack.group is not None:
            pack.group.seed(x, y[:, pack.a_start:])
        return [y[:, lo:hi] if adder is None else adder(base, (x,), y[:, lo:hi])
                for base, (lo, hi), adder in zip(pack.bases, pack.bounds, pack.adders)]

    def _project(self, module, x: torch.Tensor) -> torch.Tensor:
        entry = self.quant.get(module)
        if entry is None:
            return module(x)
        base, operands, adder, kernel = entry
        y = _quant_product(x, base, kernel, operands)
        return y if adder is None else adder(base, (x,), y)

    @staticmethod
    def build(causal_lm) -> "FastDecoder | None":
        return None if unsupported_reason(causal_lm) else FastDecoder(causal_lm)

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, D] of one decode token a sequence at ``positions`` [B], from the model's own rotary module
        (its inv_freq, rope type and attention_scaling). mRoPE text models get the three position rows (temporal,
        height, width) their forward makes of 1-D position ids, all equal: after the prompt a token's three
        components are equal (prompt_len + index + rope_delta, which ``positions`` holds), so each frequency i,
        whichever row the section or interleaved layout reads it from, is positions · inv_freq[i]: the 1-D rotary.
        (tests/test_vision_fast_decode.py checks that against the module, Qwen3-VL's interleaved layout included.)"""
        pos = positions[:, None]  # [B, 1]
        if self.mrope:
            pos = pos[None].expand(3, -1, -1)  # [3, B, 1]
        cos, sin = self.body.rotary_emb(h[:, None], pos)  # [B, 1, D] each
        if cos.dim() != 3:  # (a transformers release that leaves the sections to the attention: not taken)
            raise RuntimeError(f"rotary embedding of shape {tuple(cos.shape)}; expected [B, 1, head_dim]")
        return cos[:, 0], sin[:, 0]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMeta) -> torch.Tensor:
        tri, cache = meta.use_triton, meta.cache
        h = self.body.embed_tokens(ids)  # [B, d]
        cos, sin = self.rotary(h, positions)  # [B, D] each
        delta = None
        stage = _fp8_stage(cache, ids.shape[0]) if cache.fp8 else None
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            h, x = add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, tri)
            attn = layer.self_attn
            qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if self.qk_norm else (None, None)
            qkv, lora = self._project_folded(i, "q_proj", [attn.q_proj, attn.k_proj, attn.v_proj], x)
            if cache.fp8:  # keys/values staged in the compute dtype, then quantized into the slot store
                k_at, v_at, idx = stage
                slots = None
            else:
                k_at, v_at, idx = cache.k_suf[i], cache.v_suf[i], meta.write_index
                slots = meta.slots
            q = rotary_kv(*qkv, cos, sin, k_at, v_at, idx, tri, *qk_norms,
                          eps=attn.q_norm.variance_epsilon if self.qk_norm else 1e-6, lora=lora,
                          slots=slots)  # [B, Hq, D]
            if cache.fp8:
                cache.write_decode(i, k_at[:, :, 0], v_at[:, :, 0], meta.write_index, tri, meta.slots)
            out = decode_attend(q, i, meta, attn.scaling).to(q.dtype)  # [B, Hq, D]
            delta = self._project_group(i, "o_proj", [attn.o_proj], out.reshape(out.shape[0], -1))[0]
            norm = layer.post_attention_layernorm
            h, x = add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, tri)
            mlp = layer.mlp
            gate_up, lora = self._project_folded(i, "gate_proj", [mlp.gate_proj, mlp.up_proj], x)
            h_mlp = decode_silu_mul(*gate_up, tri, lora=lora)
            delta = self._project_group(i, "down_proj", [mlp.down_proj], h_mlp)[0]
        norm = self.body.norm
        return add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, tri)[1]


def _fp8_stage(cache, rows: int) -> tuple:
    """(k, v [rows, Hkv, 1, D], index [rows] zeros): where rotary_kv puts an FP8 cache's new keys/values before they
    are quantized into the slot store: the cache's stage, or for more rows than slots (a verify step's virtual rows)
    a buffer of this step's own."""
    if rows <= cache.k_stage.shape[0]:
        return cache.k_stage[:rows], cache.v_stage[:rows], cache.stage_index[:rows]
    shape = (rows, *cache.k_stage.shape[1:])
    return (torch.empty(shape, dtype=cache.k_stage.dtype, device=cache.k_stage.device),
            torch.empty(shape, dtype=cache.v_stage.dtype, device=cache.v_stage.device),
            torch.zeros(rows, dtype=torch.long, device=cache.k_stage.device))


def _shares_storage(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def _return_cached_blocks(cuda: bool) -> None:
    """Hand the blocks the moved weights left behind back to the driver: their sizes rarely fit a later allocation
    (the KV cache that follows wants one large one)."""
    if cuda:
        torch.cuda.empty_cache()


def _lora_rows(modules: list, bases: list, dtype: torch.dtype):
    """(adders, the fused group, its stacked A rows [Σ r, in], the glue kernels' fold) of sibling projections whose
    fused adapters group exactly these projections (A rows None otherwise; adders None: PEFT's forward adds an
    adapter here, so only the module calls are right)."""
    adders = [fused_adder(b) for b in bases]
    for m, b, adder in zip(modules, bases, adders):
        if b is not m and adder is None and not getattr(m, "disable_adapters", False):
            return None, None, None, None
    if all(a is not None for a in adders) and len({id(a.group) for a in adders}) == 1:
        g = adders[0].group
        spans = [a.rows for a in adders]
        if (g.size == len(adders) and g.a_t.dtype == dtype and spans[0][0] == 0
                and all(p[1] == n[0] for p, n in zip(spans, spans[1:])) and spans[-1][1] == g.a_t.shape[1]):
            fold = None
            ranks = {a.rows[1] - a.rows[0] for a in adders}
            if len(bases) > 1 and len(ranks) == 1 and all(a.b_t.dtype == dtype for a in adders):  # q/k/v, gate/up
                fold = (tuple(a.rows[0] for a in adders), tuple(a.b_t for a in adders), ranks.pop())
            return adders, g, g.a_t.t(), fold
    return adders, None, None, None


def _quant_pack(modules: list, routed: dict) -> "_Pack | None":
    """The group of sibling projections routed to one quantized product (``routed``: module → (base, adder,
    kernel)), their adapters' A rows read by the same product when the fused adapters group exactly these
    projections; None when they cannot be one group (or, alone without A rows, would gain nothing)."""
    if not all(m in routed for m in modules) or len({routed[m][2] for m in modules}) > 1:
        return None
    bases, kernel = [routed[m][0] for m in modules], routed[modules[0]][2]
    dtypes = {b.compute_dtype for b in bases}
    if kernel.reason(bases) or len(dtypes) > 1 or None in dtypes:
        return None
    adders, group, a_rows, fold = _lora_rows(modules, bases, dtypes.pop())
    if adders is None or (a_rows is None and len(bases) == 1):
        return None
    ops = kernel.operands(bases, a_rows, [b.bias for b in bases])
    bounds, start = [], 0
    for b in bases:
        bounds.append((start, start + b.out_features))
        start += b.out_features
    return _Pack(bases, None, None, bounds, adders, group, start, fold, quant=ops, kernel=kernel)


def _pack_group(modules: list, quant: dict) -> "_Pack | None":
    """Move the base weights of sibling projections (or of a lone one with an adapter) into one buffer, their
    adapters' A rows appended when the fused adapters group exactly these projections; None when they cannot
    share one product (or, alone, would gain nothing)."""
    bases = [getattr(m, "base_layer", m) for m in modules]
    w0 = bases[0].weight
    if (any(type(b) is not torch.nn.Linear or m in quant for m, b in zip(modules, bases))
            or any(b.weight.dtype != w0.dtype or b.weight.device != w0.device or b.in_features != bases[0].in_features
                   or not b.weight.is_contiguous() for b in bases)
            or len({None if b.bias is None else b.bias.dtype for b in bases}) > 1):  # (one bias buffer, one dtype)
        return None
    adders, group, a_rows, fold = _lora_rows(modules, bases, w0.dtype)
    if adders is None or (a_rows is None and len(bases) == 1):
        return None  # PEFT's forward adds an adapter; or a lone projection gains nothing from a copy of its weight
    outs = [b.out_features for b in bases]
    total = sum(outs) + (a_rows.shape[0] if a_rows is not None else 0)
    weight = torch.empty(total, w0.shape[1], dtype=w0.dtype, device=w0.device)
    bias = torch.zeros(total, dtype=bases[0].bias.dtype, device=w0.device) if bases[0].bias is not None else None
    bounds, start = [], 0
    for b, n in zip(bases, outs):
        weight[start:start + n] = b.weight
        b.weight.data = weight[start:start + n]  # the parameter object stays; its old storage is freed
        if bias is not None:
            bias[start:start + n] = b.bias
            b.bias.data = bias[start:start + n]
        bounds.append((start, start + n))
        start += n
    if a_rows is not None:
        weight[start:] = a_rows
    return _Pack(bases, weight, bias, bounds, adders, group, start, fold)
