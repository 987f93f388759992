"""Symmetry reduction over requests.

Requests are interchangeable: a prompt's length is chosen when it arrives, so no constant
tells one request from another. Two states that differ only by a renaming of requests have
the same future up to that renaming, and the checker need visit only one of them.

`canonical` maps every state to one representative of its orbit. Request rows name pages but
never other requests, so sorting the rows fixes the renaming except among identical rows; for
those the candidates are tried and the smallest result wins. Equal orbits give equal sorted
rows and the same set of candidates, hence the same representative: this is a canonical
form, not a heuristic, and the reduced state count is the exact number of orbits (what TLC
counts with SYMMETRY Permutations(Requests)).
"""

from __future__ import annotations

from itertools import permutations, product

from spec.core import NONE, State


def relabel(s: State, order: tuple[int, ...] | list[int]) -> State:
    """The state in which new request i is old request order[i]."""
    new_id = [0] * len(order)
    for new, old in enumerate(order):
        new_id[old] = new
    reqs = s.requests

    def rid(x: int) -> int:
        return new_id[x] if x != NONE else NONE

    return State(
        tuple(reqs[old] for old in order),
        tuple((rid(o), g, rid(d), t) for o, g, d, t in s.decode_pool),
        tuple((rid(o), rid(d)) for o, d in s.prefill_pool),
        tuple(sorted((new_id[r], src, dst, g) for r, src, dst, g in s.writes)),
    )


def canonical(s: State) -> State:
    reqs = s.requests
    n = len(reqs)
    order = sorted(range(n), key=reqs.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and reqs[groups[-1][0]] == reqs[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) == n:
        if order == list(range(n)):
            return s
        return relabel(s, order)
    choices = [list(permutations(g)) for g in groups]
    best = None
    for pick in product(*choices):
        candidate = relabel(s, [i for part in pick for i in part])
        if best is None or candidate < best:
            best = candidate
    return best
