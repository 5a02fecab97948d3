"""The host's side of speculative rollouts in one sampler call: a draft proposer per prompt group, fed each
sequence's tokens as they are emitted, asked for drafts before each verify step, told what was accepted; and the
counters the sampler reports.

A proposer (rollout/drafts.py :class:`GroupProposer`, or any object with the same four methods) serves the G
sequences of one prompt, sequence i of the group being the call's sequence ``prompt · G + i``. The book opens it
when the group's first sequence is admitted and closes it (``finish``: the group's completions go to the prompt's
draft history) when its last one finishes. Drafts depend only on tokens already emitted (of the sequence and of the
others), never on the random numbers a verify step is about to use, which is what keeps the emitted tokens exact
(rollout/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


class GroupDrafts(Protocol):
    """What the sampler asks of a proposer of one prompt group (sequences 0 … G−1 of the group)."""

    def append(self, i: int, tokens: list[int]) -> None: ...

    def propose(self, i: int) -> list[int]: ...

    def record(self, i: int, drafted: int, accepted: int) -> None: ...

    def finish(self) -> None: ...


ProposerFactory = Callable[[list[int], int], GroupDrafts]  # (prompt token ids, G) → the group's proposer


@dataclass
class SpeculativeCounts:
    """A call's verify steps (forwards over drafted tokens), their rows (sequences checked), the tokens drafted and
    the drafts accepted; the seconds spent in verify steps and in the plain decode steps of the same call (with host
    proposers, steps where no sequence had a draft; with device drafts, the schedule's plain chunks)."""

    verify_steps: int = 0
    verify_rows: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_s: float = 0.0
    fast_steps: int = 0  # verify steps run on the decode path (virtual rows; the rest: the extend forward)
    plain_steps: int = 0
    plain_s: float = 0.0

    def summary(self) -> dict:
        """The sampler's ``spec_*`` statistics: the counts, accepted drafts per row of a verify step (a verify step
        emits 1 + that many tokens a sequence), the share of drafted tokens accepted (the hit rate), the verify
        steps' seconds, and, when the call also ran plain steps, an estimate of the seconds saved:
        s_saved = V·(1 + a)·t_plain − T_verify, with V verify steps, a the mean accepted drafts a row, t_plain the
        mean plain step and T_verify the verify steps' seconds (plain decoding would have needed about 1 + a steps
        for each verify step's tokens, its rows advancing together)."""
        per_row = self.accepted / max(1, self.verify_rows)
        out = {"spec_verify_steps": self.verify_steps, "spec_verify_rows": self.verify_rows,
               "spec_drafted_tokens": self.drafted, "spec_accepted_tokens": self.accepted,
               "spec_accepted_per_step": per_row, "spec_hit_rate": self.accepted / max(1, self.drafted),
               "spec_verify_s": self.verify_s, "spec_fast_verify_steps": self.fast_steps}
        if self.plain_steps:
            plain = self.plain_s / self.plain_steps
            out["spec_time_saved_s"] = self.verify_steps * (1 + per_row) * plain - self.verify_s
        return out


class DraftBook:
    """The proposers of one call, by prompt, and how many tokens of each sequence they were given."""

    def __init__(self, new_group: ProposerFactory, prompts: list[list[int]], group_size: int):
        self.new_group, self.prompts, self.G = new_group, prompts, group_size
        self.groups: dict[int, GroupDrafts] = {}  # prompt → its group's proposer
        self.fed: dict[int, int] = {}  # sequence → tokens given to its proposer (its trajectory's first ones)
        self.counts = SpeculativeCounts()

    def open(self, sequence: int) -> None:
        prompt = sequence // self.G
        if prompt not in self.groups:
            self.groups[prompt] = self.new_group(self.prompts[prompt], self.G)
        self.fed[sequence] = 0

    def feed(self, sequence: int, tokens: list[int]) -> None:
        """The sequence's trajectory tokens after the ``fed[sequence]`` it was given already."""
        if tokens:
            self.groups[sequence // self.G].append(sequence % self.G, list(tokens))
            self.fed[sequence] += len(tokens)

    def propose(self, sequence: int, room: int) -> list[int]:
        """At most ``room`` drafts (the tokens the turn may still emit after the one a verify step always samples)."""
        if room <= 0:
            return []
        return list(self.groups[sequence // self.G].propose(sequence % self.G))[:room]

    def record(self, sequence: int, drafted: int, accepted: int) -> None:
        self.groups[sequence // self.G].record(sequence % self.G, drafted, accepted)
        self.counts.drafted += drafted
        self.counts.accepted += accepted

    def close(self, sequence: int, trajectory: list[int], group_done: bool) -> None:
        """The sequence finished with ``trajectory`` (its tokens after the prompt): its proposer gets the tokens it
        has not seen; the group's proposer finishes when it was the group's last."""
        self.feed(sequence, trajectory[self.fed[sequence]:])
        del self.fed[sequence]
        if group_done:
            self.groups.pop(sequence // self.G).finish()


def stop_table(stop_ids, vocab: int, device) -> torch.Tensor:
    """is_stop [vocab] bool: True at each stop token id (ids outside the vocabulary, which no sampled token can be,
    left out). is_stop[tokens] is a gather, which a CUDA graph captures at any number of stop ids (torch.isin
    sorts, and synchronises, once they are many)."""
    table = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = [int(t) for t in set(stop_ids) if 0 <= int(t) < vocab]
    if ids:
        table[torch.tensor(ids, dtype=torch.long, device=device)] = True
    return table


def kept_counts(tokens: torch.Tensor, emitted: torch.Tensor, is_stop: torch.Tensor) -> torch.Tensor:
    """Tokens a verify step keeps per row: its ``emitted`` [B] tokens (tokens [B, k + 1], the first emitted[b] of
    row b valid), cut after the first stop token among them (is_stop: :func:`stop_table`; what follows a stop is
    never part of the sequence). [B] long."""
    j = torch.arange(tokens.shape[1], device=tokens.device)[None]  # [1, k + 1]
    stop = is_stop[tokens] & (j < emitted[:, None])  # [B, k + 1]
    first = stop.to(torch.uint8).argmax(1)  # the first stop's index (0 where there is none)
    return torch.where(stop.any(1), first + 1, emitted)


__all__ = ["DraftBook", "GroupDrafts", "ProposerFactory", "SpeculativeCounts", "kept_counts", "stop_table"]
