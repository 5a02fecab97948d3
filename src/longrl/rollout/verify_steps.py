"""The verify steps of a sampler call: speculative rollouts' part of rollout/sampler.py's ``_Run`` (its mixin).

Two ways to step: with device drafts (``generation.speculative: ngram``), chunks of queued verify steps whose drafts,
acceptance and state updates stay on the device, the host reading counters once a chunk and choosing the next
chunk's mode (rollout/spec_schedule.py); with a proposer factory, one step a sync, the host feeding its proposers
and drafting before each. Either verify forward runs a slot's last token and its drafts as a decode step over
virtual rows (the fast path) or as an extend forward (its twin); rollout/speculative.py's rule keeps an exact
prefix of the drafts and samples one more token. docs/rollouts.md explains the method.

The mixin reads the call's state as ``_Run`` holds it (``state``, ``host``, ``cache``, ``members``, ``params``,
``sampler``, the draft books and counters) and calls its decode and extend forwards.
"""

from __future__ import annotations

import math

import torch

from ..memory.planner import EXTEND_WORKSPACE_BYTES, sampling_rows
from ..models.policy import pad_right
from .attention import KVCache, verify_meta
from .draft_book import kept_counts
from .drafts import adapted_draft_counts
from .spec_schedule import verify_cost_ratio
from .speculative import SpeculativeResult, speculative_step


# the fewest completion columns a whole queued verify step's drafts read (each width is its own CUDA graph): a graph
# reads every history column (DRAFT_HISTORY_TOKENS a prompt) anyway, so G · 256 columns more cost a step little,
# while each width a call reaches costs it a capture (tens of ms of host time): completions of up to 256 tokens need
# one width, not one for each power of two they pass (docs/rollouts.md, "Fewer widths a call")
GRAPH_WIDTH_FLOOR = 256


class VerifySteps:
    """``_Run``'s speculative steps (module docstring)."""

    # ------------------------------------------------------------------------------------------ queued speculation
    def _device_chunk(self, batch: int, remaining: int) -> int:
        """A chunk of decode steps over slots 0 … batch−1 with device drafts (no host round trip between them), for
        at most ``remaining`` more tokens a sequence: verify steps of at most ``spec_k`` drafts while the schedule
        speculates (as many as the last chunk's acceptance needs for them, at most sync_every), else plain steps
        (min(sync_every, remaining)); then (one host synchronisation) the chunk's counts, the schedule's next
        choice and the next chunk's draft count. Returns the steps run."""
        clock = self.sampler.clock
        state, counts, start = self.state, self.spec_counts, clock()
        steps = max(1, min(self.sampler.sync_every, remaining))
        if not self.schedule.speculate_next():
            for _ in range(steps):
                self._decode_step(batch)
            if self.sampler.device.type == "cuda":  # (_sync reads the state next anyway: this wait costs nothing)
                torch.cuda.synchronize(self.sampler.device)
            seconds = clock() - start
            counts.plain_steps += steps
            counts.plain_s += seconds
            self.schedule.record_plain(seconds / steps)
            return steps
        k = self.spec_k
        # a verify step emits 1 + a tokens a row (a: the last chunk's accepted drafts a row): no step past the need
        steps = max(1, min(steps, math.ceil(remaining / (1.0 + self.spec_accepted))))
        decoding = [i for i in self._decoding() if i < batch]
        # the completion columns the drafts read: every token this chunk can reach
        width = min(self.max_tokens, max(self.host.generated[i] for i in decoding) + steps * (k + 1))
        fast = self._fast_verify_fits(batch, k)
        whole = fast and self.sampler.speculative_graphs
        if whole:
            width = self._graph_width(width)
        for _ in range(steps):
            if whole:
                self._queued_graph(batch, k, width)
            else:
                self._queued_verify(batch, k, width, fast)
        next_k = torch.where(state.active[:batch], state.draft_k[:batch], 1).amax()
        rows, drafted, accepted, next_k = torch.cat([self.device_drafts.counts, next_k[None]]).tolist()
        self.device_drafts.counts.zero_()
        counts.verify_steps, counts.verify_rows = counts.verify_steps + steps, counts.verify_rows + rows
        counts.drafted, counts.accepted = counts.drafted + drafted, counts.accepted + accepted
        counts.fast_steps += steps if fast else 0
        seconds = clock() - start  # (the counts' read above waited for the chunk's last step)
        counts.verify_s += seconds
        if rows:
            self.spec_accepted = accepted / rows
            ratio = self.schedule.cost_ratio(self._verify_cost_ratio(k, decoding), seconds / steps)
            self.schedule.record(self.spec_accepted, ratio, k)
        self.spec_k = max(1, next_k)
        return steps

    def _graph_width(self, width: int) -> int:
        """A whole queued verify step's source width: ``width`` rounded up to a power of two and to at least
        GRAPH_WIDTH_FLOOR, at most the call's token limit (few graph captures a call)."""
        return min(self.max_tokens, max(GRAPH_WIDTH_FLOOR, 1 << max(0, width - 1).bit_length()))

    def _queued_graph(self, batch: int, k: int, width: int) -> None:
        """A queued verify step replayed as one CUDA graph a (batch, k, width) (sampler._Run._whole_step_graph: its
        eager first step also captures the verify forward's own graph). The graph reads and writes only the call's
        persistent tensors (the slots' state, the cache, the draft sources and counters), so a replay is the step on
        the state it finds."""
        self._verify_buffers(batch, k)  # (outside the capture; a new logits buffer drops the graphs using the old)
        if self._whole_step_graph(("queued", batch, k, width), lambda: self._queued_verify(batch, k, width, True),
                                  lambda: self._queued_verify(batch, k, width, True, whole_graph=True)):
            self.stats["spec_step_graphs"] = self.stats.get("spec_step_graphs", 0) + 1

    def _verify_cost_ratio(self, k: int, decoding: list[int]) -> float:
        """spec_schedule.verify_cost_ratio for the decoding slots' sequences now (the host's token counts)."""
        sampler = self.sampler
        if self.weight_bytes is None:
            self.weight_bytes = sampler.weight_bytes
        kv_token = KVCache.nbytes(layers=sampler.layers, kv_heads=sampler.kv_heads, head_dim=sampler.head_dim,
                                  tokens=1, dtype=sampler.cache_dtype)
        prompts = {self.host.sequence[i] // self.G for i in decoding}
        prompt_kv = kv_token * sum(len(self.prompts[p]) for p in prompts)
        own_kv = kv_token * sum(self.host.generated[i] for i in decoding)
        return verify_cost_ratio(self.weight_bytes, prompt_kv, own_kv, k)

    def _queued_verify(self, batch: int, k: int, width: int, fast: bool, whole_graph: bool = False) -> None:
        """One verify step over slots 0 … batch−1 with the device's drafts (device_drafts.DeviceDrafts.propose):
        row b checks its first min(found, draft_k, room) drafts, 0 where it does not decode (its state unchanged).
        Device work only; the same forward as _verify (the decode path over virtual rows, or the extend forward).
        whole_graph: the step is being captured whole (_queued_graph): the forward runs inline and the drafts read
        every history column (a graph's shapes are fixed)."""
        state = self.state
        rows = torch.arange(batch, device=self.sampler.device)
        drafts, found = self.device_drafts.propose(state.tokens, state.generated, state.prompt_len,
                                                   state.prefix_entry, self.members, rows, width, k,
                                                   every_column=whole_graph)  # [batch, k]
        act = state.active[:batch]
        room = (state.turn_limit[:batch] - state.generated[:batch] - 1).clamp(min=0)  # after the one always sampled
        lengths = torch.minimum(torch.minimum(found, state.draft_k[:batch]), room) * act  # [batch]
        if fast:
            self._accept_queued(rows, drafts, lengths, self._fast_verify(batch, k, drafts, graph=not whole_graph))
            return
        per_forward = self._extend_verify_rows(k)
        for first in range(0, batch, per_forward):
            part = rows[first:first + per_forward]
            real = torch.where(act[part], lengths[part] + 1, 0)  # a row that does not decode writes nothing
            self._accept_queued(part, drafts[part], lengths[part], self._extend_verify(part, drafts[part], real))

    def _accept_queued(self, rows: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
                       logits: torch.Tensor) -> None:
        """The acceptance rule over slots ``rows`` [n] (drafts [n, k], lengths [n], logits [n, k + 1, V]) in chunks
        within the sampling temporaries' budget; the decoding rows keep their tokens, count their drafts in the
        device counters and move their draft count by drafts.AdaptiveK's rule. No host synchronisation."""
        state, k_max = self.state, self.sampler.max_draft_tokens
        per_draw = max(1, sampling_rows(logits.shape[-1]) // logits.shape[1])
        for a in range(0, len(rows), per_draw):
            sub, at = rows[a:a + per_draw], slice(a, a + per_draw)
            act, tried = state.active[sub], lengths[at]
            seen = state.seen[sub] if state.seen is not None else None
            result = speculative_step(logits[at], drafts[at], self.params, state.sequence_id[sub],
                                      state.generated[sub], seen, tried)
            self._keep(sub, result, act)
            accepted = result.accepted * act
            self.device_drafts.counts += torch.stack([act.sum(), tried.sum(), accepted.sum()])
            state.draft_k[sub] = adapted_draft_counts(state.draft_k[sub], tried * act, accepted, k_max)

    # ------------------------------------------------------------------------------------------ speculative decoding
    def _speculative_step(self, batch: int) -> None:
        """A step of speculative decoding over slots 0 … batch−1: the proposers get the tokens emitted since they
        last looked and draft (at most the tokens the turn may still emit, less one); a verify forward checks the
        drafts of every decoding sequence, or a plain decode step runs when no sequence has a draft."""
        state, host = self.state, self.host
        active, generated = torch.stack([state.active[:batch].long(), state.generated[:batch]]).tolist()
        slots = [i for i in self._decoding() if i < batch and active[i]]
        self._feed_drafts(slots, generated)
        drafts = [self.drafts.propose(host.sequence[i], self._turn_limit(i) - generated[i] - 1) for i in slots]
        counts, start = self.drafts.counts, self.sampler.clock()
        if any(drafts):
            self._verify(batch, slots, drafts)
        else:
            self._decode_step(batch)
        if self.sampler.device.type == "cuda":  # (the next step reads the state anyway: this wait costs nothing)
            torch.cuda.synchronize(self.sampler.device)
        seconds = self.sampler.clock() - start
        if any(drafts):
            counts.verify_s += seconds
        else:
            counts.plain_steps, counts.plain_s = counts.plain_steps + 1, counts.plain_s + seconds

    def _feed_drafts(self, slots: list[int], generated: list[int]) -> None:
        """Hand each slot's proposer its trajectory's tokens [fed, generated) (its emitted tokens, and in multi-turn
        runs its environment's) that it has not seen."""
        if not slots:
            return
        device = self.sampler.device
        fed = [self.drafts.fed[self.host.sequence[i]] for i in slots]
        new = [generated[i] - f for i, f in zip(slots, fed)]
        width = max(new)
        if width <= 0:
            return
        cols = (torch.tensor(fed, device=device)[:, None] + torch.arange(width, device=device)[None])
        rows = self.state.tokens[torch.tensor(slots, device=device)[:, None], cols.clamp(max=self.max_tokens - 1)]
        for i, n, tokens in zip(slots, new, rows.tolist()):
            self.drafts.feed(self.host.sequence[i], tokens[:max(0, n)])

    def _verify(self, batch: int, slots: list[int], drafts: list[list[int]]) -> None:
        """One verify step over ``slots`` (decoding, active, all < batch): each slot's last token and drafts
        d_1..d_n (n ≤ k, padded to k) run in one forward onto its own store from its write index (their keys/values
        written at write_index … write_index + n); rollout/speculative.py's rule keeps a prefix of the drafts and
        samples one more token. The keys/values of rejected drafts stay past the new write index, where nothing
        reads them and later tokens overwrite them. The forward is a decode step over virtual rows
        (_verify_forward) where the fast verify applies, else the extend forward (the twin), in row chunks."""
        device = self.sampler.device
        k = max(len(d) for d in drafts)
        # host → device copies before the forward is queued: a copy from pageable memory waits for the stream, and
        # after the forward it would leave the GPU idle while the acceptance's launches are issued
        lengths = torch.tensor([len(d) for d in drafts], device=device)  # [n]
        rows = torch.tensor(slots, device=device)  # [n]
        if self._fast_verify_fits(batch, k):
            host = torch.zeros(batch, k, dtype=torch.long)
            host[slots] = pad_right(drafts, 0, k)  # [n, k] into the slots' rows (others': padding, never read)
            logits = self._fast_verify(batch, k, host.to(device, non_blocking=True))  # [batch, k + 1, V]
            self._accept(slots, drafts, self.verify_drafts[k][rows], lengths, logits, rows, rows)
            self.drafts.counts.fast_steps += 1
        else:
            per_forward = self._extend_verify_rows(k)
            for first in range(0, len(slots), per_forward):
                part, part_drafts = slots[first:first + per_forward], drafts[first:first + per_forward]
                part_rows = rows[first:first + per_forward]
                padded = pad_right(part_drafts, 0, k).to(device)  # [b, k]
                at = lengths[first:first + per_forward]
                logits = self._extend_verify(part_rows, padded, at + 1)  # [b, k + 1, V]
                self._accept(part, part_drafts, padded, at, logits, torch.arange(len(part), device=device), part_rows)
        self.drafts.counts.verify_steps += 1
        self.drafts.counts.verify_rows += len(slots)

    def _extend_verify_rows(self, k: int) -> int:
        """Rows one extend verify forward of k drafts holds: within its extend workspace, and its float32 logits
        [rows, k + 1, V] within the same cap."""
        vocab = self.sampler.head.weight.shape[0]
        return min(self._extend_rows(k + 1), max(1, EXTEND_WORKSPACE_BYTES // ((k + 1) * vocab * 4)))

    def _extend_verify(self, rows: torch.Tensor, drafts: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Logits [b, k + 1, V] of a verify forward on the extend path (the twin of _fast_verify): slots ``rows``
        [b] run their last token and drafts [b, k] from their write index, the first real [b] of them real (their
        keys/values written; 0: nothing written)."""
        sampler, state = self.sampler, self.state
        inputs = torch.cat([state.last_token[rows, None], drafts], dim=1)  # [b, k + 1]
        with sampler.compute_context():
            hidden = self._extend_forward(rows, inputs, state.write_index[rows], real)  # [b, k + 1, d]
            return sampler.logits(hidden.flatten(0, 1)).view(len(rows), inputs.shape[1], -1)

    def _accept(self, slots: list[int], drafts: list[list[int]], padded: torch.Tensor, lengths: torch.Tensor,
                logits: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        """The acceptance rule over ``slots`` [n] (on the device: ``rows``; their drafts, padded [n, k], lengths
        [n]; row j's logits [k + 1, V] at logits[index[j]]), in chunks within the sampling temporaries' budget: keep
        each row's tokens, then (one host synchronisation) record each row's acceptance with its proposer."""
        state, width = self.state, padded.shape[1] + 1
        per_draw = max(1, sampling_rows(logits.shape[-1]) // width)  # rows accepted at once
        accepted = []
        for a in range(0, len(slots), per_draw):
            sub, at = rows[a:a + per_draw], slice(a, a + per_draw)
            seen = state.seen[sub] if state.seen is not None else None
            result = speculative_step(logits[index[at]], padded[at], self.params, state.sequence_id[sub],
                                      state.generated[sub], seen, lengths[at])
            self._keep(sub, result)
            accepted.append(result.accepted)
        for slot, d, n in zip(slots, drafts, torch.cat(accepted).tolist()):
            self.drafts.record(self.host.sequence[slot], len(d), n)

    def _fast_verify_fits(self, batch: int, k: int) -> bool:
        """Whether a verify step of k drafts over slots 0 … batch−1 runs on the decode path (its float32 logits
        within the extend workspace), else on the extend forward."""
        vocab = self.sampler.head.weight.shape[0]
        return self.sampler.fast_verify and batch * (k + 1) * vocab * 4 <= EXTEND_WORKSPACE_BYTES

    def _verify_buffers(self, batch: int, k: int) -> None:
        """The fast verify's input (drafts [slots, k]) and output (logits) buffers for batch rows of k drafts,
        allocated outside any capture; a larger logits buffer drops the graphs that wrote the old one."""
        sampler, device = self.sampler, self.sampler.device
        vocab, width = sampler.head.weight.shape[0], k + 1
        if k not in self.verify_drafts:
            self.verify_drafts[k] = torch.zeros(self.num_slots, k, dtype=torch.long, device=device)
        if self.verify_logits is None or self.verify_logits.shape[0] < batch * width:  # (graphs keep the buffer:
            self.graphs = {key: g for key, g in self.graphs.items() if not isinstance(key, tuple)}  # recapture)
            # every slot's rows, within the extend workspace (which _verify checked batch · width fits in)
            rows = min(self.num_slots * width, EXTEND_WORKSPACE_BYTES // (vocab * 4))
            self.verify_logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)

    def _fast_verify(self, batch: int, k: int, drafts: torch.Tensor, graph: bool = True) -> torch.Tensor:
        """Logits [batch, k + 1, V] of a verify forward over slots 0 … batch−1 on the decode path of drafts
        [batch, k] (on the device), copied into the step's input buffer first: a CUDA graph per (batch, k) when the
        sampler uses graphs and ``graph`` (False: the forward inline, as inside a whole step's capture)."""
        vocab, width = self.sampler.head.weight.shape[0], k + 1
        self._verify_buffers(batch, k)
        self.verify_drafts[k][:batch].copy_(drafts)
        if graph:
            self._run_graph(("verify", batch, k), lambda: self._verify_forward(batch, k))
        else:
            self._verify_forward(batch, k)
        return self.verify_logits[:batch * width].view(batch, width, vocab)

    def _verify_forward(self, batch: int, k: int) -> None:
        """A verify step as a decode step of batch·(k + 1) virtual rows (attention.verify_meta): row b·(k+1) + i
        runs token i of [last_token_b, d_b1 … d_bk] at position position_b + i, its key/value written into slot b's
        store at write_index_b + i, attending over b's prompt and store up to there; logits into verify_logits.
        Device work only (capturable)."""
        sampler, state = self.sampler, self.state
        width = k + 1
        i = torch.arange(width, device=sampler.device)
        ids = torch.cat([state.last_token[:batch, None], self.verify_drafts[k][:batch]], dim=1).flatten()  # [b·w]
        positions = (state.position[:batch, None] + i).flatten()  # [b·w]
        meta = verify_meta(self.cache, state.prefix_entry[:batch], state.prompt_len[:batch], state.write_index[:batch],
                           width, sampler.use_triton, self.members, self.entry_len)
        with sampler.compute_context():
            self.verify_logits[:batch * width] = sampler.logits(self._decode_hidden(ids, positions, meta))

    def _keep(self, rows: torch.Tensor, result: SpeculativeResult, act: torch.Tensor | None = None) -> None:
        """Write a verify step's kept tokens (its accepted drafts and sampled token, cut after a stop token) and
        their log-probs after each row's trajectory, and advance generated / write_index / position by their count.
        act [b] bool: the rows that decode (None: all); the others keep their state."""
        state = self.state
        b, width = result.tokens.shape
        keep = kept_counts(result.tokens, result.accepted + 1, self.is_stop)  # [b], ≥ 1
        j = torch.arange(width, device=rows.device)[None]  # [1, k + 1]
        kept = j < keep[:, None]  # [b, k + 1]
        generated = state.generated[rows]
        # every position writes (no host synchronisation for a masked count): those past a row's kept tokens write
        # its last kept token and log-prob again, at its column, so the duplicate writes agree; a row that does not
        # decode writes back what its column holds
        last_j = (keep - 1)[:, None]  # [b, 1]
        cols = generated[:, None] + torch.where(kept, j, last_j)  # [b, k + 1]
        tokens = torch.where(kept, result.tokens, result.tokens.gather(1, last_j))
        logprobs = torch.where(kept, result.logprobs, result.logprobs.gather(1, last_j))
        at_row = rows[:, None].expand(b, width)
        if act is not None:
            cols = torch.where(act[:, None], cols, generated[:, None].clamp(max=self.max_tokens - 1))
            tokens = torch.where(act[:, None], tokens, state.tokens[at_row, cols])
            logprobs = torch.where(act[:, None], logprobs, state.logprobs[at_row, cols])
            keep = keep * act
        state.tokens[at_row, cols] = tokens
        state.logprobs[at_row, cols] = logprobs
        if state.seen is not None:
            state.seen[at_row, tokens] = True if act is None else state.seen[at_row, tokens] | act[:, None]
        last = result.tokens.gather(1, last_j)[:, 0]  # [b]
        ended = self.is_stop[last] | (generated + keep >= state.turn_limit[rows])
        if act is not None:
            last = torch.where(act, last, state.last_token[rows])
            ended = ended | ~act
        state.last_token[rows] = last
        state.generated[rows] = generated + keep
        state.write_index[rows] += keep
        state.position[rows] += keep
        state.active[rows] = ~ended
