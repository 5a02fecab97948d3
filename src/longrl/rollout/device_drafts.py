"""Drafts on the device, so that speculative steps queue like plain decode steps (no host round trip a step).

Each prefix entry (one prompt's group) reads its sources as one row of tokens, sections separated by SEPARATOR
(a token id that matches nothing and follows nothing):

    earlier completions of the prompt (oldest first) | the prompt | member 0's section | … | member G−1's

The first two sections are the entry's fixed part (:class:`DeviceDrafts`, written when the prompt is prefilled;
the group's finished completions are appended to the first). A member's section is the prompt's last
``max_match`` tokens followed by the member's completion, read from the slots' token rows at each step, so a
completion's newest tokens are sources as soon as they are sampled, and a match may run back into the prompt
(what a member sampled right after the prompt is a candidate).

A sequence's query is the last ``max_match`` tokens of its context (prompt ++ completion; NO_TOKEN before the
context's start); the sampler's matches are 1 to 8 tokens (MIN_MATCH, MAX_MATCH). A candidate is a position x of its
entry's row with a token (≥ 0) at x whose L tokens before x equal the query's last L (min_match ≤ L ≤ max_match; a match stops at a separator). The chosen candidate has the
largest L; among equals, one inside the sequence's own completion, then the largest x. The drafts are the tokens
from x on, at most k, up to the end of x's section. (The sequence's own last tokens never propose themselves: the
position after its completion holds a separator.) :func:`match_drafts` is the rule in tensor operations over all
rows at once; :func:`match_drafts_reference` is its plain twin, position by position.

Drafts only steer speed: the acceptance rule (rollout/speculative.py) keeps every emitted token exact whatever is
drafted, as long as the drafts depend only on tokens already emitted, which these do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..memory.planner import MATCH_ELEMENTS  # rows × source positions compared at once (the planner counts them)

SEPARATOR = -1  # between sections and after a completion's last token
NO_TOKEN = -2  # a query position before the context's start: equal to no source token, separators included
# the sampler's matches: 1 to 8 tokens. One-token matches draft more often at no cost here (the passes compare every
# position whatever the match length): 1.17-1.21 tokens a verify step against 1.11-1.15 with two-token matches at
# temperature 1, 1.28-1.60 against 1.21-1.52 at 0.7, on SmolLM2's completions (benchmarks/draft_acceptance.py
# --rule device; benchmarks/results/draft_acceptance_smollm2_device*_cpu.md)
MIN_MATCH, MAX_MATCH = 1, 8


def match_drafts(sources: torch.Tensor, entry: torch.Tensor, queries: torch.Tensor, own_start: torch.Tensor,
                 own_end: torch.Tensor, k: int, min_match: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's rule for R rows: sources [E, S] long; entry [R] (each row's row of sources); queries [R, M]
    (the context's last M tokens, NO_TOKEN-padded on the left); own_start, own_end [R]: the row's own completion
    [start, end) in its entry's row. → drafts [R, k] long (SEPARATOR after the found ones) and found [R] in [0, k].
    No host synchronisation."""
    R, M = queries.shape
    S = sources.shape[1]
    device = sources.device
    drafts = torch.full((R, k), SEPARATOR, dtype=torch.long, device=device)
    found = torch.zeros(R, dtype=torch.long, device=device)
    if R == 0 or S == 0 or M < min_match or k < 1:
        return drafts, found
    x = torch.arange(S, device=device)
    i = torch.arange(k, device=device)
    per = max(1, MATCH_ELEMENTS // S)
    for a in range(0, R, per):
        rows = slice(a, a + per)
        src = sources[entry[rows]]  # [r, S]
        alive = torch.ones(src.shape, dtype=torch.bool, device=device)
        length = torch.zeros(src.shape, dtype=torch.int32, device=device)  # [r, S]: L at each position
        for back in range(1, min(M, S) + 1):  # src[:, x − back] against the query's back-th last token
            alive[:, back - 1] = False  # (x < back: nothing back there)
            alive[:, back:] &= src[:, :S - back] == queries[rows, M - back, None]
            length += alive
        candidate = (src >= 0) & (length >= min_match)  # [r, S]
        best = torch.where(candidate, length, 0).amax(1, keepdim=True)  # [r, 1]
        own = (x >= own_start[rows, None]) & (x < own_end[rows, None])  # [r, S]
        rank = torch.where(candidate & (length == best), own.long() * S + x + 1, 0)  # > 0: a best candidate
        top = rank.argmax(1)  # [r]
        hit = rank.gather(1, top[:, None]) > 0  # [r, 1]
        cols = top[:, None] + i  # [r, k]
        tokens = torch.where(cols < S, src.gather(1, cols.clamp(max=S - 1)), SEPARATOR)
        run = torch.cumprod((tokens >= 0) & hit, dim=1).bool()  # [r, k]: the section's tokens from x on
        drafts[rows] = torch.where(run, tokens, SEPARATOR)
        found[rows] = run.sum(1)
    return drafts, found


def match_drafts_reference(sources: list[list[int]], entry: list[int], queries: list[list[int]],
                           own: list[tuple[int, int]], k: int, min_match: int) -> list[list[int]]:
    """Twin of :func:`match_drafts`: each row's drafts (a list of ≤ k tokens), every position compared token by
    token. sources: each entry's row; queries: each row's last M context tokens (NO_TOKEN-padded); own: the row's
    own completion [start, end)."""
    out = []
    for row, query in enumerate(queries):
        src, (start, end) = sources[entry[row]], own[row]
        best = None  # (L, own, x)
        for x in range(len(src)):
            if src[x] < 0:
                continue
            L = 0
            while L < len(query) and x - L - 1 >= 0 and src[x - L - 1] == query[-L - 1]:
                L += 1
            if L < min_match:
                continue
            key = (L, start <= x < end, x)
            if best is None or key > best:
                best = key
        drafts = []
        if best is not None:
            x = best[2]
            while len(drafts) < k and x < len(src) and src[x] >= 0:
                drafts.append(src[x])
                x += 1
        out.append(drafts)
    return out


class DeviceDrafts:
    """One sampler call's draft sources on the device: each prefix entry's fixed part [entries, H + 1 + P + 1]
    (earlier completions of its prompt in H positions, a separator, the prompt right-padded to P = the longest
    prompt, a separator), and the draft counters of the call's queued speculative steps (verify rows, drafted
    tokens, accepted drafts), read by the host at its syncs."""

    def __init__(self, entries: int, max_prompt_len: int, history_tokens: int, device, min_match: int = MIN_MATCH,
                 max_match: int = MAX_MATCH):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match; got {min_match}, {max_match}")
        self.min_match, self.max_match, self.history = min_match, max_match, history_tokens
        self.prompt_at = history_tokens + 1  # the prompt's first column in the fixed part
        self.fixed = torch.full((entries, history_tokens + 1 + max_prompt_len + 1), SEPARATOR, dtype=torch.long,
                                device=device)
        self.filled = [0] * entries  # history columns in use, per entry (host)
        self.prompt_len = torch.zeros(entries, dtype=torch.long, device=device)
        # each entry's prompt's last max_match tokens (SEPARATOR before its start): every member section's head
        self.tail = torch.full((entries, max_match), SEPARATOR, dtype=torch.long, device=device)
        self.counts = torch.zeros(3, dtype=torch.long, device=device)  # verify rows, drafted, accepted

    def open_entry(self, entry: int, prompt: list[int], earlier: list[list[int]]) -> None:
        """Entry ``entry`` now holds ``prompt``: its fixed part gets the prompt and, newest first while they fit
        (each with its separator), its ``earlier`` completions (newest first), laid out oldest first."""
        kept, used = [], 0
        for c in earlier:
            if used + len(c) + 1 > self.history:
                break
            kept.append(c)
            used += len(c) + 1
        row = self.fixed[entry]
        row.fill_(SEPARATOR)
        if kept:
            row[:used] = torch.tensor([t for c in reversed(kept) for t in (*c, SEPARATOR)], dtype=torch.long)
        row[self.prompt_at:self.prompt_at + len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
        self.filled[entry] = used
        self.prompt_len[entry] = len(prompt)
        tail = list(prompt)[-self.max_match:]
        self.tail[entry] = torch.tensor([SEPARATOR] * (self.max_match - len(tail)) + tail, dtype=torch.long)

    def add_finished(self, entry: int, tokens: torch.Tensor) -> None:
        """A finished completion of the entry's group (tokens [n] on the device) joins its history section with a
        separator after it, if both fit (device copies: no host synchronisation)."""
        n = tokens.shape[0]
        at = self.filled[entry]
        if n == 0 or at + n + 1 > self.history:
            return
        self.fixed[entry, at:at + n] = tokens
        self.fixed[entry, at + n] = SEPARATOR
        self.filled[entry] = at + n + 1

    def propose(self, tokens: torch.Tensor, generated: torch.Tensor, prompt_len: torch.Tensor,
                entry: torch.Tensor, members: torch.Tensor, rows: torch.Tensor,
                width: int, k: int, every_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [B, k] (0 after the found ones) and their counts found [B] for slots ``rows`` [B]: the slots'
        token rows tokens [slots, T] with generated [slots] of them real, prompt_len and entry [slots]; members
        [E, G] (the slots of each entry's sequences, −1: none); a member's section holds the prompt's last
        max_match tokens and the member's first ``width`` tokens (at least any slot's count when they are read).
        every_column: all H history columns are read (a CUDA graph's fixed shape), not only those in use."""
        E, G = members.shape
        device = tokens.device
        width = min(width, tokens.shape[1])
        used = self.history if every_column else max(self.filled)  # history columns read
        M = self.max_match
        member = members.clamp(min=0)  # [E, G]
        column = torch.arange(width, device=device)
        real = (members >= 0)[:, :, None] & (column < generated[member][:, :, None])  # [E, G, width]
        completions = torch.where(real, tokens[member, :width], SEPARATOR)
        sections = torch.cat([self.tail[:, None].expand(E, G, M), completions], dim=2)  # [E, G, M + width]
        sections = F.pad(sections, (0, 1), value=SEPARATOR).flatten(1)  # [E, G·(M + width + 1)]
        # the fixed parts without the history columns no entry uses yet, then the members' sections: [E, S]
        sources = torch.cat([self.fixed[:, :used], self.fixed[:, self.history:], sections], dim=1)
        row_entry = entry[rows]  # [B]
        own = (members[row_entry] == rows[:, None]).long().argmax(1)  # [B]: the slot's member index
        fixed_width = used + self.fixed.shape[1] - self.history  # the fixed parts' columns in the sources
        own_start = fixed_width + own * (M + width + 1) + M  # its completion's first column
        own_end = own_start + generated[rows].clamp(max=width)
        back = torch.arange(M, device=device) - M  # [M]: −M … −1
        at = generated[rows, None] + back  # [B, M]: completion index of each query token (< 0: in the prompt)
        from_completion = tokens[rows[:, None], at.clamp(min=0)]
        in_prompt = prompt_len[rows, None] + at  # its prompt index there
        from_prompt = self.fixed[row_entry[:, None], (self.prompt_at + in_prompt).clamp(0, self.fixed.shape[1] - 1)]
        queries = torch.where(at >= 0, from_completion, torch.where(in_prompt >= 0, from_prompt, NO_TOKEN))
        drafts, found = match_drafts(sources, row_entry, queries, own_start, own_end, k, self.min_match)
        return drafts.clamp(min=0), found


__all__ = ["DeviceDrafts", "MAX_MATCH", "MIN_MATCH", "NO_TOKEN", "SEPARATOR", "match_drafts", "match_drafts_reference"]
