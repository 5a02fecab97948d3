"""The per-slot state of one sampler call: a decode slot's device tensors and the host's bookkeeping of it.

Every field holds one row (or entry) a slot, so that compaction (moving the occupied slots to the front) and freeing
a slot each act on every field at once: a new per-slot field is declared here, and moves with its slot without
further edits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class SlotTensors:
    """What a decode step reads and updates on the device without the host, one row a slot ([slots, ...])."""

    last_token: torch.Tensor  # [slots] long: the last sampled token, the next decode step's input
    position: torch.Tensor  # [slots] long: its position in the sequence (prompt length + its index after it)
    prefix_entry: torch.Tensor  # [slots] long: the prefix-store entry of the slot's prompt
    prompt_len: torch.Tensor  # [slots] long: that prompt's length
    write_index: torch.Tensor  # [slots] long: where the next key/value goes in the slot's store
    generated: torch.Tensor  # [slots] long: tokens after the prompt so far (the next one's index)
    turn_limit: torch.Tensor  # [slots] long: the current turn ends when ``generated`` reaches it
    active: torch.Tensor  # [slots] bool: decoding (False: free, finished, or parked between turns)
    sequence_id: torch.Tensor  # [slots] long: the global id of the slot's sequence, which keys its random numbers
    tokens: torch.Tensor  # [slots, max_tokens] long: the tokens after the prompt
    logprobs: torch.Tensor  # [slots, max_tokens] float32: the sampler's log-prob of each (0: environment tokens)
    seen: torch.Tensor | None  # [slots, vocab] bool: tokens of prompt and completion (repetition penalty only)
    draft_k: torch.Tensor | None = None  # [slots] long: drafts a queued speculative step may check (device drafts)

    @classmethod
    def allocate(cls, slots: int, max_tokens: int, vocab: int, track_seen: bool, device,
                 draft_k_max: int = 0) -> SlotTensors:
        long = dict(dtype=torch.long, device=device)
        return cls(last_token=torch.zeros(slots, **long), position=torch.zeros(slots, **long),
                   prefix_entry=torch.zeros(slots, **long), prompt_len=torch.zeros(slots, **long),
                   write_index=torch.zeros(slots, **long), generated=torch.zeros(slots, **long),
                   turn_limit=torch.full((slots,), max_tokens, **long),
                   active=torch.zeros(slots, dtype=torch.bool, device=device),
                   sequence_id=torch.zeros(slots, **long), tokens=torch.zeros(slots, max_tokens, **long),
                   logprobs=torch.zeros(slots, max_tokens, dtype=torch.float32, device=device),
                   seen=torch.zeros(slots, vocab, dtype=torch.bool, device=device) if track_seen else None,
                   draft_k=torch.full((slots,), draft_k_max, **long) if draft_k_max else None)

    def all(self) -> list[torch.Tensor]:
        """Every per-slot tensor held (``seen`` only with a repetition penalty, ``draft_k`` with device drafts)."""
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    def compact(self, src: torch.Tensor) -> None:
        """Move rows ``src`` [n] (ascending) of every tensor to rows 0 … n−1, in place (captured CUDA graphs keep
        reading these tensors); rows n and on become free (:meth:`free`)."""
        dst = torch.arange(len(src), device=src.device)
        for t in self.all():
            t[dst] = t[src]
        self.free(slice(len(src), None))

    def free(self, rows) -> None:
        """Rows ``rows`` (an index or a slice) hold no sequence: inactive, and their store read up to index 0 only.
        A free row inside the decode batch still runs its step (a decode step changes nothing of an inactive row,
        and starting a sequence sets every field), so its attention reads one suffix position rather than the
        finished sequence's whole store."""
        self.active[rows] = False
        self.write_index[rows] = 0


FREE_SLOT = dict(sequence=-1, generated=0, checked=0, turn_start=0)  # each SlotBook field's free value


@dataclass
class SlotBook:
    """The host's bookkeeping of each slot, one list entry a slot (exact at each host sync)."""

    sequence: list[int]  # the sequence in the slot (its index in the call; -1: free)
    generated: list[int]  # tokens after the prompt so far
    checked: list[int]  # stop strings checked up to this token
    turn_start: list[int]  # index of the current turn's first token (multi-turn; else 0)

    @classmethod
    def free(cls, slots: int) -> SlotBook:
        return cls(**{f.name: [FREE_SLOT[f.name]] * slots for f in fields(cls)})

    def reset(self, slot: int) -> None:
        """Free ``slot``: every field back to its free value."""
        for f in fields(self):
            getattr(self, f.name)[slot] = FREE_SLOT[f.name]

    def compact(self, src: list[int]) -> None:
        """Move every field of slots ``src`` (ascending) to slots 0 … len(src)−1; the slots after them are free."""
        for f in fields(self):
            column = getattr(self, f.name)
            column[:len(src)] = [column[i] for i in src]
        for slot in range(len(src), len(self.sequence)):
            self.reset(slot)

    def occupied(self) -> list[int]:
        """The slots holding a sequence, in slot order."""
        return [i for i, seq in enumerate(self.sequence) if seq >= 0]

    def free_slots(self) -> list[int]:
        return [i for i, seq in enumerate(self.sequence) if seq < 0]
