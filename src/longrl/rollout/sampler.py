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
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..memory.planner import (ModelShape, max_rollout_slots, prefill_forward_tokens, prefix_entries,
                              rollout_kv_bytes, sampler_workspace_bytes)
from ..models.loading import base_model, model_parts
from ..ops.logprobs import head_logits
from ..models.policy import pad_right
from .attention import (SAMPLER_ATTENTION, DecodeMeta, ExtendMeta, KVCache, PrefillMeta, register_sampler_attention,
                        unsupported_reason)
from .fast_decode import FastDecoder
from .kv_quant import FP8
from .lora_fusion import fused_lora
from .sampling import SamplingParams, next_tokens, stop_index, triton_available

log = logging.getLogger(__name__)


EXTEND_WORKSPACE_BYTES = 1 << 30  # transient memory of one multi-turn extend forward (a layer's gathered K/V, scores)


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


@dataclass
class MultiTurn:
    """Multi-turn rollouts. At the end of each turn (a stop token, a stop string or max_new_tokens), the sequence
    parks in its slot (its KV cache kept, out of the decode batch's updates) while ``handler.step(seq, turn_tokens,
    room)`` runs in a pool of ``workers`` threads (room: tokens left of the trajectory budget ``max_tokens``, the
    tokens after the prompt); it returns the tokens to append (prefilled onto the slot's own cache, then the next
    turn is sampled) or None to end the episode. Tokens that leave no room for one more sampled token end it too."""
    handler: object
    max_tokens: int
    workers: int = 8


def _model_dims(model) -> tuple[int, int, int]:
    cfg = base_model(model).config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes a step may run at: powers of two below ``max_batch``, and ``max_batch``."""
    sizes = [1 << i for i in range(max(1, max_batch).bit_length()) if (1 << i) < max_batch]
    return sizes + [max_batch]


class Sampler:
    """``Sampler(model, tokenizer).generate(prompt_ids, G, SamplingParams(...))`` → :class:`Rollout`.

    kv_cache_bytes: the KV budget (None: what the job needs, capped on CUDA by 90% of the free memory).
    cuda_graphs: replay decode steps as CUDA graphs (CUDA only). sync_every: decode steps between host checks.
    prefill_tokens: prompt tokens per prefill forward. fuse_lora: add LoRA deltas by fused products for the call
    (rollout/lora_fusion.py) instead of PEFT's per-layer forward. fast_decode: run decode steps of Llama-family
    models through rollout/fast_decode.py (fused elementwise kernels) instead of transformers' forward.
    pack_projections: with fast_decode, each layer's q/k/v and gate/up base weights (and their LoRA A rows) read by
    one product a group during the rollout (FastDecoder.prepare_packing). memory_cap_bytes: the run's GPU budget
    (train.gpu_memory_gib): the KV cache takes at most what it leaves. kv_cache_dtype: "bf16" keeps keys/values
    in the compute dtype, "fp8" in e4m3 with a scale per position and key head (rollout/kv_quant.py).
    """

    def __init__(self, model, tokenizer=None, *, kv_cache_bytes: int | None = None, cuda_graphs: bool = True,
                 sync_every: int = 16, prefill_tokens: int = 16384, fuse_lora: bool = True, fast_decode: bool = True,
                 nf4_kernel: bool = True, pack_projections: bool = True, memory_cap_bytes: int | None = None,
                 kv_cache_dtype: str = "bf16"):
        if kv_cache_dtype not in ("bf16", "fp8"):
            raise ValueError(f"kv_cache_dtype must be bf16 or fp8; got {kv_cache_dtype!r}")
        self.model, self.tokenizer, self.fuse_lora, self.nf4_kernel = model, tokenizer, fuse_lora, nf4_kernel
        self.memory_cap_bytes, self.kv_fp8 = memory_cap_bytes, kv_cache_dtype == "fp8"
        self.pack_projections = pack_projections
        self.kv_cache_bytes, self.sync_every, self.prefill_tokens = kv_cache_bytes, sync_every, prefill_tokens
        self.backbone, self.head, self.logit_spec = model_parts(model)
        self.device = self.head.weight.device
        self.use_triton = self.device.type == "cuda" and triton_available()
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and _graph_safe(model, self.use_triton)
        self.layers, self.kv_heads, self.head_dim = _model_dims(model)
        self.fast = FastDecoder.build(base_model(model)) if fast_decode else None
        self.fast_proven = False  # set once a fast decode step ran (see _Run._fast_forward)
        self.last_stats: dict = {}

    # ------------------------------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 multi_turn: MultiTurn | None = None) -> Rollout:
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1; got {num_generations}")
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
        register_sampler_attention()
        base = base_model(self.model)
        saved_impl, was_training = base.config._attn_implementation, self.model.training
        self.model.eval()
        base.set_attn_implementation(SAMPLER_ATTENTION)
        fusion = fused_lora(self.model, self.compute_dtype) if self.fuse_lora else contextlib.nullcontext(False)
        try:
            start = time.perf_counter()
            with fusion as fused:
                nf4 = self.fast.prepare_nf4(self.pack_projections) if self.nf4_kernel and self.fast is not None and self.use_triton else 0
                packer = self.fast if self.pack_projections else None  # (kept: a failing first fast step drops
                try:  # self.fast, and the weights must leave the packed buffers whatever happens)
                    packed = packer.prepare_packing() if packer is not None else 0
                    run = _Run(self, prompt_ids, num_generations, params, multi_turn)  # after prepare_nf4: KV
                    rollout = run.execute()  # cache sized from what is free then
                finally:
                    try:
                        if packer is not None:
                            packer.release_packing()
                    finally:
                        if self.fast is not None:
                            self.fast.release_nf4()
            self.last_stats = {**run.stats, "seconds": time.perf_counter() - start, "lora_fused": fused,
                               "fast_decode": self.fast is not None,
                               "nf4_projections": nf4 if self.fast is not None else 0,  # 0 after a fallback
                               "packed_groups": packed if self.fast is not None else 0,
                               "tokens": sum(len(c) for c in rollout.completion_ids)}
            log.debug("rollout: %(tokens)d tokens in %(seconds).2f s; %(slots)d slots, %(prefills)d prefills, "
                      "%(compactions)d compactions, %(decode_steps)d decode steps", self.last_stats)
            return rollout
        finally:
            base.set_attn_implementation(saved_impl)
            self.model.train(was_training)

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
    positions with a threshold on the host and swaps the frequency buffer a captured graph would keep reading)."""
    rotary = getattr(getattr(base_model(model), "model", None), "rotary_emb", None)
    rope = str(getattr(rotary, "rope_type", ""))  # a dict of them for per-layer-type models
    return use_triton and "dynamic" not in rope and "longrope" not in rope


class _Run:
    """The state of one ``generate`` call (cache, slots, queue); dropped when the call returns."""

    def __init__(self, sampler: Sampler, prompt_ids, G: int, params: SamplingParams, multi: MultiTurn | None = None):
        self.s, self.params, self.G, self.multi = sampler, params, G, multi
        self.prompts = [list(p) for p in prompt_ids]
        self.N, self.T = len(prompt_ids) * G, multi.max_tokens if multi is not None else params.max_new_tokens
        self.Lp = max(len(p) for p in prompt_ids)
        dev = sampler.device
        self.S, self.P = self._capacity()
        dims = dict(layers=sampler.layers, kv_heads=sampler.kv_heads, head_dim=sampler.head_dim)
        self.cache = KVCache.allocate(**dims, prefix_slots=self.P, prefix_len=self.Lp, slots=self.S, suffix_len=self.T,
                                      dtype=sampler.cache_dtype, device=dev, compute_dtype=sampler.compute_dtype)
        S, long = self.S, dict(dtype=torch.long, device=dev)
        self.cur_tok, self.position = torch.zeros(S, **long), torch.zeros(S, **long)
        self.prefix_index, self.prefix_len = torch.zeros(S, **long), torch.zeros(S, **long)
        self.write_index, self.gen_count = torch.zeros(S, **long), torch.zeros(S, **long)
        self.turn_limit = torch.full((S,), self.T, **long)  # a turn ends when gen_count reaches it
        self.active = torch.zeros(S, dtype=torch.bool, device=dev)
        self.tokens = torch.zeros(S, self.T, **long)
        self.logps = torch.zeros(S, self.T, dtype=torch.float32, device=dev)
        vocab = sampler.head.weight.shape[0]
        self.seen = torch.zeros(S, vocab, dtype=torch.bool, device=dev) if params.repetition_penalty != 1.0 else None
        self.stop_ids = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], **long)
        self.prompt_logits = torch.zeros(self.P, vocab, dtype=torch.float32, device=dev)
        self.members = torch.full((self.P, G), -1, **long)  # slots reading each prefix entry (grouped kernel)
        self.entry_len = torch.zeros(self.P, **long)
        self.logits_buf = torch.zeros(S, vocab, dtype=torch.float32, device=dev)
        self.seq_id = torch.zeros(S, **long)  # the sequence in each slot (its global id): keys its random numbers
        self.slots_changed = False  # members / entry_len are rebuilt before the next decode step when set
        self.buckets = batch_buckets(S)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if sampler.cuda_graphs else None
        # host bookkeeping
        self.waiting = deque(range(self.N))
        self.slot_seq = [-1] * S  # sequence in each slot (-1: free)
        self.slot_gen = [0] * S  # host's count of tokens generated in each slot (exact at syncs)
        self.slot_checked = [0] * S  # stop strings checked up to this token
        self.slot_turn = [0] * S  # index of the current turn's first token (multi-turn; else 0)
        self.slot_limit = [self.T] * S  # host copy of turn_limit
        self.pending: dict = {}  # multi-turn: sequence → (future of its environment step, tokens so far, stopped)
        self.env_spans: dict[int, list[tuple[int, int]]] = {}  # sequence → [start, end) of its environment tokens
        self.pool = ThreadPoolExecutor(multi.workers, thread_name_prefix="longrl-env") if multi is not None else None
        self.prompt_slot: dict[int, int] = {}  # prompt → prefix-store entry
        self.prompt_pending = [G] * len(self.prompts)  # completions of each prompt not yet finished
        self.free_prefix = list(range(self.P))
        self.results: list[tuple[list[int], list[float], bool] | None] = [None] * self.N
        self.stats = {"slots": S, "prefix_slots": self.P, "decode_steps": 0, "prefills": 0, "compactions": 0,
                      "kv_cache_bytes": self.cache.nbytes_held()}
        if multi is not None:
            self.stats.update(turns=0, resumes=0, resume_tokens=0, resume_forwards=0, resume_s=0.0, env_wait_s=0.0)

    # ------------------------------------------------------------------------------------------ sizing
    def _capacity(self) -> tuple[int, int]:
        """(decode slots, prefix-store entries): every sequence at once when the KV budget allows, else the most
        that fit (memory/planner.py's rollout arithmetic, shared with ``longrl plan``)."""
        s = self.s
        kv_token = KVCache.nbytes(layers=s.layers, kv_heads=s.kv_heads, head_dim=s.head_dim, tokens=1,
                                  dtype=s.cache_dtype)
        budget = s.kv_cache_bytes
        if budget is None and s.device.type == "cuda":
            free = torch.cuda.mem_get_info(s.device)[0]
            free += torch.cuda.memory_reserved(s.device) - torch.cuda.memory_allocated(s.device)
            if s.memory_cap_bytes is not None:  # the allocator is capped there: what the budget leaves
                free = min(free, s.memory_cap_bytes - torch.cuda.memory_allocated(s.device))
            budget = int(0.9 * free) - self._workspace_bytes()
        prompts = len(self.prompts)
        value_pad = s.layers * s.kv_heads * s.head_dim if s.cache_dtype == FP8 else 0  # a value code a position
        shape = dict(prompts=prompts, G=self.G, prompt_len=self.Lp, completion_len=self.T, kv_token=kv_token,
                     value_pad_token=value_pad)
        slots = self.N if budget is None else max_rollout_slots(budget, sequences=self.N, **shape)
        if slots < 1:
            need = rollout_kv_bytes(1, **shape)
            raise MemoryError(f"KV cache budget {(budget or 0) / 2**30:.2f} GiB cannot hold one sequence of "
                              f"{self.Lp} + {self.T} tokens (needs {need / 2**30:.2f} GiB)")
        return slots, prefix_entries(slots, prompts, self.G)

    def _workspace_bytes(self) -> int:
        s = self.s
        shape = ModelShape.from_config(base_model(s.model).config)
        itemsize = torch.empty((), dtype=s.compute_dtype).element_size()
        prefill = prefill_forward_tokens(s.prefill_tokens, len(self.prompts), self.Lp)
        return sampler_workspace_bytes(shape.hidden, shape.intermediate, shape.vocab, self.N, prefill, itemsize)

    # ------------------------------------------------------------------------------------------ main loop
    def execute(self) -> Rollout:
        try:
            self._admit()
            while any(q >= 0 for q in self.slot_seq):
                if self.pending:  # multi-turn: take back what the environments answered (wait if nothing decodes)
                    self._collect(block=all(q < 0 or q in self.pending for q in self.slot_seq))
                    continue_ = [i for i, q in enumerate(self.slot_seq) if q >= 0 and q not in self.pending]
                    if not continue_:
                        continue
                if self.slots_changed:
                    self._refresh_members()
                top = max(i for i, q in enumerate(self.slot_seq) if q >= 0) + 1
                B = next(b for b in self.buckets if b >= top)
                remaining = max(self.slot_limit[i] - self.slot_gen[i] for i, q in enumerate(self.slot_seq)
                                if q >= 0 and q not in self.pending)
                steps = max(1, min(self.s.sync_every, remaining))
                for _ in range(steps):
                    self._decode_step(B)
                self.stats["decode_steps"] += steps
                self._sync(B, steps)
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
        return self._rollout()

    def _rollout(self) -> Rollout:
        prompt_ids = [self.prompts[i // self.G] for i in range(self.N)]
        done = [r for r in self.results if r is not None]
        assert len(done) == self.N, "every sequence finishes"
        env_mask = None
        if self.multi is not None:
            env_mask = [[1] * len(r[0]) for r in done]
            for seq, spans in self.env_spans.items():
                for a, b in spans:
                    env_mask[seq][a:b] = [0] * (b - a)
        return Rollout(prompt_ids, [r[0] for r in done], [r[2] for r in done], [r[1] for r in done], env_mask)

    # ------------------------------------------------------------------------------------------ admission
    def _admit(self) -> None:
        free = [i for i, q in enumerate(self.slot_seq) if q < 0]
        to_prefill, admitted = [], []
        while free and self.waiting:
            seq = self.waiting[0]
            p = seq // self.G
            if p not in self.prompt_slot:
                if not self.free_prefix:
                    break
                self.prompt_slot[p] = self.free_prefix.pop(0)
                to_prefill.append(p)
            self.waiting.popleft()
            slot = free.pop(0)
            self.slot_seq[slot], self.slot_gen[slot], self.slot_checked[slot] = seq, 1, 0
            self.slot_turn[slot], self.slot_limit[slot] = 0, min(self.T, self.params.max_new_tokens)
            admitted.append((slot, seq))
        if to_prefill:
            self._prefill(to_prefill)
        if admitted:
            self._start(admitted)

    def _refresh_members(self) -> None:
        """Rebuild the prefix entry → slots table the decode attention reads (after slots changed)."""
        members = torch.full(tuple(self.members.shape), -1, dtype=torch.long)
        lengths = torch.zeros(self.P, dtype=torch.long)
        for slot, seq in enumerate(self.slot_seq):
            if seq >= 0:
                entry = self.prompt_slot[seq // self.G]
                members[entry, seq % self.G] = slot
                lengths[entry] = len(self.prompts[seq // self.G])
        self.members.copy_(members)
        self.entry_len.copy_(lengths)
        self.slots_changed = False

    def _prefill(self, prompts: list[int]) -> None:
        """Run the prompts (right-padded, in chunks of ≤ prefill_tokens) and keep each one's last logits."""
        s = self.s
        per_forward = max(1, s.prefill_tokens // self.Lp)
        for first in range(0, len(prompts), per_forward):
            chunk = prompts[first:first + per_forward]
            width = max(len(self.prompts[q]) for q in chunk)
            ids = pad_right([self.prompts[q] for q in chunk], 0, width).to(s.device)
            slots = torch.tensor([self.prompt_slot[q] for q in chunk], device=s.device)
            last = torch.tensor([len(self.prompts[q]) - 1 for q in chunk], device=s.device)
            positions = torch.arange(width, device=s.device)[None].expand(len(chunk), -1)
            with s.compute_context():
                hidden = s.backbone(input_ids=ids, position_ids=positions, use_cache=False,
                                    longrl_kv=PrefillMeta(self.cache, slots)).last_hidden_state
                self.prompt_logits[slots] = s.logits(hidden[torch.arange(len(chunk), device=s.device), last])
            self.stats["prefills"] += 1

    def _start(self, admitted: list[tuple[int, int]]) -> None:
        """Sample each admitted sequence's first token from its prompt's last logits."""
        dev = self.s.device
        slots = torch.tensor([a[0] for a in admitted], device=dev)
        prompts = [a[1] // self.G for a in admitted]
        entry = torch.tensor([self.prompt_slot[p] for p in prompts], device=dev)
        lengths = torch.tensor([len(self.prompts[p]) for p in prompts], device=dev)
        seen = None
        if self.seen is not None:
            self.seen[slots] = False
            for slot, p in zip(slots.tolist(), prompts):
                self.seen[slot, torch.tensor(self.prompts[p], device=dev)] = True
            seen = self.seen[slots]
        sequences = torch.tensor([self.params.sequence_id(a[1]) for a in admitted], device=dev)  # global ids
        self.seq_id[slots] = sequences
        tok, lp = next_tokens(self.prompt_logits[entry], self.params, sequences, torch.zeros_like(sequences), seen)
        self.tokens[slots, 0], self.logps[slots, 0] = tok, lp
        if self.seen is not None:
            self.seen[slots, tok] = True
        self.cur_tok[slots], self.position[slots] = tok, lengths
        self.prefix_index[slots], self.prefix_len[slots] = entry, lengths
        self.write_index[slots], self.gen_count[slots] = 0, 1
        self.turn_limit[slots] = min(self.T, self.params.max_new_tokens)  # = T for single-turn rollouts
        self.active[slots] = ~(torch.isin(tok, self.stop_ids) | (self.turn_limit[slots] <= 1))
        self.slots_changed = True

    # ------------------------------------------------------------------------------------------ decoding
    def _forward(self, B: int) -> None:
        s = self.s
        meta = DecodeMeta(self.cache, self.prefix_index[:B], self.prefix_len[:B], self.write_index[:B], s.use_triton,
                          self.members, self.entry_len)
        with s.compute_context():
            hidden = self._fast_forward(B, meta) if s.fast is not None else None
            if hidden is None:
                hidden = s.backbone(input_ids=self.cur_tok[:B, None], position_ids=self.position[:B, None],
                                    use_cache=False, longrl_kv=meta).last_hidden_state[:, 0]  # [B, d]
            self.logits_buf[:B] = s.logits(hidden)

    def _fast_forward(self, B: int, meta: DecodeMeta) -> torch.Tensor | None:
        """The fast decode path's hidden states [B, d]. Its first call (eager: before any graph capture) may
        fail where its kernels cannot build; then the sampler warns and keeps transformers' forward (this step's
        keys/values are rewritten by it). Later failures raise."""
        s = self.s
        if s.fast_proven:
            return s.fast(self.cur_tok[:B], self.position[:B], meta)
        try:
            hidden = s.fast(self.cur_tok[:B], self.position[:B], meta)
        except Exception as e:  # noqa: BLE001 - any build failure of the fused kernels
            log.warning("the fast decode path failed (%s: %s); decoding with transformers' forward",
                        type(e).__name__, str(e)[:300])
            s.fast = None
            return None
        s.fast_proven = True
        return hidden

    def _run_forward(self, B: int) -> None:
        if not self.s.cuda_graphs:
            self._forward(B)
            return
        graph = self.graphs.get(B)
        if graph is None:
            side = torch.cuda.Stream(self.s.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture (rewrites this step's own K/V, harmless)
                self._forward(B)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._forward(B)
            self.graphs[B] = graph
        graph.replay()

    def _decode_step(self, B: int) -> None:
        self._run_forward(B)
        rows = torch.arange(B, device=self.s.device)
        act = self.active[:B]
        seen = self.seen[:B] if self.seen is not None else None
        tok, lp = next_tokens(self.logits_buf[:B], self.params, self.seq_id[:B], self.gen_count[:B], seen)
        idx = self.gen_count[:B].clamp(max=self.T - 1)
        self.tokens[rows, idx] = torch.where(act, tok, self.tokens[rows, idx])
        self.logps[rows, idx] = torch.where(act, lp, self.logps[rows, idx])
        if seen is not None:
            self.seen[rows, tok] = seen[rows, tok] | act
        step = act.long()
        self.gen_count[:B] += step
        self.write_index[:B] += step
        self.position[:B] += step
        self.cur_tok[:B] = torch.where(act, tok, self.cur_tok[:B])
        done = act & (torch.isin(tok, self.stop_ids) | (self.gen_count[:B] >= self.turn_limit[:B]))
        self.active[:B] = act & ~done

    # ------------------------------------------------------------------------------------------ host checks
    def _sync(self, B: int, steps: int) -> None:
        active = self.active[:B].tolist()
        gen = self.gen_count[:B].tolist()
        occupied = [i for i in range(B) if self.slot_seq[i] >= 0 and self.slot_seq[i] not in self.pending]
        by_string = set()
        if self.params.stop_strings and self.s.tokenizer is not None and occupied:
            rows = self.tokens[:B, :max(gen[i] for i in occupied)].tolist()
            for i in occupied:
                first = self.slot_turn[i]  # only this turn's tokens (0: the whole single-turn completion)
                j = stop_index(rows[i][first:gen[i]], self.params.stop_strings, self.s.tokenizer.decode,
                               start=max(0, self.slot_checked[i] - first - 1))
                self.slot_checked[i] = gen[i]
                if j is not None:
                    gen[i], active[i] = first + j + 1, False
                    by_string.add(i)
        finished = [i for i in occupied if not active[i]]
        if finished:
            idx = torch.tensor(finished, device=self.s.device)
            self.active[idx] = False
            toks = self.tokens[idx].tolist()
            lps = self.logps[idx].tolist()
            for k, i in enumerate(finished):
                seq, n = self.slot_seq[i], gen[i]
                stopped = i in by_string or (n > 0 and toks[k][n - 1] in self.params.stop_token_ids)
                if self.multi is not None:
                    self._end_turn(i, toks[k][:n], stopped)
                    continue
                self.results[seq] = (toks[k][:n], lps[k][:n], not stopped)
                self._release(i)
        for i in occupied:
            if self.slot_seq[i] >= 0:
                self.slot_gen[i] = gen[i]
        if self.waiting:
            self._admit()
        else:
            self._compact()

    def _release(self, slot: int) -> None:
        p = self.slot_seq[slot] // self.G
        self.slot_seq[slot] = -1
        self.slots_changed = True
        self.prompt_pending[p] -= 1
        if self.prompt_pending[p] == 0:
            self.free_prefix.append(self.prompt_slot.pop(p))

    def _compact(self) -> None:
        """Move the occupied slots to the front when they fit a smaller bucket (one copy of their state)."""
        occupied = [i for i, q in enumerate(self.slot_seq) if q >= 0]
        if not occupied:
            return
        top = occupied[-1] + 1
        current = next(b for b in self.buckets if b >= top)
        target = next(b for b in self.buckets if b >= len(occupied))
        if target >= current:
            return
        dev = self.s.device
        src = torch.tensor(occupied, device=dev)
        dst = torch.arange(len(occupied), device=dev)
        for buf in self.cache.slot_tensors():
            buf[:, dst] = buf[:, src]
        tensors = [self.cur_tok, self.position, self.prefix_index, self.prefix_len, self.write_index, self.gen_count,
                   self.active, self.tokens, self.logps, self.seq_id, self.turn_limit] + \
            ([self.seen] if self.seen is not None else [])
        for t in tensors:
            t[dst] = t[src]
        moved = [(self.slot_seq[i], self.slot_gen[i], self.slot_checked[i], self.slot_turn[i], self.slot_limit[i])
                 for i in occupied]
        self.slot_seq = [-1] * self.S
        for k, (seq, gen, checked, turn, limit) in enumerate(moved):
            self.slot_seq[k], self.slot_gen[k], self.slot_checked[k] = seq, gen, checked
            self.slot_turn[k], self.slot_limit[k] = turn, limit
        self.active[len(occupied):] = False
        self.stats["compactions"] += 1
        self.slots_changed = True

    # ------------------------------------------------------------------------------------------ multi-turn
    def _end_turn(self, slot: int, tokens: list[int], stopped: bool) -> None:
        """A turn ended in ``slot`` (``tokens``: its whole trajectory so far): step its environment in the pool."""
        seq, n = self.slot_seq[slot], len(tokens)
        self.stats["turns"] += 1  # room 0 (the budget spent): the environment still sees the turn, nothing follows
        self.pending[seq] = (self.pool.submit(self.multi.handler.step, seq, tokens[self.slot_turn[slot]:], self.T - n),
                             n, stopped)

    def _finish_episode(self, slot: int, n: int, truncated: bool) -> None:
        toks = self.tokens[slot, :n].tolist()
        lps = self.logps[slot, :n].tolist()
        self.results[self.slot_seq[slot]] = (toks, lps, truncated)
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
            slot = self.slot_seq.index(seq)
            try:
                ids = future.result()
            except Exception as e:  # noqa: BLE001 - a failing handler ends its episode, not the rollout
                log.warning("multi-turn handler failed for sequence %d: %s: %s", seq, type(e).__name__, e)
                ids = None
            if ids is not None and n + len(ids) + 1 > self.T:  # no room for them and one more sampled token
                log.warning("sequence %d: %d environment tokens do not fit its trajectory budget (%d of %d used); "
                            "episode ended", seq, len(ids), n, self.T)
                ids, stopped = None, False
            if ids is None:
                self._finish_episode(slot, n, truncated=not stopped)
            else:
                returns.append((slot, [int(t) for t in ids], n))
        if returns:
            start = time.perf_counter()
            self._resume(returns)
            self.stats["resume_s"] += time.perf_counter() - start
        if self.waiting:
            self._admit()

    def _resume(self, returns: list[tuple[int, list[int], int]]) -> None:
        """Prefill each returning slot's last sampled token + environment tokens onto its own cache (ExtendMeta:
        slot-store indices n − 1 … n − 1 + len(ids)), and sample its next turn's first token from the last logits."""
        s, dev = self.s, self.s.device
        vocab = s.head.weight.shape[0]
        for slot, ids, n in returns:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"environment tokens of sequence {self.slot_seq[slot]} hold id {bad}, outside the "
                                 f"model's vocabulary [0, {vocab})")
        width = 1 + max(len(r[1]) for r in returns)
        keys = self.cache.k_pre.shape[3] + self.T  # prefix + slot-store positions each new query reads
        heads = base_model(s.model).config.get_text_config().num_attention_heads
        row_bytes = 2 * s.kv_heads * keys * s.head_dim * 4 + heads * width * keys * 4  # gathered K/V, scores
        per_forward = max(1, min(s.prefill_tokens // width, EXTEND_WORKSPACE_BYTES // row_bytes))
        for first in range(0, len(returns), per_forward):
            chunk = returns[first:first + per_forward]
            slots = torch.tensor([r[0] for r in chunk], device=dev)
            last_tok = self.tokens[slots, torch.tensor([r[2] - 1 for r in chunk], device=dev)]  # [b]
            width = 1 + max(len(r[1]) for r in chunk)
            ids = pad_right([r[1] for r in chunk], 0, width - 1).to(dev) if width > 1 else \
                torch.zeros(len(chunk), 0, dtype=torch.long, device=dev)
            inputs = torch.cat([last_tok[:, None], ids], dim=1)  # [b, width]
            lengths = torch.tensor([1 + len(r[1]) for r in chunk], device=dev)
            start = torch.tensor([r[2] - 1 for r in chunk], device=dev)
            plen = self.prefix_len[slots]
            positions = plen[:, None] + start[:, None] + torch.arange(width, device=dev)[None]
            meta = ExtendMeta(self.cache, slots, self.prefix_index[slots], plen, start, lengths)
            with s.compute_context():
                hidden = s.backbone(input_ids=inputs, position_ids=positions, use_cache=False,
                                    longrl_kv=meta).last_hidden_state  # [b, width, d]
                logits = s.logits(hidden[torch.arange(len(chunk), device=dev), lengths - 1])
            nxt = torch.tensor([r[2] + len(r[1]) for r in chunk], device=dev)  # index of each next token
            seen = None
            if self.seen is not None:
                for k, (slot, new, _) in enumerate(chunk):
                    if new:
                        self.seen[slot, torch.tensor(new, device=dev)] = True
                seen = self.seen[slots]
            tok, lp = next_tokens(logits, self.params, self.seq_id[slots], nxt, seen)
            for k, (slot, new, n) in enumerate(chunk):
                if new:
                    self.tokens[slot, n:n + len(new)] = torch.tensor(new, device=dev)
                    self.logps[slot, n:n + len(new)] = 0.0
                self.env_spans.setdefault(self.slot_seq[slot], []).append((n, n + len(new)))
                self.slot_turn[slot] = n + len(new)
                self.slot_gen[slot] = self.slot_checked[slot] = n + len(new) + 1
                self.slot_limit[slot] = min(self.T, n + len(new) + self.params.max_new_tokens)
            self.tokens[slots, nxt], self.logps[slots, nxt] = tok, lp
            if self.seen is not None:
                self.seen[slots, tok] = True
            self.cur_tok[slots], self.position[slots] = tok, plen + nxt
            self.write_index[slots], self.gen_count[slots] = nxt, nxt + 1
            self.turn_limit[slots] = torch.clamp(nxt + self.params.max_new_tokens, max=self.T)
            self.active[slots] = ~(torch.isin(tok, self.stop_ids) | (self.gen_count[slots] >= self.turn_limit[slots]))
            self.stats["resumes"] += len(chunk)
            self.stats["resume_forwards"] += 1
            self.stats["resume_tokens"] += int(lengths.sum())
