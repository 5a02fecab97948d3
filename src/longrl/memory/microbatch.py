"""Token-budget micro-batches: split a step's sequences into groups whose total length fits a budget.

A sequence longer than the budget forms a group alone; short ones are packed together (no padding, see
``longrl.models.policy``). First-fit decreasing: sequences sorted by length, longest first, each placed in the
first group with room. Loss weights come from the whole step, so any grouping gives the same loss.
"""

from __future__ import annotations


def token_budget_groups(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices of sequences grouped so that Σ lengths ≤ token_budget per group (or one sequence alone)."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(token_budget - lengths[i])
    return [sorted(g) for g in groups]


def count_groups(n: int, size: int) -> list[list[int]]:
    """Contiguous groups of ``size`` sequences."""
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]
