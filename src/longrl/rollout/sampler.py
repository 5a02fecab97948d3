"""longrl's batched sampler: G completions per prompt on the training model's own weights.

No second copy of any weight: the model runs as it is (LoRA adapters applied unmerged, any base dtype),
with its attention switched to :mod:`longrl.rollout.attention` for the duration of a call. Each prompt is
prefilled once; its keys/values live in a prefix store shared by its G completions. Every completion owns a
decode slot; slots are filled from a queue (continuous batching): when a sequence finishes, its slot takes the
next waiting one (prefilling its prompt if needed). When nothing waits and the active sequences fit a smaller
batch bucket, they are compacted into it, so the long tail runs at the batch size it needs.

A decode step is one forward of the active bucket (replayed as a CUDA graph on CUDA), then sampling and state
updates on the device; the host reads the state only every ``sync_every`` steps (to retire finished sequences,
check stop strings and admit waiting ones). The KV cache is allocated per call from a memory budget and freed
when the call returns, so the training phase gets the memory back.

Terms: G, the completions of each prompt (``num_generations``); a slot, the decode-batch row of one sequence and
its own key/value store (its state: rollout/slot_state.py); a prefix entry, one prompt's keys/values in the
prefix store; a bucket, a decode batch size (slots 0 … bucket−1 run together); a turn, the tokens sampled between
two environment steps of a multi-turn episode (single-turn: the whole completion).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..memory.planner import (DRAFT_HISTORY_PROMPTS, DRAFT_HISTORY_TOKENS, EXTEND_WORKSPACE_BYTES, ModelShape,
                              max_rollout_slots, prefill_forward_tokens, prefix_entries, rollout_kv_bytes,
                              sampler_workspace_bytes, speculative_workspace_bytes)
from ..models.loading import base_model, model_parts
from ..models.policy import pad_right
from ..models.vision import (FeatureCache, Placement, VisionPrompt, image_block_mask, language_model_inputs,
                             require_vision, vision_family)
from ..models.vision.masks import column_ids
from ..ops.logprobs import head_logits
from .attention import (SAMPLER_ATTENTION, DecodeMeta, ExtendMeta, KVCache, PrefillMeta, register_sampler_attention,
                        unsupported_reason)
from .device_drafts import DeviceDrafts
from .draft_book import DraftBook, ProposerFactory, SpeculativeCounts, stop_table
from .drafts import DraftHistory
from .fast_decode import FP8_KERNEL, NF4_KERNEL, FastDecoder
from .kv_quant import FP8
from .lora_fusion import fused_lora
from .sampling import SamplingParams, draws_fused, next_tokens, stop_index, triton_available
from .slot_state import SlotBook, SlotTensors
from .spec_schedule import SpeculationSchedule
from .verify_steps import VerifySteps

log = logging.getLogger(__name__)

MAX_CARRIED_SCHEDULES = 16  # measured speculation schedules a sampler keeps between calls (one per call size)


class SamplerUnsupported(RuntimeError):
    """The sampler cannot run this model exactly; the message says why (use the ``hf`` backend)."""


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # [P·G] prompt of each completion (repeated G times, contiguous per prompt)
    completion_ids: list[list[int]]  # [P·G] sampled tokens, ending with the stop token unless truncated
    truncated: list[bool]  # [P·G] True when no stop token / stop string came within max_new_tokens
    logprobs: list[list[float]] | None = None  # [P·G][len] sampler's log softmax(z / T) of each sampled token
    env_mask: list[list[int]] | None = None  # [P·G][len] multi-turn: 1 for sampled tokens, 0 for environment tokens
    #                                          (their log-probs are 0)
    completion_images: list[list[tuple[int, VisionPrompt]]] | None = None  # [P·G] multi-turn with images from the
    #   environment: each block's (index in the sequence, prompt + completion, where its tokens start; its block)


@dataclass
class MultiTurn:
    """Multi-turn rollouts. At the end of each turn (a stop token, a stop string or max_new_tokens), the sequence
    parks in its slot (its KV cache kept, out of the decode batch's updates) while ``handler.step(seq, turn_tokens,
    room)`` runs in a pool of ``workers`` threads (room: tokens left of the trajectory budget ``max_tokens``, the
    tokens after the prompt); it returns the tokens to append (a list, or an :class:`EnvTokens` with their images),
    prefilled onto the slot's own cache before the next turn is sampled, or None to end the episode. Tokens that
    leave no room for one more sampled token end it too."""
    handler: object
    max_tokens: int
    workers: int = 8


@dataclass
class EnvTokens:
    """What a multi-turn handler may return instead of a token list: the tokens to append and, when the
    environment's messages hold images, their :class:`VisionPrompt` block (its input_ids the same tokens, its
    image inputs the images): the resume prefill places the block's image features at its placeholders."""
    ids: list[int]
    images: VisionPrompt | None = None


def _model_dims(model) -> tuple[int, int, int]:
    cfg = base_model(model).config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


# the decode batch floor with CUDA graphs (Sampler min_decode_batch None): on an H100, SmolLM2-135M's shape with
# LoRA, calls of 8 / 32 / 128 sequences ran 1.20 / 1.16 / 1.20 × the tokens/s of floor 1, capturing 1 / 2 / 4
# batch sizes' graphs instead of 3 / 4 / 7 (benchmarks/results/call_overhead_smollm2-135m_h100_calls3.md)
GRAPHED_MIN_DECODE_BATCH = 16


def batch_buckets(max_batch: int, smallest: int = 1) -> list[int]:
    """Decode batch sizes a step may run at: powers of two from ``smallest`` below ``max_batch``, and
    ``max_batch``."""
    sizes = [1 << i for i in range(max(1, max_batch).bit_length()) if smallest <= (1 << i) < max_batch]
    return sizes + [max_batch]


class Sampler:
    """``Sampler(model, tokenizer).generate(prompt_ids, G, SamplingParams(...))`` → :class:`Rollout`.

    kv_cache_bytes: the KV budget (None: what the job needs, capped on CUDA by 90% of the free memory).
    cuda_graphs: replay decode steps as CUDA graphs (CUDA only). sync_every: decode steps between host checks.
    prefill_tokens: prompt tokens per prefill forward. fuse_lora: add LoRA deltas by fused products for the call
    (rollout/lora_fusion.py) instead of PEFT's per-layer forward. fast_decode: run decode steps of Llama-family
    models, and of vision-language models' language models built like them, through rollout/fast_decode.py (fused
    elementwise kernels) instead of transformers' forward.
    pack_projections: with fast_decode, each layer's q/k/v and gate/up base weights (and their LoRA A rows) read by
    one product a group during the rollout (FastDecoder.prepare_packing). memory_cap_bytes: the run's GPU budget
    (train.gpu_memory_gib): the KV cache takes at most what it leaves. kv_cache_dtype: "bf16" keeps keys/values
    in the compute dtype, "fp8" in e4m3 with a scale per position and key head (rollout/kv_quant.py).
    speculative: "off"; "ngram", speculative decoding with drafts of up to ``max_draft_tokens`` tokens from the
    prompt, the group's completions and the prompt's earlier completions, drafted on the device
    (rollout/device_drafts.py; the history persists across calls) so that speculative steps queue ``sync_every`` at
    a time like plain ones; or a factory (prompt ids, G) → a group's proposer on the host
    (rollout/draft_book.py :class:`GroupDrafts`), asked before every step. speculative_fallback: with "ngram",
    chunks of plain steps while speculation does not pay (rollout/spec_schedule.py); False: every chunk speculates.
    speculative_schedule: how the fallback prices a verify step: "measured" (the call's own step times, read through
    ``Sampler.clock``) or "bytes" (a byte model: the same choices, and tokens, on every run with a seed).
    min_decode_batch: the fewest rows a decode step runs (slots compact into batch buckets of powers of two from
    it, each bucket its own CUDA graphs): a call captures its graphs anew, at a cost of host time that a call of few
    steps does not win back, while a step of few rows reads the same weights whatever its row count (a free row in
    the batch reads one position of its store). None: GRAPHED_MIN_DECODE_BATCH with CUDA graphs, else 1 (without
    graphs a smaller batch is only cheaper).
    speculative_graphs: with "ngram" and CUDA graphs, a whole queued verify step (drafts, forward, acceptance, kept
    tokens) replays as one CUDA graph (rollout/verify_steps.py _queued_graph), a graph per (batch bucket, k, source
    width); the default (on an H100 an 8B verify step of k = 2 took 9.4 against 11.9 ms at 8 rows of 16K tokens;
    tests/test_sampler_gpu.py checks it against plain greedy). Off: the verify forward alone is a graph and the
    rest launches eagerly.
    step_graphs: with CUDA graphs and plain temperature sampling (the fused sampling kernel), a whole plain decode
    step (forward, the draw, the slots' bookkeeping: ~25 launches after the forward) replays as one CUDA graph a
    batch bucket (_Run._graphed_step), so that a small model's step does not wait on the host's launches; off (the
    default: on an H100 it gained 1-5% a call on SmolLM2-135M's shape, halving the captures' host time, and the 8B
    shape's steps took the same time either way): the forward alone is a graph.
    nf4_kernel / fp8_kernel: with fast_decode and Triton, decode products over an NF4 / FP8 base read the quantized
    weights directly (ops/nf4_matmul.py, ops/fp8_matmul.py; FastDecoder.prepare_quantized); off, or where a
    shape is not the kernel's, the layer's own forward (bitsandbytes' call; the FP8 layer's dequantize-then-multiply).
    nf4_halves: with the NF4 kernel, the NF4 weights' codes re-paired in place into the halves layout for the call
    (ops/nf4_halves.py: the decode product keeps its looked-up tile in registers; back in bitsandbytes' order around
    every forward through the modules, prefill and extend steps, and at the call's end, whatever happens). Off by
    default: its decode steps measured faster (+15% at 8 rows on an H100), its calls not yet (the layout change then
    ran through PyTorch slices; its one-launch kernel awaits its GPU test).
    fast_verify: run speculative verify steps as decode steps over virtual rows (_Run._verify_forward: the fast
    decode path or transformers' forward with DecodeMeta, the decode attention kernel, CUDA graphs per batch bucket
    and draft count); True: where Triton runs, and with the PyTorch twins (tests); False: the extend forward
    (transformers' forward with ExtendMeta, the twin); None (the default): True where the sampler runs Triton
    kernels on CUDA, else False (on the CPU the extend forward is the cheaper).
    """

    def __init__(self, model, tokenizer=None, *, kv_cache_bytes: int | None = None, cuda_graphs: bool = True,
                 sync_every: int = 16, prefill_tokens: int = 16384, fuse_lora: bool = True, fast_decode: bool = True,
                 nf4_kernel: bool = True, pack_projections: bool = True, memory_cap_bytes: int | None = None,
                 kv_cache_dtype: str = "bf16", speculative: str | ProposerFactory = "off", max_draft_tokens: int = 4,
                 fp8_kernel: bool = True, fast_verify: bool | None = None, speculative_fallback: bool = True,
                 speculative_graphs: bool = True, speculative_schedule: str = "measured",
                 min_decode_batch: int | None = None, step_graphs: bool = False, nf4_halves: bool = False):
        if kv_cache_dtype not in ("bf16", "fp8"):
            raise ValueError(f"kv_cache_dtype must be bf16 or fp8; got {kv_cache_dtype!r}")
        if not (callable(speculative) or speculative in ("off", "ngram")):
            raise ValueError(f"speculative must be off, ngram or a proposer factory; got {speculative!r}")
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1; got {max_draft_tokens}")
        if speculative_schedule not in ("measured", "bytes"):
            raise ValueError(f"speculative_schedule must be measured or bytes; got {speculative_schedule!r}")
        if min_decode_batch is not None and min_decode_batch < 1:
            raise ValueError(f"min_decode_batch must be >= 1 or None; got {min_decode_batch}")
        self.model, self.tokenizer, self.fuse_lora, self.nf4_kernel = model, tokenizer, fuse_lora, nf4_kernel
        self.fp8_kernel, self.nf4_halves = fp8_kernel, nf4_halves
        self.halved = None  # the FastDecoder whose NF4 codes are in the halves layout during a call
        self.memory_cap_bytes, self.kv_fp8 = memory_cap_bytes, kv_cache_dtype == "fp8"
        self.pack_projections = pack_projections
        self.kv_cache_bytes, self.sync_every, self.prefill_tokens = kv_cache_bytes, sync_every, prefill_tokens
        self.backbone, self.head, self.logit_spec = model_parts(model)
        self.device = self.head.weight.device
        self.use_triton = self.device.type == "cuda" and triton_available()
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and _graph_safe(model, self.use_triton)
        self.min_decode_batch = min_decode_batch or (GRAPHED_MIN_DECODE_BATCH if self.cuda_graphs else 1)
        self.fast_verify = self.use_triton if fast_verify is None else bool(fast_verify)
        self.layers, self.kv_heads, self.head_dim = _model_dims(model)
        self.family = vision_family(base_model(model).config)  # None: a text-only model
        # (a vision-language model's fast decode steps run its language model: rollout/fast_decode.py language_model)
        self.fast = FastDecoder.build(base_model(model)) if fast_decode else None
        self.fast_proven = False  # set once a fast decode step ran (_Run._fast_forward)
        self.last_stats: dict = {}
        self.new_draft_group: ProposerFactory | None = speculative if callable(speculative) else None
        self.device_drafting = speculative == "ngram"  # drafts on the device (queued speculative steps)
        self.max_draft_tokens, self.speculative_fallback = max_draft_tokens, speculative_fallback
        self.speculative_schedule = speculative_schedule
        self._schedules: dict[int, SpeculationSchedule] = {}  # number of sequences → the measured schedule it left
        self.speculative_graphs = speculative_graphs and self.cuda_graphs
        self.step_graphs = step_graphs and self.cuda_graphs
        self.draft_history = DraftHistory(DRAFT_HISTORY_TOKENS, DRAFT_HISTORY_PROMPTS) if self.device_drafting else None

    clock = staticmethod(time.perf_counter)  # seconds, for the measured speculation schedule and the spec_* timings

    def schedule_for(self, num_sequences: int) -> SpeculationSchedule:
        """A call's speculation schedule: with the measured price, the one the last call of as many sequences left
        (its back-off carried over: rollout/spec_schedule.py), at most MAX_CARRIED_SCHEDULES kept, the least recent
        dropped; with the byte model, without the fallback or without speculation, a fresh one (a seed's tokens then
        do not depend on earlier calls)."""
        measured = self.speculative_schedule == "measured"
        if not (self.speculative and measured and self.speculative_fallback):
            return SpeculationSchedule(enabled=self.speculative_fallback, measured=measured)
        schedule = self._schedules.pop(num_sequences, None) or SpeculationSchedule()
        self._schedules[num_sequences] = schedule  # the most recent last
        while len(self._schedules) > MAX_CARRIED_SCHEDULES:
            self._schedules.pop(next(iter(self._schedules)))
        return schedule.next_call()

    def forget_history(self) -> None:
        """Forget what earlier calls left for speculation: the prompts' earlier completions the drafts come from and
        the measured schedules' back-off (the next call speculates as a sampler's first does)."""
        if self.draft_history is not None:
            self.draft_history = DraftHistory(DRAFT_HISTORY_TOKENS, DRAFT_HISTORY_PROMPTS)
        self._schedules.clear()

    @property
    def speculative(self) -> bool:
        """Whether decode steps verify drafted tokens (speculative rollouts)."""
        return self.new_draft_group is not None or self.device_drafting

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads (the language model and its head; tied weights once)."""
        sizes = {p.data_ptr(): p.numel() * p.element_size()
                 for part in (self.backbone, self.head) for p in part.parameters()}
        return sum(sizes.values())

    # ------------------------------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 multi_turn: MultiTurn | None = None, vision: list[VisionPrompt | None] | None = None) -> Rollout:
        """``num_generations`` completions of each prompt (contiguous per prompt); with ``multi_turn``, episodes
        whose turns alternate with an environment's tokens. ``vision``: per prompt its
        :class:`~longrl.models.vision.VisionPrompt` (whose input_ids are the prompt's) or None: its image features
        are computed once, placed in the prompt's prefill, and its G completions share the prompt's keys/values."""
        self._check_request(prompt_ids, num_generations, params, multi_turn, vision)
        start = time.perf_counter()
        with self.prepared() as (fused, quant, packed):
            run = _Run(self, prompt_ids, num_generations, params, multi_turn, vision)  # after the preparations: the
            ready = time.perf_counter()  # KV cache is sized from what they leave free
            rollout = run.execute()
            halves = len(self.fast.halves) if self.fast is not None else 0
            done = time.perf_counter()
        end = time.perf_counter()
        # host seconds around the decoding: the model set up for the call and the call's buffers (prepare_s), and
        # undone (release_s); a call of few steps pays them as it pays its graph captures
        self.last_stats = {**run.stats, "seconds": end - start, "prepare_s": ready - start, "release_s": end - done,
                           "lora_fused": fused,
                           "vision_tower_calls": run.features.tower_calls if run.features is not None else 0,
                           "fast_decode": self.fast is not None,
                           # 0 after a fallback (and without Triton: the modules' own forward)
                           "nf4_projections": quant.get("nf4", 0) if self.fast is not None else 0,
                           "fp8_projections": quant.get("fp8", 0) if self.fast is not None else 0,
                           "packed_groups": packed if self.fast is not None else 0,
                           "nf4_halves_groups": halves,  # NF4 groups read in the halves layout
                           "tokens": sum(len(c) for c in rollout.completion_ids)}
        log.debug("rollout: %(tokens)d tokens in %(seconds).2f s; %(slots)d slots, %(prefills)d prefills, "
                  "%(compactions)d compactions, %(decode_steps)d decode steps", self.last_stats)
        return rollout

    @contextlib.contextmanager
    def prepared(self):
        """The model set up for a sampler call: eval mode, the sampler's attention, LoRA fused, NF4/FP8 projections
        (with nf4_halves, their codes in the halves layout) and packed weights as configured; all undone on exit, in
        reverse order, whatever happens. Yields (LoRA fused, {kernel: quantized projections}, packed groups)."""
        register_sampler_attention()
        base = base_model(self.model)
        # a vision-language model switches its language model only (its vision tower keeps its own attention)
        attends = self.backbone if self.family is not None else base
        with contextlib.ExitStack() as restore:  # undone in reverse order, whatever happens
            restore.callback(self.model.train, self.model.training)
            restore.callback(attends.set_attn_implementation, attends.config._attn_implementation)
            self.model.eval()
            attends.set_attn_implementation(SAMPLER_ATTENTION)
            fused = restore.enter_context(fused_lora(self.model, self.compute_dtype) if self.fuse_lora
                                          else contextlib.nullcontext(False))
            kernels = tuple(k for k, on in ((NF4_KERNEL, self.nf4_kernel), (FP8_KERNEL, self.fp8_kernel)) if on)
            restore.callback(self._release_quantized)
            quant = {}
            if kernels and self.fast is not None and self.use_triton:
                quant = self.fast.prepare_quantized(self.pack_projections, kernels, halves=self.nf4_halves)
                self.halved = self.fast  # its NF4 codes back in bitsandbytes' order at the end, even after a
                restore.callback(self._undo_halves)  # fallback dropped the decoder
            # the packer is kept: a failing first fast step drops self.fast, and the weights must leave the packed
            # buffers whatever happens
            packer = self.fast if self.pack_projections else None
            if packer is not None:
                restore.callback(packer.release_packing)
            packed = packer.prepare_packing() if packer is not None else 0
            yield fused, quant, packed

    def _check_request(self, prompt_ids, num_generations: int, params: SamplingParams,
                       multi_turn: MultiTurn | None, vision=None) -> None:
        """Raise on an empty prompt, a token outside the vocabulary, lengths the sampler cannot run, or images the
        model cannot take (a text-only model, a VisionPrompt of other tokens than its prompt's)."""
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1; got {num_generations}")
        if vision is not None:
            if len(vision) != len(prompt_ids):
                raise ValueError(f"vision has {len(vision)} entries for {len(prompt_ids)} prompts (one VisionPrompt "
                                 "or None each)")
            if any(v is not None for v in vision):
                require_vision(base_model(self.model).config)
            for row, (p, v) in enumerate(zip(prompt_ids, vision)):
                if v is not None and list(p) != v.input_ids:
                    raise ValueError(f"prompt {row}'s token ids are not its VisionPrompt's input_ids (the prompt's "
                                     "tokens with the image placeholders expanded)")
        vocab = self.head.weight.shape[0]
        for row, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {row} is empty: every prompt needs at least one token")
            bad = next((t for t in p if not 0 <= int(t) < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt {row} has token id {bad}, outside the model's vocabulary [0, {vocab})")
        max_prompt = max(len(p) for p in prompt_ids)
        after_prompt = multi_turn.max_tokens if multi_turn is not None else params.max_new_tokens
        reason = unsupported_reason(base_model(self.model).config, max_prompt + after_prompt)
        if reason:
            raise SamplerUnsupported(f"longrl's sampler does not support {reason}; use generation.backend=hf")

    def _release_quantized(self) -> None:
        if self.fast is not None:  # (None after a fallback: the dropped decoder's routing went with it)
            self.fast.release_quantized()

    def _undo_halves(self) -> None:
        """The NF4 codes of the decoder that took the halves layout back in bitsandbytes' order (idempotent)."""
        if self.halved is not None:
            self.halved.set_halves(False)
            self.halved = None

    def module_order(self):
        """The context of a forward through the model's modules during a call (prefill, extend steps, the decode
        fallback): NF4 codes in bitsandbytes' order inside it (FastDecoder.module_order)."""
        return self.halved.module_order() if self.halved is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------ model calls
    @property
    def compute_dtype(self) -> torch.dtype:
        """The base's 16-bit dtype (the head's; a 4-bit base keeps its head in it), else float32."""
        dtype = self.head.weight.dtype
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32

    def compute_context(self):
        """Autocast to the base's 16-bit dtype (without the weight-cast cache, which CUDA graphs cannot hold)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype, cache_enabled=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, V] from final hidden states [N, d]: softcap(multiplier · head(h)), as in training."""
        spec = self.logit_spec
        return head_logits(hidden, self.head.weight, self.head.bias, spec.multiplier, spec.softcap, 1.0)[0]

    @property
    def cache_dtype(self) -> torch.dtype:
        if self.kv_fp8:
            return FP8
        w = self.head.weight.dtype
        return w if w in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _graph_safe(model, use_triton: bool) -> bool:
    """Whether a decode step may be captured as a CUDA graph: not when the PyTorch attention twin runs (its
    prefix-table lookups synchronise with the host), nor with dynamic or LongRoPE scaling (transformers compares
    positions with a threshold on the host and swaps the frequency buffer a captured graph would keep reading).

    A vision-language model's rotary is its language model's: a Qwen2/2.5-VL checkpoint's "mrope" type is "default"
    in transformers' config (mrope_section beside it), Qwen3-VL's too, so they are captured as text models are. The
    step reads only device state: the fast path's rotary gets the positions (rope delta already added, outside the
    graph) as three equal rows, a view; transformers' forward expands 1-D positions the same way, and its mask
    builder returns before the packed-sequence check (which reads a tensor) for the sampler's attention. The image
    features and deepstack enter in the eager prefill only. tests/test_vision_sampler_gpu.py replays it."""
    rotary = getattr(base_model(model).get_decoder(), "rotary_emb", None)  # (a vision-language model's: its LM's)
    rope = str(getattr(rotary, "rope_type", ""))  # a dict of them for per-layer-type models
    return use_triton and "dynamic" not in rope and "longrope" not in rope


class _Run(VerifySteps):
    """The state of one ``generate`` call (KV cache, slots, queue); dropped when the call returns. Its speculative
    steps are rollout/verify_steps.py's."""

    def __init__(self, sampler: Sampler, prompt_ids, num_generations: int, params: SamplingParams,
                 multi: MultiTurn | None = None, vision=None):
        self.sampler, self.params, self.G, self.multi = sampler, params, num_generations, multi
        self.prompts = [list(p) for p in prompt_ids]
        self.vision = list(vision) if vision is not None else [None] * len(self.prompts)
        # each prompt's image features, computed at its prefill (once: a prompt is prefilled once per call)
        self.features = FeatureCache(sampler.model, sampler.family) if any(
            v is not None for v in self.vision) else None
        self.num_sequences = len(prompt_ids) * num_generations
        self.max_tokens = multi.max_tokens if multi is not None else params.max_new_tokens  # tokens after a prompt
        self.max_prompt_len = max(len(p) for p in prompt_ids)
        device = sampler.device
        self.num_slots, self.num_entries = self._capacity()
        self.cache = KVCache.allocate(layers=sampler.layers, kv_heads=sampler.kv_heads, head_dim=sampler.head_dim,
                                      prefix_slots=self.num_entries, prefix_len=self.max_prompt_len,
                                      slots=self.num_slots, suffix_len=self.max_tokens, dtype=sampler.cache_dtype,
                                      device=device, compute_dtype=sampler.compute_dtype)
        vocab = sampler.head.weight.shape[0]
        self.state = SlotTensors.allocate(self.num_slots, self.max_tokens, vocab,
                                          track_seen=params.repetition_penalty != 1.0, device=device,
                                          draft_k_max=sampler.max_draft_tokens if sampler.device_drafting else 0)
        self.host = SlotBook.free(self.num_slots)
        self.is_stop = stop_table(params.stop_token_ids, vocab, device)  # [V] bool
        self.step_logits = torch.zeros(self.num_slots, vocab, dtype=torch.float32, device=device)  # [slots, V]
        # prefix-store entries: each prompt's last logits, and the slots reading each entry (the grouped kernel's table)
        self.prompt_logits = torch.zeros(self.num_entries, vocab, dtype=torch.float32, device=device)
        self.members = torch.full((self.num_entries, self.G), -1, dtype=torch.long, device=device)
        self.entry_len = torch.zeros(self.num_entries, dtype=torch.long, device=device)
        # each entry's prompt's mRoPE rope delta (0: 1-D positions): token i after the prompt sits at i + delta
        self.entry_delta = torch.zeros(self.num_entries, dtype=torch.long, device=device)
        self.slots_changed = False  # members / entry_len are rebuilt before the next decode step when set
        self.buckets = batch_buckets(self.num_slots, sampler.min_decode_batch)
        # batch bucket → its captured decode forward; ("step", bucket) → a whole plain decode step (_graphed_step);
        # ("verify", bucket, k) → its verify forward (_verify_forward); ("queued", bucket, k, width) → a whole queued
        # verify step (verify_steps._queued_graph)
        self.graphs: dict = {}
        self.graphs_seen: set = set()  # whole steps' keys run once eagerly (the next step is captured)
        self.verify_drafts: dict[int, torch.Tensor] = {}  # k → [slots, k] long: a fast verify step's drafts (input)
        self.verify_logits: torch.Tensor | None = None  # [rows, V] float32: a fast verify step's logits (output)
        self.graph_pool = torch.cuda.graph_pool_handle() if sampler.cuda_graphs else None
        # host bookkeeping beyond the slots
        self.waiting = deque(range(self.num_sequences))
        self.pending: dict = {}  # multi-turn: sequence → (future of its environment step, tokens so far, stopped)
        self.env_spans: dict[int, list[tuple[int, int]]] = {}  # sequence → [start, end) of its environment tokens
        self.env_images: dict[int, list[tuple[int, VisionPrompt]]] = {}  # sequence → (index in it, image block)
        self.rope_shift: dict[int, int] = {}  # sequence → its blocks' mRoPE rope deltas summed (tokens after them)
        self.pool = ThreadPoolExecutor(multi.workers, thread_name_prefix="longrl-env") if multi is not None else None
        self.entry_of: dict[int, int] = {}  # prompt → its prefix-store entry
        self.unfinished = [self.G] * len(self.prompts)  # completions of each prompt not yet finished
        self.free_entries = list(range(self.num_entries))
        self.results: list[tuple[list[int], list[float], bool] | None] = [None] * self.num_sequences
        self.drafts = (DraftBook(sampler.new_draft_group, self.prompts, num_generations)
                       if sampler.new_draft_group is not None else None)  # host proposers and their counts
        # device drafts: each entry's sources, the chunks' schedule, the call's counts, the next chunk's draft count
        self.device_drafts = DeviceDrafts(self.num_entries, self.max_prompt_len, DRAFT_HISTORY_TOKENS,
                                          device) if sampler.device_drafting else None
        self.schedule = sampler.schedule_for(self.num_sequences)
        self.spec_counts = SpeculativeCounts()
        self.spec_k, self.spec_accepted = sampler.max_draft_tokens, 0.0
        self.weight_bytes: int | None = None  # the sampler's, read at the first speculating chunk's end
        self.stats = {"slots": self.num_slots, "prefix_slots": self.num_entries, "decode_steps": 0, "prefills": 0,
                      "compactions": 0, "kv_cache_bytes": self.cache.nbytes_held()}
        if multi is not None:
            self.stats.update(turns=0, resumes=0, resume_tokens=0, resume_forwards=0, resume_s=0.0, env_wait_s=0.0)

    # ------------------------------------------------------------------------------------------ sizing
    def _capacity(self) -> tuple[int, int]:
        """(decode slots, prefix-store entries): every sequence at once when the KV budget allows, else the most
        that fit (memory/planner.py's rollout arithmetic, shared with ``longrl plan``)."""
        sampler = self.sampler
        kv_token = KVCache.nbytes(layers=sampler.layers, kv_heads=sampler.kv_heads, head_dim=sampler.head_dim,
                                  tokens=1, dtype=sampler.cache_dtype)
        budget = sampler.kv_cache_bytes
        if budget is None and sampler.device.type == "cuda":
            free = torch.cuda.mem_get_info(sampler.device)[0]
            free += torch.cuda.memory_reserved(sampler.device) - torch.cuda.memory_allocated(sampler.device)
            if sampler.memory_cap_bytes is not None:  # the allocator is capped there: what the budget leaves
                free = min(free, sampler.memory_cap_bytes - torch.cuda.memory_allocated(sampler.device))
            budget = int(0.9 * free) - self._workspace_bytes()
        prompts = len(self.prompts)
        value_pad = (sampler.layers * sampler.kv_heads * sampler.head_dim if sampler.cache_dtype == FP8
                     else 0)  # a value code a position
        shape = dict(prompts=prompts, G=self.G, prompt_len=self.max_prompt_len, completion_len=self.max_tokens,
                     kv_token=kv_token, value_pad_token=value_pad)
        slots = self.num_sequences if budget is None else max_rollout_slots(budget, sequences=self.num_sequences,
                                                                            **shape)
        if slots < 1:
            need = rollout_kv_bytes(1, **shape)
            raise MemoryError(f"KV cache budget {(budget or 0) / 2**30:.2f} GiB cannot hold one sequence of "
                              f"{self.max_prompt_len} + {self.max_tokens} tokens (needs {need / 2**30:.2f} GiB)")
        return slots, prefix_entries(slots, prompts, self.G)

    def _workspace_bytes(self) -> int:
        sampler = self.sampler
        shape = ModelShape.from_config(base_model(sampler.model).config)
        itemsize = torch.empty((), dtype=sampler.compute_dtype).element_size()
        prefill = prefill_forward_tokens(sampler.prefill_tokens, len(self.prompts), self.max_prompt_len)
        plain = sampler_workspace_bytes(shape.hidden, shape.intermediate, shape.vocab, self.num_sequences, prefill,
                                        itemsize)
        if not sampler.speculative:
            return plain
        return plain + speculative_workspace_bytes(shape.vocab, self.num_sequences, sampler.max_draft_tokens,
                                                   len(self.prompts), self.max_prompt_len, self.max_tokens,
                                                   DRAFT_HISTORY_TOKENS)

    def _bucket(self, slots: int) -> int:
        """The smallest decode batch size that covers slots 0 … ``slots``−1."""
        return next(b for b in self.buckets if b >= slots)

    def _decoding(self) -> list[int]:
        """The occupied slots whose sequence is not parked waiting for its environment."""
        return [i for i in self.host.occupied() if self.host.sequence[i] not in self.pending]

    # ------------------------------------------------------------------------------------------ main loop
    def execute(self) -> Rollout:
        try:
            self._admit()
            while self.host.occupied():
                if self.pending:  # multi-turn: take back what the environments answered (wait if nothing decodes)
                    self._collect(block=not self._decoding())
                    if not self._decoding():
                        continue
                if self.slots_changed:
                    self._refresh_members()
                batch = self._bucket(self.host.occupied()[-1] + 1)
                if self.drafts is not None:  # one step, then the host's checks (the step read the slots' state)
                    steps = 1
                    self._speculative_step(batch)
                else:
                    remaining = max(self._turn_limit(i) - self.host.generated[i] for i in self._decoding())
                    if self.device_drafts is not None:
                        steps = self._device_chunk(batch, remaining)
                    else:
                        steps = max(1, min(self.sampler.sync_every, remaining))
                        for _ in range(steps):
                            self._decode_step(batch)
                self.stats["decode_steps"] += steps
                self._sync(batch)
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
        if self.drafts is not None:
            self.stats.update(self.drafts.counts.summary())
        if self.device_drafts is not None:
            self.stats.update(self.spec_counts.summary(), spec_fallbacks=self.schedule.fallbacks)
            if self.schedule.last_ratio is not None:
                self.stats["spec_cost_ratio"] = self.schedule.last_ratio  # r of the last speculating chunk
        return self._rollout()

    def _rollout(self) -> Rollout:
        prompt_ids = [self.prompts[seq // self.G] for seq in range(self.num_sequences)]
        done = [r for r in self.results if r is not None]
        assert len(done) == self.num_sequences, "every sequence finishes"
        env_mask = None
        if self.multi is not None:
            env_mask = [[1] * len(r[0]) for r in done]
            for seq, spans in self.env_spans.items():
                for a, b in spans:
                    env_mask[seq][a:b] = [0] * (b - a)
        images = ([self.env_images.get(seq, []) for seq in range(self.num_sequences)] if self.env_images else None)
        return Rollout(prompt_ids, [r[0] for r in done], [r[2] for r in done], [r[1] for r in done], env_mask,
                       images)

    # ------------------------------------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Waiting sequences into free slots, in order, while their prompts have (or get) a prefix-store entry."""
        free = self.host.free_slots()
        to_prefill, admitted = [], []
        while free and self.waiting:
            seq = self.waiting[0]
            prompt = seq // self.G
            if prompt not in self.entry_of:
                if not self.free_entries:
                    break
                self.entry_of[prompt] = self.free_entries.pop(0)
                to_prefill.append(prompt)
            self.waiting.popleft()
            slot = free.pop(0)
            self.host.sequence[slot] = seq
            admitted.append((slot, seq))
        if to_prefill:
            self._prefill(to_prefill)
        if admitted:
            self._start(admitted)

    def _refresh_members(self) -> None:
        """Rebuild the prefix entry → slots table the decode attention reads (after slots changed)."""
        members = torch.full(tuple(self.members.shape), -1, dtype=torch.long)
        lengths = torch.zeros(self.num_entries, dtype=torch.long)
        for slot in self.host.occupied():
            seq = self.host.sequence[slot]
            entry = self.entry_of[seq // self.G]
            members[entry, seq % self.G] = slot
            lengths[entry] = len(self.prompts[seq // self.G])
        self.members.copy_(members)
        self.entry_len.copy_(lengths)
        self.slots_changed = False

    def _prefill(self, prompts: list[int]) -> None:
        """Run the prompts (right-padded, in chunks of ≤ prefill_tokens) and keep each one's last logits."""
        sampler = self.sampler
        if self.device_drafts is not None:  # each entry's fixed draft sources: earlier completions, the prompt
            for q in prompts:
                self.device_drafts.open_entry(self.entry_of[q], self.prompts[q],
                                              sampler.draft_history.completions(self.prompts[q]))
        per_forward = max(1, sampler.prefill_tokens // self.max_prompt_len)
        with sampler.module_order():  # (once for all the chunks)
            for first in range(0, len(prompts), per_forward):
                self._prefill_chunk(prompts[first:first + per_forward])

    def _prefill_chunk(self, chunk: list[int]) -> None:
        """Prefill one chunk of prompts (a forward through the modules) and keep each one's last logits."""
        sampler, device = self.sampler, self.sampler.device
        width = max(len(self.prompts[q]) for q in chunk)
        ids = pad_right([self.prompts[q] for q in chunk], 0, width).to(device)  # [n, width]
        entries = torch.tensor([self.entry_of[q] for q in chunk], device=device)
        last = torch.tensor([len(self.prompts[q]) - 1 for q in chunk], device=device)
        positions = torch.arange(width, device=device)[None].expand(len(chunk), -1)
        self.entry_delta[entries] = torch.tensor([v.rope_delta if v is not None else 0
                                                  for v in (self.vision[q] for q in chunk)], device=device)
        meta = PrefillMeta(self.cache, entries)
        with sampler.compute_context():
            inputs = dict(input_ids=ids, position_ids=positions)
            if any(self.vision[q] is not None for q in chunk):  # image features in place, mRoPE positions
                placements = [Placement(row, 0, len(self.prompts[q]), self.vision[q])
                              for row, q in enumerate(chunk)]
                inputs = language_model_inputs(sampler.model, ids, positions, placements, self.features)
                if sampler.family.image_blocks:  # each image's tokens attend both ways (Gemma 3)
                    meta.mask = image_block_mask(placements, len(chunk), width, device)
            hidden = sampler.backbone(**inputs, use_cache=False, longrl_kv=meta).last_hidden_state
            self.prompt_logits[entries] = sampler.logits(hidden[torch.arange(len(chunk), device=device), last])
        self.stats["prefills"] += 1

    def _start(self, admitted: list[tuple[int, int]]) -> None:
        """Point each admitted (slot, sequence) at its prompt's prefix entry and sample its first token from the
        prompt's last logits."""
        state, device = self.state, self.sampler.device
        slots = torch.tensor([slot for slot, _ in admitted], device=device)
        prompts = [seq // self.G for _, seq in admitted]
        entries = torch.tensor([self.entry_of[p] for p in prompts], device=device)
        if state.seen is not None:
            state.seen[slots] = False
            for (slot, _), p in zip(admitted, prompts):
                state.seen[slot, torch.tensor(self.prompts[p], device=device)] = True
        state.sequence_id[slots] = torch.tensor([self.params.sequence_id(seq) for _, seq in admitted], device=device)
        state.prefix_entry[slots] = entries
        state.prompt_len[slots] = torch.tensor([len(self.prompts[p]) for p in prompts], device=device)
        if self.drafts is not None:
            for _, seq in admitted:
                self.drafts.open(seq)
        if state.draft_k is not None:
            state.draft_k[slots] = self.sampler.max_draft_tokens
        self._begin_turn([slot for slot, _ in admitted], [0] * len(admitted), self.prompt_logits[entries])
        self.slots_changed = True

    def _begin_turn(self, slots: list[int], first: list[int], logits: torch.Tensor) -> None:
        """Start a turn in each of ``slots`` (a sequence's first, or the next after its environment's tokens):
        sample its token at index ``first`` after the prompt from ``logits`` [n, V] (the logits of the position
        before it) and set the slot's state to decode on from there."""
        state, params, device = self.state, self.params, self.sampler.device
        rows = torch.tensor(slots, device=device)
        index = torch.tensor(first, device=device)
        seen = state.seen[rows] if state.seen is not None else None
        tok, lp = next_tokens(logits, params, state.sequence_id[rows], index, seen)
        state.tokens[rows, index], state.logprobs[rows, index] = tok, lp
        if state.seen is not None:
            state.seen[rows, tok] = True
        state.last_token[rows] = tok
        state.position[rows] = (state.prompt_len[rows] + index + self.entry_delta[state.prefix_entry[rows]]
                                + self._rope_shift(slots))
        state.write_index[rows], state.generated[rows] = index, index + 1
        state.turn_limit[rows] = torch.clamp(index + params.max_new_tokens, max=self.max_tokens)
        state.active[rows] = ~(self.is_stop[tok] | (state.generated[rows] >= state.turn_limit[rows]))
        for slot, at in zip(slots, first):
            self.host.turn_start[slot] = at
            self.host.generated[slot] = self.host.checked[slot] = at + 1

    def _turn_limit(self, slot: int) -> int:
        """The token count at which the slot's current turn ends (the host's view of the device's turn_limit)."""
        return min(self.max_tokens, self.host.turn_start[slot] + self.params.max_new_tokens)

    # ------------------------------------------------------------------------------------------ decoding
    def _forward(self, batch: int) -> None:
        sampler, state = self.sampler, self.state
        meta = DecodeMeta(self.cache, state.prefix_entry[:batch], state.prompt_len[:batch],
                          state.write_index[:batch], sampler.use_triton, self.members, self.entry_len)
        with sampler.compute_context():
            hidden = self._decode_hidden(state.last_token[:batch], state.position[:batch], meta)  # [batch, d]
            self.step_logits[:batch] = sampler.logits(hidden)

    def _decode_hidden(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMeta) -> torch.Tensor:
        """Final hidden states [N, d] of one token a row (ids, positions [N]) on the decode path: the fast decode
        step, or transformers' forward with ``meta``. Call inside compute_context."""
        sampler = self.sampler
        hidden = self._fast_forward(ids, positions, meta) if sampler.fast is not None else None
        if hidden is None:
            hidden = sampler.backbone(input_ids=ids[:, None], position_ids=positions[:, None], use_cache=False,
                                      longrl_kv=meta).last_hidden_state[:, 0]
        return hidden

    def _fast_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMeta) -> torch.Tensor | None:
        """The fast decode path's hidden states [N, d]. Its first call (eager: before any graph capture) may
        fail where its kernels cannot build; then the sampler warns and keeps transformers' forward (this step's
        keys/values are rewritten by it). Later failures raise."""
        sampler = self.sampler
        if sampler.fast_proven:
            return sampler.fast(ids, positions, meta)
        try:
            hidden = sampler.fast(ids, positions, meta)
        except Exception as e:  # noqa: BLE001 - any build failure of the fused kernels
            log.warning("the fast decode path failed (%s: %s); decoding with transformers' forward",
                        type(e).__name__, str(e)[:300])
            sampler._undo_halves()  # (the modules' forward reads bitsandbytes' order)
            sampler.fast = None
            return None
        sampler.fast_proven = True
        return hidden

    def _run_forward(self, batch: int) -> None:
        self._run_graph(batch, lambda: self._forward(batch))

    def _run_graph(self, key, forward) -> None:
        """Run ``forward`` (a step's device work on fixed shapes), as the CUDA graph captured for ``key`` when the
        sampler uses graphs (captured at its first call, after an eager warm-up)."""
        if not self.sampler.cuda_graphs:
            forward()
            return
        graph = self.graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            side = torch.cuda.Stream(self.sampler.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture (rewrites this step's own K/V, harmless)
                forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                forward()
            self.graphs[key] = graph
            self._count_capture(start)
        graph.replay()

    def _count_capture(self, start: float) -> None:
        """A graph captured (this call's graphs die with it): the call's count and the host seconds since
        ``start`` (its warm-up forward's launches and the capture), stats graph_captures / graph_capture_s."""
        self.stats["graph_captures"] = self.stats.get("graph_captures", 0) + 1
        self.stats["graph_capture_s"] = self.stats.get("graph_capture_s", 0.0) + time.perf_counter() - start

    def _decode_step(self, batch: int) -> None:
        """One token for each active slot of slots 0 … batch−1, on the device (inactive rows keep their state)."""
        if self.sampler.step_graphs and self._step_graphable(batch):
            self._graphed_step(batch)
            return
        self._run_forward(batch)
        self._draw(batch)

    def _step_graphable(self, batch: int) -> bool:
        """Whether a whole decode step can be one CUDA graph: its draw is the fused kernel's (no host reads; the
        PyTorch path's top-k/top-p searches are not checked for them) and that kernel has not failed here."""
        seen = self.state.seen[:batch] if self.state.seen is not None else None
        return draws_fused(self.step_logits[:batch], self.params, seen)

    def _graphed_step(self, batch: int) -> None:
        """A decode step replayed as one CUDA graph a batch bucket (_whole_step_graph: no forward-only graph is
        captured). The graph reads and writes only the call's persistent tensors (the slots' state, compacted in
        place, the cache, the logits buffer), so a replay is the step on the state it finds; the call's seed and
        temperature are baked in, as the call's graphs are its own."""
        def step() -> None:
            self._forward(batch)
            self._draw(batch)

        self._whole_step_graph(("step", batch), step, step)

    def _whole_step_graph(self, key, eager, captured) -> bool:
        """A whole step (its device work on fixed shapes) as the CUDA graph of ``key``: the first step runs
        ``eager`` (kernels built, buffers allocated), the second is ``captured`` and replayed, the later ones
        replayed. Returns whether this call captured the graph."""
        graph = self.graphs.get(key)
        new = graph is None
        if new:
            if key not in self.graphs_seen:
                self.graphs_seen.add(key)
                eager()
                return False
            start = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                captured()
            self.graphs[key] = graph
            self._count_capture(start)
        graph.replay()
        return new

    def _draw(self, batch: int) -> None:
        """The step's tokens from its logits, and the slots' bookkeeping: tokens, log-probs, counts, positions,
        the next input, and which rows stop (device work only)."""
        state = self.state
        rows = torch.arange(batch, device=self.sampler.device)
        act = state.active[:batch]
        seen = state.seen[:batch] if state.seen is not None else None
        tok, lp = next_tokens(self.step_logits[:batch], self.params, state.sequence_id[:batch],
                              state.generated[:batch], seen)
        idx = state.generated[:batch].clamp(max=self.max_tokens - 1)
        state.tokens[rows, idx] = torch.where(act, tok, state.tokens[rows, idx])
        state.logprobs[rows, idx] = torch.where(act, lp, state.logprobs[rows, idx])
        if seen is not None:
            state.seen[rows, tok] = seen[rows, tok] | act
        step = act.long()
        state.generated[:batch] += step
        state.write_index[:batch] += step
        state.position[:batch] += step
        state.last_token[:batch] = torch.where(act, tok, state.last_token[:batch])
        done = act & (self.is_stop[tok] | (state.generated[:batch] >= state.turn_limit[:batch]))
        state.active[:batch] = act & ~done

    # ------------------------------------------------------------------------------------------ host checks
    def _sync(self, batch: int) -> None:
        """Read the slots' state: end the sequences (or turns) that stopped, by a stop token, the length limit or
        a stop string; then admit waiting sequences, or compact the slots when nothing waits."""
        state, host, tokenizer = self.state, self.host, self.sampler.tokenizer
        active = state.active[:batch].tolist()
        generated = state.generated[:batch].tolist()
        decoding = [i for i in self._decoding() if i < batch]
        by_string = set()
        if self.params.stop_strings and tokenizer is not None and decoding:
            rows = state.tokens[:batch, :max(generated[i] for i in decoding)].tolist()
            for i in decoding:
                first = host.turn_start[i]  # only this turn's tokens (0: the whole single-turn completion)
                j = stop_index(rows[i][first:generated[i]], self.params.stop_strings, tokenizer.decode,
                               start=max(0, host.checked[i] - first - 1))
                host.checked[i] = generated[i]
                if j is not None:
                    generated[i], active[i] = first + j + 1, False
                    by_string.add(i)
        finished = [i for i in decoding if not active[i]]
        if finished:
            idx = torch.tensor(finished, device=self.sampler.device)
            state.active[idx] = False
            toks = state.tokens[idx].tolist()
            lps = state.logprobs[idx].tolist()
            for k, i in enumerate(finished):
                seq, n = host.sequence[i], generated[i]
                stopped = i in by_string or (n > 0 and toks[k][n - 1] in self.params.stop_token_ids)
                if self.multi is not None:
                    self._end_turn(i, toks[k][:n], stopped)
                    continue
                self.results[seq] = (toks[k][:n], lps[k][:n], not stopped)
                self._release(i)
        for i in decoding:
            if host.sequence[i] >= 0:
                host.generated[i] = generated[i]
        if self.waiting:
            self._admit()
        else:
            self._compact()

    def _release(self, slot: int) -> None:
        """Free the slot of a finished sequence (its result already kept)."""
        seq = self.host.sequence[slot]
        prompt = seq // self.G
        self.host.reset(slot)
        self.state.free(slot)
        self.slots_changed = True
        self.unfinished[prompt] -= 1
        if self.drafts is not None:
            self.drafts.close(seq, self.results[seq][0], group_done=self.unfinished[prompt] == 0)
        if self.device_drafts is not None:  # the group's later completions draft from this one
            self.device_drafts.add_finished(self.entry_of[prompt], self.state.tokens[slot, :len(self.results[seq][0])])
            if self.unfinished[prompt] == 0:  # the prompt's later calls draft from its group
                group = range(prompt * self.G, (prompt + 1) * self.G)
                self.sampler.draft_history.add(self.prompts[prompt], [self.results[q][0] for q in group])
        if self.unfinished[prompt] == 0:
            self.free_entries.append(self.entry_of.pop(prompt))

    def _compact(self) -> None:
        """Move the occupied slots to the front when they fit a smaller bucket (one copy of their state)."""
        occupied = self.host.occupied()
        if not occupied or self._bucket(len(occupied)) >= self._bucket(occupied[-1] + 1):
            return
        src = torch.tensor(occupied, device=self.sampler.device)
        self.cache.compact_slots(src)
        self.state.compact(src)
        self.host.compact(occupied)
        self.stats["compactions"] += 1
        self.slots_changed = True

    # ------------------------------------------------------------------------------------------ multi-turn
    def _end_turn(self, slot: int, tokens: list[int], stopped: bool) -> None:
        """A turn ended in ``slot`` (``tokens``: its whole trajectory so far): step its environment in the pool."""
        seq, n = self.host.sequence[slot], len(tokens)
        self.stats["turns"] += 1  # room 0 (the budget spent): the environment still sees the turn, nothing follows
        self.pending[seq] = (self.pool.submit(self.multi.handler.step, seq, tokens[self.host.turn_start[slot]:],
                                              self.max_tokens - n), n, stopped)

    def _finish_episode(self, slot: int, n: int, truncated: bool) -> None:
        toks = self.state.tokens[slot, :n].tolist()
        lps = self.state.logprobs[slot, :n].tolist()
        self.results[self.host.sequence[slot]] = (toks, lps, truncated)
        self._release(slot)

    def _collect(self, block: bool) -> None:
        """Take back the sequences whose environment step finished (``block``: wait for at least one): end their
        episodes or prefill their new tokens onto their own caches and sample their next turn's first token."""
        if block:
            start = time.perf_counter()
            wait([f for f, _, _ in self.pending.values()], return_when=FIRST_COMPLETED)
            self.stats["env_wait_s"] += time.perf_counter() - start
        returns = []
        for seq in [q for q, (f, _, _) in self.pending.items() if f.done()]:
            future, n, stopped = self.pending.pop(seq)
            slot = self.host.sequence.index(seq)
            block = None
            try:
                ids = future.result()
                if isinstance(ids, EnvTokens):
                    ids, block = ids.ids, ids.images
            except Exception as e:  # noqa: BLE001 - a failing handler ends its episode, not the rollout
                log.warning("multi-turn handler failed for sequence %d: %s: %s", seq, type(e).__name__, e)
                ids = None
            if ids is not None and n + len(ids) + 1 > self.max_tokens:  # no room for them and one more token
                log.warning("sequence %d: %d environment tokens do not fit its trajectory budget (%d of %d used); "
                            "episode ended", seq, len(ids), n, self.max_tokens)
                ids, stopped = None, False
            if ids is None:
                self._finish_episode(slot, n, truncated=not stopped)
            else:
                returns.append((slot, [int(t) for t in ids], n, block))
        if returns:
            start = time.perf_counter()
            self._resume(returns)
            self.stats["resume_s"] += time.perf_counter() - start
        if self.waiting:
            self._admit()

    def _resume(self, returns: list[tuple[int, list[int], int, VisionPrompt | None]]) -> None:
        """For each (slot, environment tokens, n: tokens so far, their image block or None) returning: prefill the
        slot's last sampled token + the environment tokens onto its own cache (ExtendMeta: slot-store indices
        n − 1 … n − 1 + len(ids)), the block's image features at its placeholders, then begin its next turn from
        the last logits."""
        sampler, state, device = self.sampler, self.state, self.sampler.device
        vocab = sampler.head.weight.shape[0]
        for slot, ids, n, block in returns:
            seq = self.host.sequence[slot]
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"environment tokens of sequence {seq} hold id {bad}, outside the model's vocabulary "
                                 f"[0, {vocab})")
            if block is not None:
                self._check_block(seq, ids, block)
        per_forward = self._extend_rows(1 + max(len(ids) for _, ids, _, _ in returns))
        for first in range(0, len(returns), per_forward):
            chunk = returns[first:first + per_forward]
            slots = torch.tensor([slot for slot, _, _, _ in chunk], device=device)
            start = torch.tensor([n - 1 for _, _, n, _ in chunk], device=device)  # slot-store index of the last token
            last_tok = state.tokens[slots, start]  # [b]
            width = 1 + max(len(ids) for _, ids, _, _ in chunk)
            new = pad_right([ids for _, ids, _, _ in chunk], 0, width - 1).to(device) if width > 1 else \
                torch.zeros(len(chunk), 0, dtype=torch.long, device=device)
            inputs = torch.cat([last_tok[:, None], new], dim=1)  # [b, width]
            lengths = torch.tensor([1 + len(ids) for _, ids, _, _ in chunk], device=device)
            # a block's tokens start at column 1 of its row (after the last sampled token)
            placements = [Placement(row, 1, len(ids), block) for row, (_, ids, _, block) in enumerate(chunk)
                          if block is not None]
            with sampler.compute_context():
                hidden = self._extend_forward(slots, inputs, start, lengths, placements)  # [b, width, d]
                logits = sampler.logits(hidden[torch.arange(len(chunk), device=device), lengths - 1])
            for slot, ids, n, block in chunk:
                seq = self.host.sequence[slot]
                if ids:
                    if state.seen is not None:
                        state.seen[slot, torch.tensor(ids, device=device)] = True
                    state.tokens[slot, n:n + len(ids)] = torch.tensor(ids, device=device)
                    state.logprobs[slot, n:n + len(ids)] = 0.0
                self.env_spans.setdefault(seq, []).append((n, n + len(ids)))
                if block is not None:
                    self.env_images.setdefault(seq, []).append((len(self.prompts[seq // self.G]) + n, block))
                    self.rope_shift[seq] = self.rope_shift.get(seq, 0) + block.rope_delta  # (0: 1-D positions)
            self._begin_turn([slot for slot, _, _, _ in chunk], [n + len(ids) for _, ids, n, _ in chunk], logits)
            self.stats["resumes"] += len(chunk)
            self.stats["resume_forwards"] += 1
            self.stats["resume_tokens"] += int(lengths.sum())

    def _rope_shift(self, slots: list[int]):
        """[n] long: the summed rope deltas of the image blocks of the sequences in ``slots`` (mRoPE), or 0 while no
        sequence of the call holds a block (no host list, copy or sync on the turn starts and verify steps)."""
        if not self.rope_shift:
            return 0
        return torch.tensor([self.rope_shift.get(self.host.sequence[slot], 0) for slot in slots],
                            device=self.sampler.device)

    def _check_block(self, seq: int, ids: list[int], block: VisionPrompt) -> None:
        """Refuse an image block the model cannot place: a text model's, or one whose tokens are not the tokens
        returned."""
        family = self.sampler.family
        why = "the model has no vision tower" if family is None else (
            None if block.input_ids == ids else "its VisionPrompt's input_ids are not the tokens returned")
        if why is not None:
            raise ValueError(f"environment tokens of sequence {seq} come with images: {why}")
        if self.features is None:  # a call whose prompts had no images
            self.features = FeatureCache(self.sampler.model, family)

    # ------------------------------------------------------------------------------------------ extend forwards
    def _extend_rows(self, width: int) -> int:
        """Rows one extend forward of ``width`` tokens a row may hold: within prefill_tokens tokens and the workspace
        cap (each row gathers its prefix and slot-store keys/values, and its scores over them, a layer at a time)."""
        sampler = self.sampler
        keys = self.cache.k_pre.shape[3] + self.max_tokens  # prefix + slot-store positions each new query reads
        heads = base_model(sampler.model).config.get_text_config().num_attention_heads
        row_bytes = 2 * sampler.kv_heads * keys * sampler.head_dim * 4 + heads * width * keys * 4  # K/V, scores
        return max(1, min(sampler.prefill_tokens // width, EXTEND_WORKSPACE_BYTES // row_bytes))

    def _extend_forward(self, slots: torch.Tensor, inputs: torch.Tensor, start: torch.Tensor,
                        lengths: torch.Tensor, placements: list[Placement] = ()) -> torch.Tensor:
        """Final hidden states [b, w, d] of inputs [b, w] (row r: its first lengths[r] tokens real, the rest padding)
        run onto slots [b]' own stores from slot-store index start [b]: their keys/values written there, each token
        attending causally over its prompt's prefix entry and its store (ExtendMeta). ``placements``: image blocks
        among the inputs, their features in place of the placeholders' embeddings (mRoPE: a block's tokens at the
        position after the token before it plus the block's own positions; Gemma 3: each image's tokens attending
        each other both ways). Call inside compute_context."""
        state, device = self.state, self.sampler.device
        prompt_len = state.prompt_len[slots]
        # mRoPE: the prompt's rope delta and the sequence's earlier blocks' (else 0)
        delta = self.entry_delta[state.prefix_entry[slots]] + (self._rope_shift(slots.tolist()) if self.rope_shift
                                                               else 0)
        positions = (prompt_len + start + delta)[:, None] + torch.arange(inputs.shape[1], device=device)[None]
        meta = ExtendMeta(self.cache, slots, state.prefix_entry[slots], prompt_len, start, lengths)
        if placements and self.sampler.family.image_blocks:  # each image's tokens attend both ways (Gemma 3)
            meta.blocks = column_ids(placements, inputs.shape[0], inputs.shape[1], device)[1]  # [b, w]
        if placements:
            mrope = None
            if self.sampler.family.mrope:  # [3, b, w]: a block's tokens at the position after the text before it
                mrope = positions[None].repeat(3, 1, 1)  # + its own mRoPE positions (relative to where they start)
                for p in placements:
                    mrope[:, p.row, p.start:p.start + p.length] = \
                        p.prompt.positions_after(positions[p.row, p.start - 1])
            built = language_model_inputs(self.sampler.model, inputs, positions, list(placements), self.features,
                                          positions=mrope)
        else:
            built = dict(input_ids=inputs, position_ids=positions)
        with self.sampler.module_order():
            return self.sampler.backbone(**built, use_cache=False, longrl_kv=meta).last_hidden_state
