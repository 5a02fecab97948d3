"""Memory planner: predict the GPU and host peak of a GRPO training step and choose its knobs.

Counted in bytes, for a decoder of L layers, hidden H, MLP width I, KV width K (= kv heads × head dim), query
width Q (= heads × head dim D), vocab V, 16-bit (b = 2) or float32 (b = 4) base weights, LoRA rank r on every
linear projection, micro-batches of T tokens and the MLP in tiles of t tokens (t = T untiled). Backward runs the
log-prob chunks, then each layer from the last to the first: recomputed with autograd and backpropagated before
the next one starts. So the peak is inside one of those steps, and a term counts only where it is live then:

    weights      = base parameters × b                          (4-bit bases: nf4_weight_bytes; FP8: fp8_weight_bytes)
    lora         = LoRA parameters × 4 × (1 + 1 + 2)            fp32 weights, grads, Adam moments
    gpu inputs   = n × T × s                                    s = H b per layer input (+ Q b + 4 heads with
                   attention reuse); n = L without offloading; offloaded, n = max(gpu_resident, 2): the last
                   layer's backward holds every resident input, an offloaded layer's its own fetched input and the
                   prefetched one of the layer below (memory/offload.py: load). With attention reuse the fetched
                   attention output comes back as a contiguous [B, heads, T, D] tensor, and o_proj keeps a
                   [B, T, heads, D] copy of it: the attention output counted in kept
    layer        = kept + max(mlp, norm, attention)             one layer recomputed and backpropagated:
      kept       = T × (H b + 8 H + H b + 2 Q b + 2 K b + 4 heads + 2 D b + 4 r b) + 3 t r b
                   what the recompute keeps through the layer's backward: the layer's incoming gradient (the
                   recomputed output's values are freed before its backward: memory/offload.py), both RMSNorm inputs
                   in float32 (8 H; 4 H for b = 4, whose first norm input is the layer input itself), the input
                   norm's output (q/k/v's LoRA input), q and the attention output, k and v (Q each when repeated for
                   cuDNN/efficient SDPA), the log-sum-exp, rotary cos/sin, the LoRA A outputs
      mlp        = (T H + 6 t I + (T − t) H) × b               the post-norm output (the tiles' input); one tile's
                   gate, act(gate) and up, with the product's gradient from the base and LoRA paths and their sum;
                   the finished tiles' input gradients, waiting for the split (memory/tiling.py); 5 t I with the
                   fused SiLU·up (ops/swiglu.py: act(gate) is recomputed, not kept)
      norm       = 5 × T × H × 4                                an RMSNorm's backward: float32 temporaries
      attention  = T × ((H + Q) b − 4 H) + T × (Q b + 2 K b + 4 Q + 2 Q b · [K < Q])
                   the residual's and the attention output's gradients, less the post-norm float32 input freed by
                   then, plus flash attention's backward (dq, dk, dv, a float32 dq accumulator, dk/dv expanded to
                   the query heads for GQA: PyTorch's flash_api.cpp mha_bwd); where SDPA runs cuDNN's kernels
                   (ops/attention_backend.training_attention_kernel) float32 dk, dv and a statistic per query head
                   instead of the expanded dk, dv: T × (4 Q + (8 K · [K < Q]) + 4 heads)
    log-prob     = T × H × 4 + 2 T × H × b + 4 × chunk × V × 4  the final RMSNorm's float32 input, the completion
                   rows' hidden states and their gradient, one chunk of float32 logits, log-probs, probabilities
                   and logit gradients (ops/logprobs.py: backward); with the row kernels (a GPU, no softcap:
                   ops/logprob_kernel.py) one chunk of logits in the compute dtype, overwritten by their gradient,
                   instead: chunk × V × b
    whole        = W × (kept + 3 T I b)                        the last W layers not checkpointed
                   (model.no_recompute_layers): every activation from forward to backward, the MLP's gate, up and
                   product too (4 T I b with transformers' MLP, which keeps act(gate) as well); the other L − W
                   layers are checkpointed as above (their inputs counted in gpu inputs)
    host         = (L − W − gpu_resident) × T × s               pinned pool of layer inputs (offloaded only)

    peak GPU     = weights + lora + gpu inputs + max(layer, log-prob)
                   (the log-prob chunks are freed before the last layer recomputes; the log-prob step holds only
                   the resident inputs, at most the n counted)

Nothing else of the forward is live in backward: the final hidden states are freed once the log-prob backward has
run, an offload copy once it has reached the host. The forward passes hold less than a layer's backward (no
gradients). Measured on a GPU and traced tensor by tensor on the CPU, the largest term is the MLP at long untiled micro-batches (6 T I b), else the RMSNorm backward (20 T H bytes).

The rollout phase (longrl's sampler) holds the weights, the LoRA weights and Adam moments (grads are freed),
the KV cache and a workspace; its memory goes back to the allocator before the training phase, so a step's
peak is the larger of the two phases:

    kv cache     = (P × L_prompt + S × L_completion) × 2 L K × b   S concurrent sequences (all N when they fit;
                                                                 fewer run with queueing when they do not)
    workspace    = prefill_tokens × (6 H + 3 I) × b + min(N, 1024) × V × 4 × 6 + 256 MiB
                   (one prefill forward; float32 logits and their sampling temporaries)

T is the micro-batch token budget: a sequence longer than the budget is a micro-batch alone, so the budget
is at least the longest sequence. The planner picks the largest budget that fits, up to the longest sequence
or MAX_PACKED_TOKENS, whichever is larger (packed micro-batches need a [T, T] attention mask),
then keeps as many layer inputs on the GPU as the remaining memory allows, then (untiled) takes the last layers out
of checkpointing while the whole step fits in KEPT_LAYERS_SHARE of the memory: each one saves its recompute (a
layer's forward, 1/4 to 1/3 of its training FLOPs) for ~(kept + 3 T I b) of memory. MLP tiles are chosen only when the
longest micro-batch cannot fit untiled: the largest of T/2, T/3, ... (rounded up to MLP_TILE_ALIGN tokens) that
fits. Tiling costs one extra MLP forward per token in backward, 2 × 3 H I FLOPs per token and layer: ~13% of a
step at 20K tokens for Llama-3.1-8B (linear layers dominate), ~2% at 400K (attention dominates). The terms count
the tensors of a Llama layer under PEFT LoRA (dropout 0) and transformers' SDPA attention, micro-batches of one
sequence or stacked equal ones (a packed micro-batch's [T, T] mask is not counted);
`benchmarks/planner_accuracy.py` compares them with the peaks `benchmarks/grpo_memory.py` measured.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30
F32 = 4  # bytes of a float32 element
MAX_PACKED_TOKENS = 16384  # packing unequal sequences needs a [T, T] attention mask and slower kernels
MLP_TILE_ALIGN = 1024  # MLP tiles are multiples of this (and at least this): smaller ones waste GEMM efficiency
# grouped rows (train.shared_prompt null) are chosen when a group's P + G·R tokens are at most this share of the
# G·(P + R) of G separate sequences. Measured on an H200 (8B, LoRA, G = 8, reference + policy passes, warmed): 4.04×
# faster at share 0.18 (16K prompts, 1K answers), 2.71× at 0.30 (4K, 1K); shares above are not measured yet
# (the default 512-token prompts with 256-token answers sit at 0.42), so they keep separate sequences
SHARED_PROMPT_MAX_SHARE = 0.35
# fraction of free GPU memory the plan may use (the planner's error, allocator fragmentation, CUDA workspaces):
# with the allocator's fixed segments, which fragment, and with its expandable segments (longrl's default:
# allocator.py), which reserve little above what is allocated
_SAFETY = 0.92
_SAFETY_EXPANDABLE = 0.95


def safety_fraction(environ=None) -> float:
    """The fraction of free GPU memory a plan may use under this process's allocator settings (the variable this
    torch reads: allocator.py)."""
    import os

    from ..allocator import ALLOCATOR_VARIABLES, EXPANDABLE, _torch_before_2_10

    environ = os.environ if environ is None else environ
    names = ALLOCATOR_VARIABLES[1:] if _torch_before_2_10() else ALLOCATOR_VARIABLES
    settings = next((environ[v] for v in names if v in environ), "")
    return _SAFETY_EXPANDABLE if EXPANDABLE.lower() in settings.replace(" ", "").lower() else _SAFETY


class PlanError(RuntimeError):
    """The job cannot fit; the message says what to change."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    q_dim: int
    vocab: int
    tied: bool
    heads: int = 0  # query heads (0: q_dim // 128)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return cls(c.num_hidden_layers, c.hidden_size, c.intermediate_size, kv_heads * head_dim,
                   c.num_attention_heads * head_dim, c.vocab_size, bool(getattr(c, "tie_word_embeddings", False)),
                   c.num_attention_heads)

    @property
    def query_heads(self) -> int:
        return self.heads or max(1, self.q_dim // 128)

    @property
    def head_dim(self) -> int:
        return self.q_dim // self.query_heads

    @property
    def kv_heads(self) -> int:
        return self.kv_dim // self.head_dim

    def saved_bytes_per_token(self, compute_bytes: int, reuse_attention: bool = False) -> int:
        """What offloaded checkpointing keeps per layer and token: the layer input, and with attention reuse the
        attention output and its float32 log-sum-exp per head."""
        per = self.hidden * compute_bytes
        if reuse_attention:
            per += self.q_dim * compute_bytes + self.query_heads * 4
        return per

    def base_params(self) -> int:
        h = self.hidden
        attn = h * self.q_dim * 2 + h * self.kv_dim * 2
        mlp = 3 * h * self.intermediate
        head = 0 if self.tied else self.vocab * h
        return self.layers * (attn + mlp + 2 * h) + self.vocab * h + head + h

    def layer_params(self) -> int:
        """One decoder layer's weights (FSDP2's unit of sharding)."""
        h = self.hidden
        return h * self.q_dim * 2 + h * self.kv_dim * 2 + 3 * h * self.intermediate + 2 * h

    def lora_params(self, r: int) -> int:
        h, i = self.hidden, self.intermediate
        per_layer = r * ((h + self.q_dim) * 2 + (h + self.kv_dim) * 2 + (h + i) * 3)
        return self.layers * per_layer

    def linear_params(self) -> int:
        """Weights of the decoder's linear projections (q, k, v, o, gate, up, down): what a 4-bit base quantizes."""
        h = self.hidden
        return self.layers * (h * self.q_dim * 2 + h * self.kv_dim * 2 + 3 * h * self.intermediate)


def nf4_weight_bytes(shape: ModelShape, compute_bytes: int, exception_budget: float) -> int:
    """Base weights of a 4-bit NF4 base: the linear projections at NF4_BYTES_PER_PARAM (4-bit codes, an 8-bit
    absmax per 64 weights, a float32 scale per 256 absmax), everything else (embeddings, LM head, norms) at
    ``compute_bytes``, times (1 + exception_budget): the most the 16-bit exceptions may add (models/quantize.py)."""
    from ..models.quantize import NF4_BYTES_PER_PARAM

    linear = shape.linear_params()
    plain = linear * NF4_BYTES_PER_PARAM + (shape.base_params() - linear) * compute_bytes
    return int(plain * (1 + exception_budget))


def fp8_weight_bytes(shape: ModelShape, compute_bytes: int, exception_budget: float) -> int:
    """Base weights of an FP8 base: the linear projections at FP8_BYTES_PER_PARAM (an e4m3 byte a weight, a float32
    scale per 128 × 128 block), everything else at ``compute_bytes``, times (1 + exception_budget) as for NF4."""
    from ..ops.fp8_blocks import FP8_BYTES_PER_PARAM

    linear = shape.linear_params()
    plain = linear * FP8_BYTES_PER_PARAM + (shape.base_params() - linear) * compute_bytes
    return int(plain * (1 + exception_budget))


@dataclass
class Plan:
    micro_batch_tokens: int
    gpu_resident_layers: int
    offload: bool
    logprob_chunk_size: int
    predicted_gpu_bytes: int
    predicted_host_bytes: int
    parts_gpu_bytes: dict
    mlp_tile_tokens: int | None = None  # MLP sequence tile (memory/tiling.py); None: untiled
    rollout: "RolloutPlan | None" = None  # the sampler phase (plan_for_config sets it)
    checkpointing: bool = True  # layers recomputed in backward (offloaded or plain); False: every activation kept
    budget_bytes: int = 0  # the GPU memory planned for (train.gpu_memory_gib, or what was free)
    reuse_attention: bool = False  # offloaded layers keep their attention outputs (memory/attention_reuse.py)
    no_recompute_layers: int = 0  # the last layers not checkpointed: all activations kept, no recompute
    shared_prompt: bool = False  # the passes run grouped rows: each prompt once, then its completions
    # a GRPO step's tokens on one GPU: (as planned, as G separate sequences, completions a row with grouped rows)
    step_tokens: tuple[int, int, int] | None = None
    reference: "ReferenceMemory | None" = None  # the KL reference copy of a full-weight run (counted in the parts)
    vision: "VisionMemory | None" = None  # a vision-language model's tower, features and activations (in the parts)

    def table(self) -> str:
        rows = [("GPU memory planned for", f"{self.budget_bytes / GIB:8.2f} GiB")] if self.budget_bytes else []
        rows += [("micro-batch token budget", f"{self.micro_batch_tokens:,}"),
                 ("activation checkpointing", "yes" if self.checkpointing else "no"),
                 ("offloaded checkpointing", "yes" if self.offload else "no"),
                 ("attention reuse", "yes" if self.reuse_attention else "no"),
                ("layer inputs kept on GPU", str(self.gpu_resident_layers)),
                ("layers not recomputed", str(self.no_recompute_layers)),
                ("log-prob chunk (rows)", f"{self.logprob_chunk_size:,}"),
                ("MLP tile (tokens)", f"{self.mlp_tile_tokens:,}" if self.mlp_tile_tokens else "off")]
        if self.step_tokens is not None:
            planned, separate, per_row = self.step_tokens
            rows += [("shared prompt (grouped rows)",
                      f"on: a prompt and up to {per_row} completions a row, {planned:,} tokens a step instead of "
                      f"{separate:,}" if self.shared_prompt else
                      f"off: {separate:,} tokens a step")]
        if self.reference is not None:
            rows += [("KL reference", self.reference.describe())]
        if self.vision is not None:
            rows += [("images", self.vision.describe())]
        rows += [(f"GPU: {k}", f"{v / GIB:8.2f} GiB") for k, v in self.parts_gpu_bytes.items()]
        rows += [("predicted peak GPU", f"{self.predicted_gpu_bytes / GIB:8.2f} GiB  (of layer recompute and log-prob "
                                        "backward, only the larger: they are not live together)"),
                 ("predicted peak host (pinned)", f"{self.predicted_host_bytes / GIB:8.2f} GiB")]
        if self.rollout is not None:
            r = self.rollout
            rows += [("rollout: concurrent sequences", f"{r.slots:,} of {r.sequences:,}")]
            rows += [(f"rollout GPU: {k}", f"{v / GIB:8.2f} GiB") for k, v in r.parts_gpu_bytes.items()]
            rows += [("predicted peak GPU (rollout)", f"{r.predicted_gpu_bytes / GIB:8.2f} GiB"),
                     ("predicted peak GPU (step)",
                      f"{max(r.predicted_gpu_bytes, self.predicted_gpu_bytes) / GIB:8.2f} GiB")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass
class RolloutPlan:
    sequences: int  # N = prompts × G
    slots: int  # sequences decoded at once (the rest wait for a free slot)
    predicted_gpu_bytes: int
    parts_gpu_bytes: dict


V_ALIGN = 128  # positions an FP8 value store's capacity is a multiple of (rollout/kv_quant.py: read in whole blocks of
# 128, the e4m3 decode attention's faster key block)


def value_capacity(positions: int) -> int:
    """T' ≥ positions, a multiple of V_ALIGN: the position capacity of an FP8 value store."""
    return -(-positions // V_ALIGN) * V_ALIGN


def kv_value_pad_bytes_per_token(shape: ModelShape, fp8: bool) -> int:
    """Bytes of value codes one position of an FP8 value store holds in every layer (what each position of its
    capacity padding costs); 0 for a 16-bit cache (no padding)."""
    return shape.layers * shape.kv_dim if fp8 else 0


def kv_bytes_per_token(shape: ModelShape, compute_bytes: int, fp8: bool = False) -> int:
    """Keys + values of one position in every layer; ``fp8``: one byte an element plus a one-byte scale exponent
    per key head (rollout/kv_quant.py)."""
    if fp8:
        return 2 * shape.layers * (shape.kv_dim + shape.kv_heads)
    return 2 * shape.layers * shape.kv_dim * compute_bytes


EXTEND_WORKSPACE_BYTES = 1 << 30  # transient memory of one extend forward (a layer's gathered K/V, scores; a verify
#                                   step's float32 logits)
# speculative rollouts' draft history (earlier completions of a prompt): tokens kept a prompt (also the device drafts'
# history columns a prompt), prompts kept (host memory)
DRAFT_HISTORY_TOKENS, DRAFT_HISTORY_PROMPTS = 8192, 1024
# speculative rollouts' device drafts (rollout/device_drafts.py): positions compared at once, and their temporaries
# (the gathered sources, match masks and lengths, ranks: int64 and int32 tensors and their intermediates)
MATCH_ELEMENTS, MATCH_BYTES_PER_ELEMENT = 1 << 22, 64
SAMPLING_BYTES_PER_LOGIT = 32  # float32 logits, scaled logits, probabilities, logsumexp's temporary; top-p's sort
# (values, int64 indices, cumulative sum)
SAMPLING_CHUNK_BYTES = 512 << 20  # temporaries of the rows sampled together


def sampling_rows(vocab: int) -> int:
    """Rows the sampler draws tokens for at once: their temporaries stay within SAMPLING_CHUNK_BYTES."""
    return max(1, SAMPLING_CHUNK_BYTES // (vocab * SAMPLING_BYTES_PER_LOGIT))


def prefill_forward_tokens(prefill_tokens: int, prompts: int, prompt_len: int) -> int:
    """Tokens of the sampler's largest prefill forward: as many whole prompts as fit in ``prefill_tokens``."""
    return min(prompts, max(1, prefill_tokens // max(prompt_len, 1))) * prompt_len


def sampler_workspace_bytes(hidden: int, intermediate: int, vocab: int, sequences: int, prefill_tokens: int,
                            compute_bytes: int) -> int:
    """The sampler's memory besides weights and KV cache: one prefill forward of ``prefill_tokens`` tokens
    (prefill_forward_tokens), the float32 logits of every sequence, and the sampling temporaries of one chunk of
    rows."""
    return (prefill_tokens * (6 * hidden + 3 * intermediate) * compute_bytes + sequences * vocab * 4
            + min(sequences, sampling_rows(vocab)) * vocab * SAMPLING_BYTES_PER_LOGIT + (256 << 20))


def speculative_workspace_bytes(vocab: int, sequences: int, k: int, prompts: int, prompt_len: int,
                                completion_len: int, history_tokens: int) -> int:
    """Speculative rollouts' memory beside the plain sampler's: the verify step's float32 logits of every sequence's
    k + 1 positions (within EXTEND_WORKSPACE_BYTES), the device drafts' fixed sources (each prompt's history and
    prompt, int64), a step's sections of the members' completions (three int64 copies) and the matcher's
    temporaries (MATCH_ELEMENTS positions). The acceptance's temporaries stay within the sampling chunk's."""
    logits = min(sequences * (k + 1) * vocab * 4, EXTEND_WORKSPACE_BYTES)
    fixed = prompts * (history_tokens + prompt_len + 2) * 8
    sections = 3 * sequences * (completion_len + 9) * 8
    return logits + fixed + sections + MATCH_ELEMENTS * MATCH_BYTES_PER_ELEMENT


def prefix_entries(slots: int, prompts: int, G: int) -> int:
    """Prompt entries of the sampler's prefix store for ``slots`` decode slots: the prompts they can hold at once,
    plus one so that the next prompt can be prefilled while the last one's completions finish."""
    return min(prompts, -(-slots // G) + 1)


def rollout_kv_bytes(slots: int, *, prompts: int, G: int, prompt_len: int, completion_len: int, kv_token: int,
                     value_pad_token: int = 0) -> int:
    """KV cache of ``slots`` decode slots: each prompt entry holds prompt_len positions, each slot completion_len;
    an FP8 cache's value stores are padded to value_capacity positions (value_pad_token bytes each)."""
    entries = prefix_entries(slots, prompts, G)
    pad = (entries * (value_capacity(prompt_len) - prompt_len)
           + slots * (value_capacity(completion_len) - completion_len))
    return (entries * prompt_len + slots * completion_len) * kv_token + pad * value_pad_token


def max_rollout_slots(room: int, *, sequences: int, **kv) -> int:
    """The most decode slots (≤ sequences) whose KV cache fits in ``room`` bytes; 0 when not even one does."""
    lo, hi = 0, sequences
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if rollout_kv_bytes(mid, **kv) <= room else (lo, mid - 1)
    return lo


def plan_rollout(shape: ModelShape, *, prompts: int, G: int, prompt_len: int, completion_len: int, lora_r: int,
                 weight_bytes: float, compute_bytes: int, gpu_free_bytes: int,
                 prefill_tokens: int = 16384, nf4_scales: bool = False, trainable_base: bool = False,
                 kv_fp8: bool = False, kv_cache_bytes: int = 0, weight_shards: int = 1,
                 speculative_drafts: int = 0) -> RolloutPlan:
    """Predicted GPU memory of the rollout phase and how many sequences decode at once (see the module docstring).
    ``nf4_scales``: the NF4 decode product's float32 block scales (4 bytes per 64 base parameters, an upper bound:
    16-bit exceptions have none). ``trainable_base``: Adam's moments of every base weight stay through the rollout
    (gradients are freed). ``kv_fp8``: an FP8 KV cache (kv_bytes_per_token). ``kv_cache_bytes``: the KV budget the
    user set (generation.kv_cache_gib; 0: what is left), a PlanError when more than is left. ``weight_shards`` > 1
    (FSDP2 over that many ranks): the sampler reads the full weights, unsharded for the rollout beside each rank's
    shards; the Adam moments are sharded. ``speculative_drafts`` k > 0: speculative rollouts of up to k drafts
    (speculative_workspace_bytes)."""
    n = prompts * G
    kv = dict(prompts=prompts, G=G, prompt_len=prompt_len, completion_len=completion_len,
              kv_token=kv_bytes_per_token(shape, compute_bytes, kv_fp8),
              value_pad_token=kv_value_pad_bytes_per_token(shape, kv_fp8))
    fixed = {"base weights": int(shape.base_params() * weight_bytes),
             # float32 adapters + Adam's two moments, and the rollout's fused copy in the compute dtype
             "LoRA (+Adam, fused copy)": shape.lora_params(lora_r) * (4 * 3 + compute_bytes),
             "workspace": sampler_workspace_bytes(shape.hidden, shape.intermediate, shape.vocab, n,
                                                  prefill_forward_tokens(prefill_tokens, prompts, prompt_len),
                                                  compute_bytes)}
    if speculative_drafts:
        fixed["speculative (verify logits, drafts)"] = speculative_workspace_bytes(
            shape.vocab, n, speculative_drafts, prompts, prompt_len, completion_len, DRAFT_HISTORY_TOKENS)
    if nf4_scales:
        fixed["NF4 block scales"] = shape.base_params() * 4 // 64
    if trainable_base:
        fixed["base Adam moments"] = full_finetune_state_bytes(shape, weight_bytes, gradients=False,
                                                               optimizer=True) // weight_shards
    if weight_shards > 1:
        fixed["FSDP2 shards (beside the full weights)"] = fixed["base weights"] // weight_shards
    room = int(gpu_free_bytes * safety_fraction()) - sum(fixed.values())
    if kv_cache_bytes and kv_cache_bytes > room:
        raise PlanError(f"generation.kv_cache_gib={kv_cache_bytes / GIB:g} is more than the rollout has left after "
                        f"weights and workspace ({max(room, 0) / GIB:.2f} GiB); lower it, or set it to 0 (the sampler "
                        "takes what is left)")
    slots = max_rollout_slots(kv_cache_bytes or room, sequences=n, **kv)
    if slots < 1:
        raise PlanError(f"the rollout cannot hold one sequence of {prompt_len + completion_len:,} tokens: "
                        f"{rollout_kv_bytes(1, **kv) / GIB:.2f} GiB of KV cache, "
                        f"{max(room, 0) / GIB:.2f} GiB left after weights and workspace; shorten "
                        "generation.max_completion_length" + ("" if kv_fp8 else ", or set generation.kv_cache_dtype=fp8")
                        + ("" if weight_bytes < 2 else ", or use a 4-bit base (model.load_in_4bit=true)"))
    parts = {**fixed, "KV cache": rollout_kv_bytes(slots, **kv)}
    return RolloutPlan(n, slots, sum(parts.values()), parts)


def predict(shape: ModelShape, *, tokens: int, lora_r: int, weight_bytes: float, offload: bool, gpu_resident: int,
            chunk: int, optimizer: bool = True, trainable_head: bool = False, trainable_base: bool = False,
            mlp_tile: int | None = None, reuse_attention: bool = False, repeat_kv: bool = False,
            compute_bytes: int | None = None, checkpointing: bool = True,
            logprob_kernel: bool = False, weight_shards: int = 1, fused_norms: bool = False,
            no_recompute: int = 0, grouped_attention: bool = False,
            attention_kernel: str = "flash") -> tuple[int, int, dict]:
    """(GPU bytes, host bytes, GPU parts) for micro-batches of ``tokens`` tokens, the MLP in tiles of ``mlp_tile``,
    attention outputs kept with the layer inputs when ``reuse_attention``, keys/values repeated to the query heads
    when ``repeat_kv`` (ops/attention_backend.py: SDPA keeps the repeated K and V, 2 · T · (q_dim − kv_dim) more
    elements through the layer's backward). See the module docstring. ``compute_bytes``: b, the activations'
    element size (default: that of the weights, 2 below 4 bytes a parameter; a 4-bit base computing in float32
    has b = 4 at ~1 byte a parameter). ``trainable_base``: every base weight trains (lora.enabled=false): its
    gradient and Adam's two moments, in the weights' dtype (torch's AdamW keeps its state in the parameter's).
    ``checkpointing`` False (neither model.gradient_checkpointing nor offloading): autograd keeps every layer's
    activations from the forward to its backward, (L − 1) × (kept + 3 T I b) more than one layer's (an estimate
    from the checkpointed terms, not measured on a GPU). ``logprob_kernel``: the log-prob backward through the row
    kernels (see the module docstring). ``weight_shards`` > 1: FSDP2 over that many ranks holds 1/N of the base
    weights, their gradients and Adam's moments, plus the full weights of the root (embeddings, head) and of two
    decoder layers at a time (the one computing and the one prefetched). ``fused_norms``: the RMSNorms run as the
    fused kernels (ops/rmsnorm.py: the 16-bit input and a float32 r per row kept, no float32 copies of x).
    ``no_recompute``: with checkpointing, the last that many layers are not checkpointed (module docstring: whole).
    ``grouped_attention``: the attention backward runs per key head (ops/grouped_attention.py; attention_groups).
    ``attention_kernel``: 'flash' or 'cudnn', whose backward SDPA's one call runs (attention_backward_bytes)."""
    b = compute_bytes or (2 if weight_bytes < 4 else 4)
    n = b if fused_norms else F32  # bytes an RMSNorm keeps per element of its input
    whole = min(max(no_recompute, 0), shape.layers) if (checkpointing or offload) else 0
    L = shape.layers - whole  # the checkpointed layers
    resident = L if not offload else min(gpu_resident, L)
    per_input = shape.saved_bytes_per_token(b, reuse_attention)
    tile = mlp_tile if mlp_tile and mlp_tile < tokens else tokens
    parts = {
        "base weights": int(shape.base_params() * weight_bytes),
        "LoRA (+grads, Adam)": shape.lora_params(lora_r) * 4 * (4 if optimizer else 2),
        "layer inputs on GPU": tokens * per_input * inputs_live(L, offload, resident),
        "layer recompute": layer_backward_bytes(shape, tokens, b, tile=tile, lora_r=lora_r, offload=offload,
                                                repeat_kv=repeat_kv, norm_bytes=n, fused_mlp=fused_norms,
                                                grouped_attention=grouped_attention,
                                                attention_kernel=attention_kernel),
        "log-prob backward": logprob_backward_bytes(tokens, shape.hidden, shape.vocab, chunk, b, logprob_kernel,
                                                    norm_bytes=n),
    }
    if weight_bytes < 2:  # a 4-bit or FP8 base: each product's weight is dequantized, forward and backward
        parts["NF4 dequantized weights"] = 2 * shape.hidden * max(shape.intermediate, shape.q_dim) * b
    if trainable_head:
        parts["LoRA (+grads, Adam)"] += shape.vocab * shape.hidden * 4 * 4
    if trainable_base:
        parts["base grads (+Adam)"] = full_finetune_state_bytes(shape, weight_bytes, gradients=True,
                                                                optimizer=optimizer) // weight_shards
    if weight_shards > 1:
        parts["base weights"] //= weight_shards
        root = shape.base_params() - shape.layers * shape.layer_params()
        parts["FSDP2 unsharded root + 2 layers"] = int((root + 2 * shape.layer_params()) * weight_bytes)
    if not (checkpointing or offload) or whole:
        kept = layer_kept_bytes(shape, tokens, b, tile=tokens, lora_r=lora_r, offload=False, repeat_kv=repeat_kv,
                                norm_bytes=n)
        # the MLP's [T, I] tensors autograd keeps: gate and up (the fused SiLU·up recomputes act(gate)) and the
        # product (down's input); transformers' MLP keeps act(gate) too. fused_norms: model.fused_layers applies,
        # which installs the fused SiLU·up with the norms (models/fused_layers.py)
        mlp = (3 if fused_norms else 4) * tokens * shape.intermediate * b
        if whole:
            parts["layers not recomputed"] = whole * (kept + mlp)
        else:
            parts["activations of the other layers"] = (L - 1) * (kept + mlp)
    host = (L - resident) * tokens * per_input if offload else 0
    not_together = min(parts["layer recompute"], parts["log-prob backward"])  # sequential in backward
    return sum(parts.values()) - not_together, host, parts


def full_finetune_state_bytes(shape: ModelShape, weight_bytes: float, *, gradients: bool, optimizer: bool) -> int:
    """Training state of every base weight (lora.enabled=false): base parameters × weight bytes × (1 gradient if
    ``gradients``, + 2 Adam moments if ``optimizer``)."""
    return int(shape.base_params() * weight_bytes) * (int(gradients) + 2 * int(optimizer))


def inputs_live(layers: int, offload: bool, resident: int) -> int:
    """Layer inputs on the GPU while a layer is recomputed and backpropagated: all of them without offloading;
    offloaded, the resident ones during the last layer's backward, or an offloaded layer's own fetched input and
    the prefetched input of the layer below: max(resident, 2), at most L."""
    return layers if not offload else min(layers, max(resident, 2))


def layer_backward_bytes(shape: ModelShape, tokens: int, b: int, *, tile: int, lora_r: int, offload: bool,
                         repeat_kv: bool = False, norm_bytes: int = F32, fused_mlp: bool = False,
                         grouped_attention: bool = False, attention_kernel: str = "flash") -> int:
    """One layer recomputed and backpropagated: what the recompute keeps through the backward, plus the largest
    transient of the backward (MLP tile, RMSNorm or attention; module docstring). ``norm_bytes``: what an RMSNorm
    keeps per element of its input, 4 (transformers' float32 copy) or b (the fused kernel). ``fused_mlp``: the
    fused SiLU·up (mlp_backward_bytes). ``grouped_attention``: attention_groups. ``attention_kernel``: whose
    backward SDPA runs (attention_backward_bytes)."""
    h, i, q = shape.hidden, shape.intermediate, shape.q_dim
    kv = q if repeat_kv else shape.kv_dim
    kept = layer_kept_bytes(shape, tokens, b, tile=tile, lora_r=lora_r, offload=offload, repeat_kv=repeat_kv,
                            norm_bytes=norm_bytes)
    mlp = mlp_backward_bytes(tokens, tile, h, i, b, fused_mlp)
    return kept + max(mlp, norm_backward_bytes(tokens, h, b, norm_bytes),
                      attention_backward_bytes(tokens, h, q, kv, b, norm_bytes,
                                               attention_groups(shape, tokens, grouped_attention and not repeat_kv,
                                                                b), attention_kernel, shape.query_heads))


def layer_kept_bytes(shape: ModelShape, tokens: int, b: int, *, tile: int, lora_r: int, offload: bool,
                     repeat_kv: bool = False, norm_bytes: int = F32) -> int:
    """What a layer's recompute keeps until its backward is done, T tokens, MLP tiles of t (module docstring):

        T × (H b + 8 H + H b + 2 Q b + 2 K b + 4 heads + 2 D b + 4 r b) + 3 t r b"""
    h, q = shape.hidden, shape.q_dim
    heads = shape.query_heads
    kv = q if repeat_kv else shape.kv_dim
    per_token = (h * b  # the incoming gradient [T, H] (the recomputed output is freed: release_unread_output)
                 + h * norm_bytes * (1 if norm_bytes == b == F32 else 2)  # both RMSNorm inputs [T, H], float32
                 # copies (for b = 4 the first is the layer input itself; fused kernels: the 16-bit inputs)
                 + h * b  # the input norm's output, q/k/v's LoRA input [T, H]
                 + 2 * q * b + 2 * kv * b + heads * F32  # q, attention output [T, Q]; k, v [T, K]; lse [heads, T]
                 + 2 * (q // heads) * b  # rotary cos, sin [T, D]
                 + 4 * lora_r * b)  # LoRA A outputs of q, k, v, o [T, r]
    return tokens * per_token + tile * 3 * lora_r * b  # ... of gate, up, down for one tile [t, r]


def mlp_backward_bytes(tokens: int, tile: int, h: int, i: int, b: int, fused: bool = False) -> int:
    """The MLP's backward, one tile of t tokens at a time (t = T untiled): (T H + 6 t I + (T − t) H) × b. The
    post-norm output [T, H] (the tiles' input); the tile's gate, act(gate) and up [t, I] that autograd saves, and the
    product's gradient [t, I] from the base and the LoRA path and their sum, formed before the product is freed;
    the input gradients [t, H] of the tiles already done, which wait for the split's backward. ``fused``: the fused
    SiLU·up keeps gate and up only (act(gate) recomputed in its backward): 5 t I."""
    return (tokens * h + (5 if fused else 6) * tile * i + (tokens - tile) * h) * b


def norm_backward_bytes(tokens: int, h: int, b: int = 2, norm_bytes: int = F32) -> int:
    """An RMSNorm's backward in float32 (transformers' LlamaRMSNorm: x.to(float32), pow, mean, rsqrt), at its
    largest in pow's backward: x · rsqrt's input gradient, the mean's expanded gradient, and pow's x, 2 x and their
    product with the gradient, 5 × [T, H] float32 at once. The fused kernel (``norm_bytes`` = b < 4) writes only
    dx [T, H]: its float32 terms stay in registers."""
    return tokens * h * b if norm_bytes < F32 else 5 * tokens * h * F32


def attention_backward_bytes(tokens: int, h: int, q: int, kv: int, b: int, norm_bytes: int = F32,
                             groups: int = 1, kernel: str = "flash", heads: int = 0) -> int:
    """The attention's backward: the residual's gradient [T, H] and the attention output's [T, Q], less the
    post-attention norm's float32 input [T, H] (freed by then), plus flash attention's own (PyTorch's flash_api.cpp
    mha_bwd): dq [T, Q], dk, dv [T, K], a float32 dq accumulator [T, Q], dk and dv expanded to the query heads
    [T, Q] each when K < Q. ``groups`` > 1: the backward per key head group (ops/grouped_attention.py): the
    accumulator and the expanded dk, dv of one group, [T, Q / groups] each, the kernel's contiguous copies of the
    group's output gradient and output [T, Q / groups] each (head slices are not contiguous), and that group's dq,
    dk, dv before they are copied into the whole ones. ``kernel`` 'cudnn' (one call, groups = 1): cuDNN's backward
    holds float32 dq [T, Q], dk and dv [T, K] (when K < Q) and a float32 statistic per query head (``heads``)."""
    grads = tokens * (q * b + 2 * kv * b)
    qg, kg = q // groups, kv // groups
    if kernel == "cudnn" and groups == 1:
        internal = tokens * (q * F32 + (2 * kv * F32 if kv < q else 0) + heads * F32)
    else:
        internal = tokens * (qg * F32 + (2 * qg * b if kv < q else 0))
    if groups > 1:
        internal += tokens * (2 * qg + qg + 2 * kg) * b
    return tokens * ((h + q) * b - h * norm_bytes) + grads + internal


def attention_groups(shape: "ModelShape", tokens: int, grouped: bool, b: int = 2) -> int:
    """The flash backward calls of one layer: its key heads when ``grouped`` (the run attends through
    ops/grouped_attention.py) and the call takes that path (16-bit activations and grouped_attention.grouped_shape),
    else 1."""
    from ..ops.grouped_attention import grouped_shape

    takes = grouped and b == 2 and grouped_shape(tokens, shape.query_heads, shape.kv_heads, shape.head_dim, True)
    return shape.kv_heads if takes else 1


def logprob_backward_bytes(tokens: int, h: int, vocab: int, chunk: int, b: int, kernel: bool = False,
                           norm_bytes: int = F32) -> int:
    """The log-prob backward: the final RMSNorm's float32 input [T, H], the completion rows' hidden states and their
    gradient [≤ T, H], and one chunk's float32 logits, log-probs, probabilities and logit gradients [chunk, V]
    (with the row kernels: one chunk of logits in the compute dtype, overwritten by their gradient)."""
    return tokens * h * norm_bytes + 2 * tokens * h * b + (chunk * vocab * b if kernel else 4 * chunk * vocab * F32)


def mlp_tile_of(tokens: int, n: int) -> int:
    """⌈tokens / n⌉ rounded up to a multiple of MLP_TILE_ALIGN: the tile that cuts ``tokens`` in n."""
    per_tile = -(-tokens // n)
    return -(-per_tile // MLP_TILE_ALIGN) * MLP_TILE_ALIGN


def choose_mlp_tile(tokens: int, fits) -> int | None:
    """The largest tile :func:`mlp_tile_of` (tokens, n), n = 2, 3, ... down to MLP_TILE_ALIGN, smaller than
    ``tokens`` with ``fits(tile)``; else None. Tiles shrink as n grows and a smaller tile needs less memory, so the
    smallest such n is found by bisection: O(log(tokens / MLP_TILE_ALIGN)) calls of ``fits``."""
    if tokens <= MLP_TILE_ALIGN:
        return None

    def ok(n: int) -> bool:
        tile = mlp_tile_of(tokens, n)
        return tile < tokens and fits(tile)

    lo, hi = 2, max(2, -(-tokens // MLP_TILE_ALIGN))  # at hi the tile is MLP_TILE_ALIGN itself
    if not ok(hi):
        return None
    while lo < hi:  # smallest n in [lo, hi] that fits (ok(hi) holds)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return mlp_tile_of(tokens, lo)


def make_plan(shape: ModelShape, *, sequence_lengths: list[int], lora_r: int, weight_bytes: float,
              gpu_free_bytes: int, host_free_bytes: int, offload: bool = True, chunk: int = 1024,
              token_budget: int = 0, gpu_resident: int | None = None, mlp_tile_tokens: int | None = None,
              reuse_attention: bool = False, repeat_kv: bool = False, compute_bytes: int | None = None,
              trainable_base: bool = False, checkpointing: bool = True, logprob_kernel: bool = False,
              weight_shards: int = 1, fused_norms: bool = False, no_recompute: int | None = 0,
              grouped_attention: bool = False, attention_kernel: str = "flash",
              length_key: str = "generation.max_completion_length") -> Plan:
    """Choose the micro-batch token budget, MLP tile, GPU-resident layer inputs and layers not recomputed so the
    step fits; PlanError if not. ``mlp_tile_tokens``: None lets the planner tile the MLP when needed, 0 never
    tiles, n tiles by n. ``no_recompute``: None lets the planner take layers out of checkpointing (untiled, within
    KEPT_LAYERS_SHARE of the memory), n takes the last n out.
    ``compute_bytes``, ``trainable_base``, ``checkpointing``, ``logprob_kernel``, ``weight_shards``,
    ``fused_norms``, ``grouped_attention``, ``attention_kernel``: see :func:`predict`. ``length_key``: the config key
    a refusal tells the user to shorten."""
    longest, total = max(sequence_lengths), sum(sequence_lengths)
    usable = int(gpu_free_bytes * safety_fraction())
    # every layout keeps each layer's input (T × H × b) for the backward, on the GPU or (offloaded) in host memory:
    # a sequence whose inputs alone exceed both is refused before any search
    b = compute_bytes or (4 if weight_bytes >= 4 else 2)
    inputs = longest * shape.layers * shape.hidden * b
    if inputs > usable + (host_free_bytes if offload else 0):
        raise PlanError(f"a single sequence of {longest:,} tokens needs {inputs / GIB:,.1f} GiB for its layer inputs "
                        f"alone ({shape.layers} layers × {shape.hidden} × {b} bytes a token), more than the "
                        f"{usable / GIB:.1f} GiB usable on the GPU" + (f" and {host_free_bytes / GIB:.1f} GiB of host "
                                                                        "memory" if offload else "")
                        + f" hold; shorten {length_key}")
    # what predict() takes that no choice below changes
    step = dict(lora_r=lora_r, weight_bytes=weight_bytes, offload=offload, chunk=chunk, reuse_attention=reuse_attention,
                repeat_kv=repeat_kv, compute_bytes=compute_bytes, trainable_base=trainable_base,
                checkpointing=checkpointing, logprob_kernel=logprob_kernel, weight_shards=weight_shards,
                fused_norms=fused_norms, grouped_attention=grouped_attention, attention_kernel=attention_kernel)

    pinned_whole = no_recompute or 0  # a pinned count sizes the budget and the resident inputs too

    def cost(tokens, resident, tile=None, whole=pinned_whole):
        gpu, host, _ = predict(shape, tokens=tokens, gpu_resident=resident, mlp_tile=tile, no_recompute=whole, **step)
        return gpu, host

    def fewest_resident(tokens, tile=None) -> int:
        """Fewest GPU-resident layer inputs that leave the offloaded ones within host memory (host need falls as
        more stay on the GPU); all layers when even that is not enough."""
        if not offload:
            return 0
        return next((r for r in range(shape.layers + 1) if cost(tokens, r, tile)[1] <= host_free_bytes),
                    shape.layers)

    def fits(tokens, tile=None) -> bool:
        """Whether some split of layer inputs between GPU and host memory holds ``tokens``."""
        gpu, host = cost(tokens, fewest_resident(tokens, tile), tile)
        return gpu <= usable and host <= host_free_bytes

    tile = mlp_tile_tokens or None
    need = max(token_budget, longest)
    if mlp_tile_tokens is None and not fits(need):
        tile = choose_mlp_tile(need, lambda t: fits(need, t))
    if token_budget:
        budget = need
    else:
        if not fits(longest, tile):
            tried = tile or (MLP_TILE_ALIGN if mlp_tile_tokens is None else None)
            gpu, host = cost(longest, fewest_resident(longest, tried), tried)
            raise PlanError(
                f"a single sequence of {longest:,} tokens needs {gpu / GIB:.1f} GiB of GPU memory "
                + (f"with MLP tiles of {tried:,} tokens " if tried and tried < longest else "")
                + f"(usable: {usable / GIB:.1f} GiB) and {host / GIB:.1f} GiB of host memory (free: "
                f"{host_free_bytes / GIB:.1f} GiB); shorten {length_key}"
                + ("" if offload else ", or set model.offload_activations=true")
                + (", or use a 4-bit base (model.load_in_4bit=true)" if weight_bytes >= 2 else "")
                + (f", or lower model.no_recompute_layers (now {pinned_whole})" if pinned_whole else ""))
        lo, hi = longest, max(longest, min(total, MAX_PACKED_TOKENS))
        while lo < hi:  # largest budget that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, tile) else (lo, mid - 1)
        budget = lo
    resident = 0
    if offload:
        if gpu_resident is not None:
            resident = gpu_resident
        else:  # as many layer inputs on the GPU as fit (each one kept there is one host round trip saved)
            resident = fewest_resident(budget, tile)
            while resident < shape.layers and cost(budget, resident + 1, tile)[0] <= usable:
                resident += 1
    whole = pinned_whole
    if no_recompute is None and (checkpointing or offload) and not tile:
        share = int(gpu_free_bytes * KEPT_LAYERS_SHARE * safety_fraction())
        while whole < shape.layers and cost(budget, resident, tile, whole + 1)[0] <= share:
            whole += 1
    whole = min(whole, shape.layers) if (checkpointing or offload) else 0
    resident = min(resident, shape.layers - whole)
    gpu, host, parts = predict(shape, tokens=budget, gpu_resident=resident, mlp_tile=tile, no_recompute=whole,
                               **step)
    if reuse_attention:
        parts = {("layer inputs + attention outputs on GPU" if k == "layer inputs on GPU" else k): v
                 for k, v in parts.items()}
    if gpu > usable:
        raise PlanError(f"the step needs {gpu / GIB:.1f} GiB of GPU memory; {usable / GIB:.1f} GiB is usable"
                        + (f" (with {whole} layers not recomputed: lower model.no_recompute_layers)" if whole else ""))
    return Plan(budget, resident, offload, chunk, gpu, host, parts, tile, checkpointing=checkpointing or offload,
                budget_bytes=gpu_free_bytes, reuse_attention=bool(reuse_attention and offload),
                no_recompute_layers=whole)


def pinnable_host_bytes() -> int:
    """The host memory the plan may pin: 70% of the physical memory (pinned buffers are page-locked; the rest is
    kept for everything else)."""
    import os

    return int(0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def model_config_of(name_or_path: str, trust_remote_code: bool = False):
    """The transformers config of a model reference, without loading weights."""
    from ..models.from_checkpoint import config_source
    from ..models.tiny import TINY_NAME, tiny_config_dict
    from ..models.tiny_vision import TINY_VISION_NAME, build_vision_tokenizer, tiny_vision_config

    name_or_path = config_source(name_or_path)  # a longrl checkpoint: its own config.json, or its base's
    if name_or_path == TINY_NAME:
        from transformers import LlamaConfig

        return LlamaConfig(**tiny_config_dict(), vocab_size=20)
    if name_or_path == TINY_VISION_NAME:
        return tiny_vision_config(build_vision_tokenizer())
    from ..models.gguf import gguf_model_config, is_gguf

    if is_gguf(name_or_path):
        return gguf_model_config(name_or_path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


def logprob_kernel_applies(cfg, model_config) -> bool:
    """Whether the run's log-probs take the row kernels (ops/logprobs.py decides the same at run time): a GPU run
    (device auto counts as one: plans are for GPU jobs) of a model without a final logit softcap
    (models.loading.logit_spec)."""
    from ..models.loading import logit_spec

    softcap = logit_spec(model_config).softcap
    return str(cfg.model.device) != "cpu" and not softcap and cfg.model.dtype != "float64"


FUSED_NORM_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # models/fused_layers.py: RMSNORM_CLASSES


def fused_norms_apply(cfg, model_config) -> bool:
    """Whether the run's RMSNorms take the fused kernels (model_setup enables them on CUDA with Triton, which GPU
    installs of PyTorch carry): model.fused_layers on a GPU run (device auto counts as one, as in
    logprob_kernel_applies) of a Llama-family model."""
    text = getattr(model_config, "get_text_config", lambda: model_config)()
    return (bool(cfg.model.fused_layers) and str(cfg.model.device) != "cpu"
            and getattr(text, "model_type", "") in FUSED_NORM_MODEL_TYPES)


def grouped_attention_applies(cfg) -> bool:
    """Whether the run's attention backward runs per key head (ops/grouped_attention.py; the trainers enter it on
    CUDA through ops/attention_backend.sdpa_priority): model.grouped_attention_backward on a GPU run (device auto
    counts as one) on SDPA attention with flash first (model.sdpa_backends empty or flash first)."""
    from ..ops.attention_backend import grouped_backward_applies

    return (cfg.model.grouped_attention_backward and str(cfg.model.device) != "cpu"
            and cfg.model.attn_implementation in (None, "sdpa")
            and grouped_backward_applies(cfg.model.sdpa_backends))


def attention_kernel_of(cfg, shape: ModelShape, compute_bytes: int) -> str:
    """Whose backward the run's SDPA calls run, 'cudnn' or 'flash' (ops/attention_backend.training_attention_kernel):
    asked of PyTorch on this machine's GPU for a GPU run (device auto counts as one) in 16-bit on SDPA attention;
    'flash', the larger count for grouped-query heads, where it cannot be asked (no GPU here, e.g. `longrl plan` on
    a laptop)."""
    from ..ops.attention_backend import training_attention_kernel

    if compute_bytes != 2 or str(cfg.model.device) == "cpu" or cfg.model.attn_implementation not in (None, "sdpa"):
        return "flash"
    device = str(cfg.model.device) if str(cfg.model.device).startswith("cuda") else "cuda"  # auto: the current GPU
    return training_attention_kernel(cfg.model.sdpa_backends, shape.query_heads, shape.kv_heads, shape.head_dim,
                                     device)


# the no-recompute layout's prediction is an estimate from the checkpointed terms (predict): the auto layout takes
# it only when it fits in this fraction of the memory, else it recomputes (offloaded checkpointing)
NO_RECOMPUTE_SHARE = 0.6
# the checkpointed layouts take their last layers out of checkpointing while the step fits in this fraction of the
# memory (times safety_fraction). The prediction with such layers (kept + 3 T I b each) erred high in every run
# measured, the 8B 20,480 x 8 training step: 6 and 14 layers (H100) 44.39 / 63.28 GiB predicted for 41.75 / 60.61
# measured, 19 and 32 (H200) 75.79 / 106.50 for 72.40 / 102.88 (docs/memory.md)
KEPT_LAYERS_SHARE = 0.85


def layout_candidates(offload: bool | None, checkpointing: bool | None) -> list[tuple[bool, bool]]:
    """(offload, checkpointing) layouts to try, fastest first, for model.offload_activations and
    model.gradient_checkpointing (None: the planner decides). Offloaded checkpointing keeps as many layer inputs on
    the GPU as fit, so with room for all of them it is plain checkpointing without host traffic."""
    if offload is not None:
        return [(offload, bool(checkpointing) or offload)]
    if checkpointing is False:
        return [(False, False)]
    return ([] if checkpointing else [(False, False)]) + [(True, True)]


def shared_prompt_saves(prompt_tokens: int, completion_tokens: int, generations: int) -> bool:
    """Whether grouped rows pay for a step: G > 1 and P + G·R ≤ SHARED_PROMPT_MAX_SHARE × G·(P + R) (the
    planner's choice when train.shared_prompt is null)."""
    grouped = prompt_tokens + generations * completion_tokens
    return generations > 1 and grouped <= SHARED_PROMPT_MAX_SHARE * generations * (prompt_tokens + completion_tokens)


def shared_prompt_applies(cfg, step: "StepShape", model_config) -> bool:
    """Whether ``step`` runs grouped rows for this model: as the step says, unless grouped rows would not be exact
    for the model (models/shared_prompt.unsupported_reason), where a pinned train.shared_prompt=true is a
    ConfigError and the planner's choice falls back to separate sequences. The planner's choice is off for float32
    compute too: the flash kernels behind grouped rows take 16-bit heads (else their [L, L]-mask twin runs)."""
    from ..config import ConfigError
    from ..models.shared_prompt import unsupported_reason

    if not step.shared_prompt or (cfg.train.shared_prompt is None and cfg.model.dtype == "float32"):
        return False
    reason = unsupported_reason(model_config, step.prompt_tokens + step.completion_tokens)
    if reason is not None and cfg.train.shared_prompt:
        raise ConfigError(f"config key 'train.shared_prompt': true, but {reason}")
    return reason is None


_SMALLER_PLACEMENTS = {"gpu": "host or int8", "host": "int8"}  # where a KL reference copy that does not fit may go


@dataclass(frozen=True)
class ReferenceMemory:
    """The KL reference copy of a full-weight run (models/reference.py), per process (each rank keeps its own), for a
    decoder of L layers of P_l parameters, root parameters P_r (embeddings, LM head, final norm), b bytes a weight,
    S = PREFETCH_LAYERS + 1 layer buffers:

        gpu   GPU: (P_r + L P_l) b
        host  GPU: P_r b + S P_l b                  pinned host: L P_l b
        int8  GPU: P_r b + L (M + 4 R + 2 H b) + S M b
              (M: a layer's matrix weights at one byte each, R: their output rows, a float32 scale each; the two
              norms' vectors in b)

    resident through the rollout and the update alike."""
    placement: str
    gpu_parts: dict  # name → bytes on the GPU
    host_bytes: int  # pinned host memory

    @classmethod
    def of(cls, shape: ModelShape, placement: str, b: int) -> "ReferenceMemory":
        from ..models.reference import PREFETCH_LAYERS

        layer = shape.layer_params()
        root = shape.base_params() - shape.layers * layer
        buffers = min(PREFETCH_LAYERS + 1, shape.layers)
        if placement == "gpu":
            return cls(placement, {"KL reference copy": shape.base_params() * b}, 0)
        if placement == "host":
            return cls(placement, {"KL reference embeddings, head": root * b,
                                   "KL reference layer buffers": buffers * layer * b}, shape.layers * layer * b)
        if placement != "int8":
            raise ValueError(f"reference placement must be gpu, host or int8; got {placement!r}")
        matrices = layer - 2 * shape.hidden
        rows = shape.q_dim + 2 * shape.kv_dim + 2 * shape.hidden + 2 * shape.intermediate  # q k v o gate up down
        return cls(placement, {"KL reference embeddings, head": root * b,
                               "KL reference int8 layers": shape.layers * (matrices + 4 * rows + 2 * shape.hidden * b),
                               "KL reference layer buffers": buffers * matrices * b}, 0)

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu_parts.values())

    def reserve(self, gpu_free_bytes: int, host_free_bytes: int, world_size: int = 1) -> tuple[int, int]:
        """(GPU bytes, host bytes) left for the rest of the step: the copy comes off both (the GPU's as usable memory:
        its share of the safety margin too; the host's once for each of ``world_size`` processes, a host holding
        them all); PlanError when the copy alone does not fit."""
        gpu_left = gpu_free_bytes - int(-(-self.gpu_bytes // safety_fraction()))
        if gpu_left <= 0:
            smaller = _SMALLER_PLACEMENTS.get(self.placement)
            raise PlanError(f"the KL reference copy (grpo.reference_placement={self.placement}) takes "
                            f"{self.gpu_bytes / GIB:.1f} GiB of GPU memory, more than the "
                            f"{gpu_free_bytes * safety_fraction() / GIB:.1f} GiB usable"
                            + (f"; set grpo.reference_placement={smaller}" if smaller else ""))
        host = self.host_bytes * max(1, world_size)
        if host > host_free_bytes:
            raise PlanError(f"the KL reference copy in host memory takes {host / GIB:.1f} GiB of pinned memory"
                            + (f" ({world_size} processes, one copy each)" if world_size > 1 else "")
                            + f", more than the {host_free_bytes / GIB:.1f} GiB that may be pinned; set "
                            "grpo.reference_placement=int8 (or gpu)")
        return gpu_left, host_free_bytes - host

    def way_out(self) -> str:
        """What a refusal adds: the copy's share, and the smaller placements."""
        smaller = _SMALLER_PLACEMENTS.get(self.placement)
        return (f" (besides the KL reference copy's {self.gpu_bytes / GIB:.1f} GiB: grpo.reference_placement="
                f"{self.placement})" + (f", or set grpo.reference_placement={smaller}" if smaller else ""))

    def add_to(self, plan: "Plan", budget_bytes: int) -> None:
        """Count the copy in ``plan`` (both phases), planned in ``budget_bytes`` of GPU memory in all."""
        plan.parts_gpu_bytes.update(self.gpu_parts)
        plan.predicted_gpu_bytes += self.gpu_bytes
        plan.predicted_host_bytes += self.host_bytes
        plan.budget_bytes, plan.reference = budget_bytes, self
        if plan.rollout is not None:
            plan.rollout.parts_gpu_bytes.update(self.gpu_parts)
            plan.rollout.predicted_gpu_bytes += self.gpu_bytes

    def describe(self) -> str:
        from ..models.reference import PREFETCH_LAYERS

        text = f"{self.placement} (grpo.reference_placement): {self.gpu_bytes / GIB:.2f} GiB GPU"
        if self.host_bytes:
            text += f", {self.host_bytes / GIB:.2f} GiB pinned host, layers copied {PREFETCH_LAYERS} ahead"
        return text


def reference_placement(cfg, plan: "Plan | None") -> str | None:
    """Where a GRPO run keeps its KL reference copy: None without one (grpo.beta = 0, or LoRA: the base with the
    adapters disabled is the reference); else grpo.reference_placement, auto as the plan chose (CUDA) or gpu (on the
    CPU: the training device)."""
    if cfg.grpo.beta == 0 or cfg.lora.enabled:
        return None
    if cfg.grpo.reference_placement != "auto":
        return cfg.grpo.reference_placement
    return plan.reference.placement if plan is not None and plan.reference is not None else "gpu"


@dataclass(frozen=True)
class StepShape:
    """One optimizer step as the planner sees it: ``prompts`` prompts (over every rank) of at most ``prompt_tokens``
    tokens, each followed by ``generations`` sequences of at most ``completion_tokens`` tokens; the prompts of
    ``steps_per_rollout`` steps sampled at once when ``rollouts`` (longrl's sampler: its KV cache is planned too). ``length_key``: the
    key a refused plan tells the user to shorten."""
    prompt_tokens: int
    completion_tokens: int
    prompts: int
    generations: int = 1
    steps_per_rollout: int = 1
    rollouts: bool = False
    length_key: str = "generation.max_completion_length"
    shared_prompt: bool = False  # grouped rows: a prompt once, then its completions (P + ΣR tokens, not G·(P + R))
    reference: bool = False  # a frozen copy of the initial weights is kept (the KL reference of full weights)

    @classmethod
    def grpo(cls, cfg, completion_tokens: int) -> "StepShape":
        """A GRPO step of ``cfg``: prompts_per_step × num_generations completions of ``completion_tokens`` (the
        trajectory budget: config.trajectory_tokens) after a max_prompt_length prompt; the rollout samples
        steps_per_generation steps' prompts at once; the KL reference copy kept when beta > 0 trains full weights."""
        P, G, pin = cfg.data.max_prompt_length, cfg.grpo.num_generations, cfg.train.shared_prompt
        return cls(P, completion_tokens, cfg.train.prompts_per_step, G, cfg.grpo.steps_per_generation,
                   rollouts=cfg.generation.backend == "longrl",
                   shared_prompt=pin if pin is not None else shared_prompt_saves(P, completion_tokens, G),
                   reference=cfg.grpo.beta > 0 and not cfg.lora.enabled)

    @classmethod
    def sft(cls, cfg, examples: int | None = None) -> "StepShape":
        """A supervised step: ``examples`` (default sft.examples_per_step) sequences of sft.max_length tokens, no
        rollout."""
        return cls(1, max(1, cfg.sft.max_length - 1), cfg.sft.examples_per_step if examples is None else examples,
                   length_key="sft.max_length")


def plan_for_config(cfg, model_config, gpu_free_bytes: int, host_free_bytes: int | None = None,
                    world_size: int = 1, step: StepShape | None = None, reference_placement: str | None = None) -> Plan:
    """The plan for a run's ``step`` (default: cfg's GRPO step) in ``gpu_free_bytes`` of GPU memory
    (train.gpu_memory_gib when set and smaller): every sequence at its longest. The layout keys left null
    (model.offload_activations, model.gradient_checkpointing) are chosen here: no recomputation when it fits in
    NO_RECOMPUTE_SHARE of the memory, else offloaded checkpointing (layout_candidates). ``world_size`` > 1: one
    GPU of a data-parallel job, with the most prompts a rank gets (⌈P / N⌉); full weights (lora.enabled=false)
    sharded by FSDP2, LoRA and a 4-bit base replicated. A step that keeps the KL reference copy (StepShape.reference)
    counts it where grpo.reference_placement (``reference_placement``) puts it, auto: on the GPU when the step fits
    with it there, else in host memory (ReferenceMemory). Reads ``cfg``; writes nothing into it."""
    from ..ops.attention_backend import repeats_kv

    if step is None:
        from ..config import trajectory_tokens

        step = StepShape.grpo(cfg, trajectory_tokens(cfg))
    placement = reference_placement or (cfg.grpo.reference_placement if step.reference else None)
    if placement == "auto":
        try:
            return plan_for_config(cfg, model_config, gpu_free_bytes, host_free_bytes, world_size, step, "gpu")
        except PlanError:
            return plan_for_config(cfg, model_config, gpu_free_bytes, host_free_bytes, world_size, step, "host")
    if cfg.train.gpu_memory_gib > 0:
        gpu_free_bytes = min(gpu_free_bytes, int(cfg.train.gpu_memory_gib * GIB))
    length = step.prompt_tokens + step.completion_tokens
    prompts = -(-step.prompts // max(1, world_size))  # the most prompts a rank gets
    shards = world_size if world_size > 1 and not cfg.lora.enabled else 1
    n = prompts * step.generations
    weight_bytes = compute = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.model.dtype, 2)
    shape = ModelShape.from_config(model_config)
    if cfg.model.load_in_4bit:  # as bytes per base parameter, the unit predict() takes
        weight_bytes = nf4_weight_bytes(shape, weight_bytes, cfg.model.quant_exception_budget) / shape.base_params()
    elif cfg.model.load_in_fp8:
        weight_bytes = fp8_weight_bytes(shape, weight_bytes, cfg.model.quant_exception_budget) / shape.base_params()
    reference = ReferenceMemory.of(shape, placement, compute) if placement else None
    budget = gpu_free_bytes
    vision = vision_memory(cfg, model_config, prompts * step.steps_per_rollout, compute)
    if vision is not None:  # resident through the step: the language model is planned in what it leaves
        gpu_free_bytes -= vision.total_bytes
    if reference is not None:  # resident through both phases: the rest of the step is planned in what it leaves
        host_free_bytes = pinnable_host_bytes() if host_free_bytes is None else host_free_bytes
        gpu_free_bytes, host_free_bytes = reference.reserve(gpu_free_bytes, host_free_bytes, world_size)
    pinned = dict(token_budget=cfg.train.micro_batch_tokens, mlp_tile_tokens=cfg.train.mlp_tile_tokens,
                  reuse_attention=cfg.model.reuse_attention, no_recompute=cfg.model.no_recompute_layers)
    kernels = dict(repeat_kv=repeats_kv(cfg.model.sdpa_backends), logprob_kernel=logprob_kernel_applies(cfg, model_config),
                   fused_norms=fused_norms_apply(cfg, model_config), grouped_attention=grouped_attention_applies(cfg),
                   attention_kernel=attention_kernel_of(cfg, shape, compute))
    step_args = dict(sequence_lengths=[length] * n, lora_r=cfg.lora.r if cfg.lora.enabled else 0,
                     weight_bytes=weight_bytes,
                     host_free_bytes=pinnable_host_bytes() if host_free_bytes is None else host_free_bytes,
                     chunk=cfg.train.logprob_chunk_size, compute_bytes=compute, trainable_base=not cfg.lora.enabled,
                     weight_shards=shards, length_key=step.length_key, **pinned, **kernels)
    candidates = layout_candidates(cfg.model.offload_activations, cfg.model.gradient_checkpointing)
    shared = shared_prompt_applies(cfg, step, model_config)
    try:
        if shared:
            plan, per_row = _grouped_plan(shape, candidates, gpu_free_bytes, step_args, step, prompts)
        else:
            plan, per_row = _first_fitting(shape, candidates, gpu_free_bytes, step_args), 1
        if step.generations > 1:  # a GRPO step: its tokens either way
            rows = -(-step.generations // per_row)
            grouped = prompts * (rows * step.prompt_tokens + step.generations * step.completion_tokens)
            plan.step_tokens = (grouped if shared else n * length, n * length, per_row)
            plan.shared_prompt = shared
        if step.rollouts:
            gen = cfg.generation
            plan.rollout = plan_rollout(shape, prompts=prompts * step.steps_per_rollout,
                                        G=step.generations, prompt_len=step.prompt_tokens,
                                        completion_len=step.completion_tokens,
                                        lora_r=cfg.lora.r if cfg.lora.enabled else 0, weight_bytes=weight_bytes,
                                        compute_bytes=compute, gpu_free_bytes=gpu_free_bytes,
                                        nf4_scales=cfg.model.load_in_4bit and gen.nf4_kernel,
                                        trainable_base=not cfg.lora.enabled, kv_fp8=gen.kv_cache_dtype == "fp8",
                                        kv_cache_bytes=int(gen.kv_cache_gib * GIB), weight_shards=shards,
                                        speculative_drafts=gen.max_draft_tokens if gen.speculative != "off" else 0)
    except PlanError as e:
        text = f"{e}{reference.way_out() if reference is not None else ''}"
        if cfg.train.gpu_memory_gib > 0:
            raise PlanError(f"{text}, or raise train.gpu_memory_gib (now {cfg.train.gpu_memory_gib:g})") from None
        raise PlanError(text) from None
    if cfg.model.load_in_4bit:
        plan.parts_gpu_bytes = {("base weights (NF4 4-bit)" if k == "base weights" else k): v
                                for k, v in plan.parts_gpu_bytes.items()}
    elif cfg.model.load_in_fp8:
        names = {"base weights": "base weights (FP8 e4m3)", "NF4 dequantized weights": "FP8 dequantized weights"}
        plan.parts_gpu_bytes = {names.get(k, k): v for k, v in plan.parts_gpu_bytes.items()}
    if reference is not None:
        reference.add_to(plan, budget)
    if vision is not None:
        plan.parts_gpu_bytes.update(vision.parts())
        plan.predicted_gpu_bytes += vision.total_bytes
        plan.budget_bytes, plan.vision = budget, vision
        if plan.rollout is not None:
            plan.rollout.parts_gpu_bytes.update(vision.parts())
            plan.rollout.predicted_gpu_bytes += vision.total_bytes
    return plan


def vision_memory(cfg, model_config, prompts: int, compute_bytes: int):
    """The vision side's memory (memory/vision.py) of a vision-language config, for ``prompts`` prompts a rank
    (a rollout batch's); None for a text model."""
    from ..models.vision import vision_family
    from .vision import VisionMemory

    if vision_family(model_config) is None:
        return None
    return VisionMemory.of(model_config, prompts=prompts, compute_bytes=compute_bytes,
                           tower_trains=not cfg.lora.enabled or cfg.lora.vision_modules != "none",
                           full_weights=not cfg.lora.enabled)


def _grouped_plan(shape: ModelShape, candidates: list, gpu_free_bytes: int, step_args: dict, step: StepShape,
                  prompts: int) -> tuple[Plan, int]:
    """(plan, k) for grouped rows: the most completions k ≤ G a row (with their prompt, P + k·R tokens) at which
    the step fits, so rows of ⌈G / k⌉ × prompts; a group longer than the micro-batch budget is cut into such rows
    (memory/microbatch.prompt_group_batches). Fitting only gets easier as k falls: bisection; the PlanError of
    k = 1 (one prompt and one completion, a separate sequence's length) when none fits."""
    G, P, R = step.generations, step.prompt_tokens, step.completion_tokens

    def plan_for(k: int) -> Plan:
        lengths = [P + k * R] * (prompts * -(-G // k))
        return _first_fitting(shape, candidates, gpu_free_bytes, {**step_args, "sequence_lengths": lengths})

    try:
        return plan_for(G), G  # the usual case: whole groups fit
    except PlanError:
        if G == 1:
            raise
    best = (plan_for(1), 1)  # raises when not even one completion a row fits
    lo, hi = 2, G - 1
    while lo <= hi:
        k = (lo + hi) // 2
        try:
            best, lo = (plan_for(k), k), k + 1
        except PlanError:
            hi = k - 1
    return best


def _first_fitting(shape: ModelShape, candidates: list, gpu_free_bytes: int, step: dict) -> Plan:
    """make_plan's plan for the first layout of ``candidates`` that fits (the last one's PlanError if none does);
    the no-recompute layout, when the planner chooses, within NO_RECOMPUTE_SHARE of the memory. Attention reuse
    left null (model.reuse_attention) is on with offloading unless it costs the plan micro-batch tokens or a finer
    MLP tile, or does not fit where the layout without it does."""
    for i, (offload, checkpointing) in enumerate(candidates):
        auto_no_recompute = len(candidates) > 1 and not checkpointing
        room = int(gpu_free_bytes * NO_RECOMPUTE_SHARE) if auto_no_recompute else gpu_free_bytes
        try:
            plan = make_plan(shape, gpu_free_bytes=room, offload=offload, checkpointing=checkpointing,
                             **{**step, "reuse_attention": bool(step.get("reuse_attention"))})
            if step.get("reuse_attention") is None and offload:
                plan = _with_reuse_if_free(shape, plan, room, checkpointing, step)
        except PlanError:
            if i == len(candidates) - 1:
                raise
            continue
        plan.budget_bytes = gpu_free_bytes
        return plan
    raise AssertionError("no layout candidates")


def _with_reuse_if_free(shape: ModelShape, plain: Plan, room: int, checkpointing: bool, step: dict) -> Plan:
    """The offloaded ``plain`` plan with attention reuse, when that plan fits with as many micro-batch tokens and an
    MLP tile no finer (it costs only host memory and one more activation on the GPU); else ``plain``."""
    try:
        reuse = make_plan(shape, gpu_free_bytes=room, offload=True, checkpointing=checkpointing,
                          **{**step, "reuse_attention": True})
    except PlanError:
        return plain
    coarse = lambda p: p.mlp_tile_tokens or p.micro_batch_tokens  # noqa: E731  (untiled: the whole micro-batch)
    better = reuse.micro_batch_tokens >= plain.micro_batch_tokens and coarse(reuse) >= coarse(plain)
    return reuse if better else plain
