"""Token-budget micro-batches: split a step's sequences into groups whose total length fits a budget.

A sequence longer than the budget forms a group alone; short ones are packed together (no padding, see
``longrl.models.policy``). First-fit decreasing: sequences sorted by length, longest first, each placed in the
first group with room. Loss weights come from the whole step, so any grouping gives the same loss.

With grouped rows (train.shared_prompt: each prompt once, then its completions, models/shared_prompt.py) the unit
is a prompt's group, of P + ΣR tokens: kept whole in one micro-batch when it fits the budget, else cut into runs
of its completions that each fit with the prompt (P + R_a + … + R_b ≤ budget; a completion that does not fit even
alone is a run by itself), and those units are packed first-fit decreasing by the same rule.
"""

from __future__ import annotations

from ..models.shared_prompt import group_by_prompt


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


def prompt_group_batches(prompt_ids: list[list[int]], completion_lengths: list[int], token_budget: int,
                         size: int, keys: list | None = None) -> list[list[int]]:
    """Micro-batches (sequence indices) for grouped rows, a group's completions together (module docstring):
    by ``token_budget`` (> 0) over P + ΣR a unit, else ``size`` sequences a micro-batch taken group after group.
    ``keys``: per sequence its prompt's images (a VisionPrompt) or None: equal tokens with other images are
    another group (models/shared_prompt.group_by_prompt)."""
    groups = group_by_prompt(prompt_ids, keys)
    if token_budget <= 0:
        order = [i for g in groups for i in g]
        return [sorted(order[s:s + size]) for s in range(0, len(order), size)]
    units: list[list[int]] = []
    costs: list[int] = []
    for g in groups:
        prompt = len(prompt_ids[g[0]])
        run, cost = [], prompt
        for i in g:
            if run and cost + completion_lengths[i] > token_budget:
                units.append(run)
                costs.append(cost)
                run, cost = [], prompt
            run.append(i)
            cost += completion_lengths[i]
        units.append(run)
        costs.append(cost)
    return [sorted(i for u in batch for i in units[u]) for batch in token_budget_groups(costs, token_budget)]
