"""Draft tokens without a draft model: longest suffix matches against the prompt and the group's completions.

A sequence's context is prompt ++ completion. Its query is the context's last ``max_match`` tokens. The sources
are, in rank order: the G completions of its group (its own first, then the others by index), the prompt, and
completions of the same prompt kept from earlier steps (newest first). Every completion is read as prompt ++
completion, so a match may run back into the prompt; the prompt source holds the matches ending inside the prompt,
each completion those ending inside itself (so no n-gram is indexed twice).

A candidate is an end position e of a source s (its tokens s[e-L:e] equal the query's last L tokens, with
min_match <= L <= max_match) followed by at least one token; the draft is s[e : e + k]. The chosen candidate has
the largest L; among equals the lowest source rank, then the largest e (the most recent occurrence). The sequence's
own completion never proposes the query itself (its end has no following token).

:class:`GroupProposer` finds candidates through an index (the last ``min_match`` tokens → end positions) and
extends each backwards; :func:`propose_reference` is its plain twin, comparing every position of every source.
:class:`DraftHistory` keeps earlier completions per prompt, at most ``max_tokens`` a prompt (oldest completions
dropped first) and ``max_prompts`` prompts (least recently used dropped). :class:`AdaptiveK` moves each sequence's
draft length with its acceptance.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class AdaptiveK:
    """Draft length per sequence in [1, k_max]: +1 after a step accepting all of k drafts, −1 after one accepting
    fewer than half (k = 1 stays 1), unchanged otherwise. Starts at ``start`` (default k_max)."""

    k_max: int
    start: int | None = None
    k: int = field(init=False)

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1; got {self.k_max}")
        self.k = min(self.k_max, max(1, self.start or self.k_max))

    def update(self, drafted: int, accepted: int) -> None:
        """Record a verify step that checked ``drafted`` tokens and accepted the first ``accepted`` of them."""
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.k = min(self.k_max, self.k + 1)
        elif 2 * accepted < drafted:
            self.k = max(1, self.k - 1)


def adapted_draft_counts(k: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor, k_max: int) -> torch.Tensor:
    """:meth:`AdaptiveK.update` on the device, for rows with draft counts k [B] after a verify step that checked
    drafted [B] tokens (0: no change) and accepted the first accepted [B] of them. No host synchronisation."""
    tried = drafted > 0
    step = (tried & (accepted >= drafted)).long() - (tried & (2 * accepted < drafted)).long()
    return (k + step).clamp(1, k_max)


class DraftHistory:
    """Completions of earlier steps, per prompt (keyed by its token ids), with bounded memory: at most
    ``max_tokens`` tokens a prompt (the oldest completions dropped first; one longer than the cap keeps its first
    ``max_tokens``) and ``max_prompts`` prompts (the least recently used dropped). Tokens are kept as 8-byte
    machine integers (a Python list of ints costs about 36 bytes a token)."""

    def __init__(self, max_tokens: int = 16384, max_prompts: int = 4096):
        if max_tokens < 1 or max_prompts < 1:
            raise ValueError(f"max_tokens and max_prompts must be >= 1; got {max_tokens}, {max_prompts}")
        self.max_tokens, self.max_prompts = max_tokens, max_prompts
        self._store: OrderedDict[bytes, list[array]] = OrderedDict()  # prompt's bytes → oldest completion first

    @staticmethod
    def _key(prompt: list[int]) -> bytes:
        return array("q", prompt).tobytes()

    def add(self, prompt: list[int], completions: list[list[int]]) -> None:
        key = self._key(prompt)
        kept = self._store.pop(key, [])
        kept.extend(array("q", c[:self.max_tokens]) for c in completions if len(c))
        total = sum(len(c) for c in kept)
        while total > self.max_tokens:
            total -= len(kept.pop(0))
        self._store[key] = kept
        while len(self._store) > self.max_prompts:
            self._store.popitem(last=False)

    def completions(self, prompt: list[int]) -> list[list[int]]:
        """The kept completions of ``prompt``, newest first."""
        key = self._key(prompt)
        if key not in self._store:
            return []
        self._store.move_to_end(key)
        return [c.tolist() for c in reversed(self._store[key])]

    def stored_tokens(self) -> int:
        return sum(len(c) for kept in self._store.values() for c in kept)


class _Source:
    """One source read as prompt ++ tokens, indexing the n-grams (n = min_match) that end inside ``tokens``
    (or inside the prompt, for the prompt source: ``tokens`` empty and ``own_prompt``)."""

    def __init__(self, prompt: list[int], tokens: list[int], n: int, own_prompt: bool = False):
        self.prompt, self.tokens, self.n = prompt, [], n
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram → end positions, increasing
        self.start = 0 if own_prompt else len(prompt)  # positions < start belong to another source
        if own_prompt:
            for e in range(n, len(prompt) + 1):
                self.index[tuple(prompt[e - n:e])].append(e)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def at(self, i: int) -> int:
        P = len(self.prompt)
        return self.prompt[i] if i < P else self.tokens[i - P]

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            e = len(self)
            if e >= self.n and e - 1 >= self.start:
                self.index[tuple(self.at(i) for i in range(e - self.n, e))].append(e)

    def following(self, e: int, k: int) -> list[int]:
        return [self.at(i) for i in range(e, min(len(self), e + k))]


class GroupProposer:
    """Drafts for the G sequences of one prompt's group (see the module docstring for the rule).

    ``append(i, tokens)`` adds sequence i's new tokens (the index grows with them); ``propose(i)`` returns up to
    its adaptive k draft tokens ([] when nothing matches); ``record(i, drafted, accepted)`` adapts its k;
    ``finish()`` hands the group's completions to the history for the prompt's later groups."""

    def __init__(self, prompt: list[int], group_size: int, k_max: int = 4, min_match: int = 2, max_match: int = 16,
                 history: DraftHistory | None = None):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match; got {min_match}, {max_match}")
        self.prompt, self.min_match, self.max_match, self.history = list(prompt), min_match, max_match, history
        self.group = [_Source(self.prompt, [], min_match) for _ in range(group_size)]
        self.prompt_source = _Source(self.prompt, [], min_match, own_prompt=True)
        self.past = [_Source(self.prompt, c, min_match) for c in (history.completions(prompt) if history else [])]
        self.ks = [AdaptiveK(k_max) for _ in range(group_size)]

    def append(self, i: int, tokens: list[int]) -> None:
        self.group[i].extend(list(tokens))

    def completion(self, i: int) -> list[int]:
        return list(self.group[i].tokens)

    def sources(self, i: int) -> list[_Source]:
        """Sequence i's sources in rank order."""
        return [self.group[i]] + [g for j, g in enumerate(self.group) if j != i] + [self.prompt_source] + self.past

    def matches(self, i: int):
        """Sequence i's candidates as (L, source, e), sources in rank order and each one's most recent end first:
        s[e-L:e] equals the query's last L tokens (min_match <= L <= max_match, the whole query at most) and a token
        follows e. Lazily: a caller may stop at a match of the whole query, which nothing later can beat."""
        own = self.group[i]
        query = [own.at(j) for j in range(max(0, len(own) - self.max_match), len(own))]  # [≤ max_match]
        n = self.min_match
        if len(query) < n:
            return
        key = tuple(query[-n:])
        for s in self.sources(i):
            for e in reversed(s.index.get(key, ())):
                if e >= len(s):  # nothing follows
                    continue
                L = n
                while L < len(query) and e - L - 1 >= 0 and s.at(e - L - 1) == query[-L - 1]:
                    L += 1
                yield L, s, e

    def propose(self, i: int, k: int | None = None) -> list[int]:
        k = self.ks[i].k if k is None else k
        if k < 1:
            return []
        best = None  # (L, source, e)
        whole = min(len(self.group[i]), self.max_match)  # the query's length
        for L, s, e in self.matches(i):
            if best is None or L > best[0]:
                best = (L, s, e)
                if L == whole:  # nothing later in the rank order can beat it
                    break
        return [] if best is None else best[1].following(best[2], k)

    def record(self, i: int, drafted: int, accepted: int) -> None:
        self.ks[i].update(drafted, accepted)

    def finish(self) -> None:
        if self.history is not None:
            self.history.add(self.prompt, [g.tokens for g in self.group])


def propose_reference(prompt: list[int], completions: list[list[int]], past: list[list[int]], i: int, k: int,
                      min_match: int = 2, max_match: int = 16) -> list[int]:
    """Twin of :meth:`GroupProposer.propose`: every end position of every source compared token by token.
    ``completions`` are the group's (sequence i's included), ``past`` the history's, newest first."""
    own = prompt + completions[i]
    query = own[max(0, len(own) - max_match):]
    if len(query) < min_match or k < 1:
        return []
    P = len(prompt)
    # (text, first end position owned by the source) in rank order
    sources = ([(prompt + completions[i], P + 1)] + [(prompt + c, P + 1) for j, c in enumerate(completions) if j != i]
               + [(prompt, 1)] + [(prompt + c, P + 1) for c in past])
    best_len, best = 0, []
    for text, first in sources:
        for e in range(len(text) - 1, max(first, min_match) - 1, -1):  # most recent first; e < len: a token follows
            L = 0
            while L < len(query) and e - L - 1 >= 0 and text[e - L - 1] == query[-L - 1]:
                L += 1
            if L >= min_match and L > best_len:
                best_len, best = L, text[e:e + k]
    return best
