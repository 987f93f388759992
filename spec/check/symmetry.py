"""Symmetry reduction over requests, and over the workers of each kind.

Requests are interchangeable: a prompt's length is chosen when it arrives, so no constant
tells one request from another. Two states that differ only by a renaming of requests have
the same future up to that renaming, and the checker need visit only one of them.

`canonical` maps every state to one representative of its orbit. Request rows name pages but
never other requests, so sorting the rows fixes the renaming except among identical rows; for
those the candidates are tried and the smallest result wins. Equal orbits give equal sorted
rows and the same set of candidates, hence the same representative: this is a canonical
form, not a heuristic, and the reduced state count is the exact number of orbits (what TLC
counts with SYMMETRY Permutations(Requests)).

Workers of a kind are interchangeable too: all pools are alike and the router may place a
request on any of them. `canonical(s, m)` of a model with several workers of a kind also
renames workers: it takes the smallest of the request-canonical forms of the state under
the renamings of prefill and of decode workers that sort the workers by a signature no
renaming changes (one renaming when the signatures differ; all P! x D! when every worker
looks alike, as in the initial state). Renamings of workers and of requests commute, and the
renamings tried from any state of an orbit reach the same set of states, so that minimum is
the same for every state of an orbit of the product group: again a canonical form, and the
count is the exact number of orbits. (TLC's SYMMETRY with a union of permutation sets,
WorkerSymmetry in the spec, is not canonical: TLC maps a state to the smallest of its images
under the listed permutations only, so its count can lie between this one and the unreduced
count.)
"""

from __future__ import annotations

from itertools import permutations, product
from math import factorial

from spec.core import (CLIENT, DFW, DST, DW, FW, GEN, LANDED, NONE, OWNER, P_OWNER, PST, PTABLE,
                       PW, SENT, SRC, TABLE, TAG, State)


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
        tuple((rid(o), g, rid(d), t, tuple(sorted(new_id[x] for x in readers)), ident, kv, tid)
              for o, g, d, t, readers, ident, kv, tid in s.decode_pool),
        tuple((rid(o), rid(d), tuple(sorted(new_id[x] for x in readers)), ident)
              for o, d, readers, ident in s.prefill_pool),
        tuple(sorted((new_id[r], src, dst, g) for r, src, dst, g in s.writes)),
    )


def relabel_workers(s: State, prefill: tuple, decode: tuple, prefill_pages: int,
                    decode_pages: int) -> State:
    """The state in which new prefill worker i is old prefill[i], likewise decode."""
    new_p = [0] * len(prefill)
    for new, old in enumerate(prefill):
        new_p[old] = new
    new_d = [0] * len(decode)
    for new, old in enumerate(decode):
        new_d[old] = new

    def pp(x: int) -> int:  # a flat prefill page index
        return new_p[x // prefill_pages] * prefill_pages + x % prefill_pages

    def dp(x: int) -> int:
        return new_d[x // decode_pages] * decode_pages + x % decode_pages

    rows = []
    for row in s.requests:
        if row[PW] == NONE:
            rows.append(row)
            continue
        new = list(row)
        new[PW], new[DW] = new_p[row[PW]], new_d[row[DW]]
        new[SRC] = tuple(pp(x) for x in row[SRC])
        new[TABLE] = tuple((dp(x), g) for x, g in row[TABLE])
        new[PTABLE] = tuple((dp(x), g) for x, g in row[PTABLE])
        rows.append(tuple(new))
    decode_pool = tuple(page for old in decode
                        for page in s.decode_pool[old * decode_pages:(old + 1) * decode_pages])
    prefill_pool = tuple(page for old in prefill
                         for page in s.prefill_pool[old * prefill_pages:(old + 1) * prefill_pages])
    writes = tuple(sorted((r, pp(src), dp(dst), g) for r, src, dst, g in s.writes))
    return State(tuple(rows), decode_pool, prefill_pool, writes)


def canonical(s: State, m=None) -> State:
    """The representative of s's orbit: under renaming of requests, and of workers too when
    the model `m` has more than one of a kind."""
    if m is None or m.one_pair:
        return _canonical_requests(s)
    prefill_signatures, decode_signatures = _signatures(s, m)
    decodes = _orders(decode_signatures)
    best = None
    for prefill in _orders(prefill_signatures):
        for decode in decodes:
            if _identity(prefill) and _identity(decode):
                renamed = s
            else:
                renamed = relabel_workers(s, prefill, decode, m.prefill_pages, m.decode_pages)
            candidate = _canonical_requests(renamed)
            if best is None or candidate < best:
                best = candidate
    return s if best == s else best


# Which worker renamings `canonical` tries. Each worker gets a signature that no renaming of
# requests or of workers changes (it moves with its worker): the rows placed on it, without
# their worker fields, the writes from or to it, and its pages, without their request ids.
# Only the renamings that sort the workers by signature are tried (every order of workers
# whose signatures tie). For an orbit, the states those renamings give are the same set
# whichever member one starts from, so the minimum over them is still one representative
# per orbit, and the count is still exact; a state whose workers all differ is relabelled
# once instead of P! x D! times. (Rows never name requests, and the pools' other fields are
# left alone by `relabel` and `relabel_workers`: the fields read here are exactly ones those
# two leave unchanged.)

def _signatures(s: State, m) -> tuple[list, list]:
    """Each prefill worker's and each decode worker's signature."""
    prefill_pages, decode_pages = m.prefill_pages, m.decode_pages
    prefill_rows: list[list] = [[] for _ in range(m.prefill_workers)]
    decode_rows: list[list] = [[] for _ in range(m.decode_workers)]
    for row in s.requests:
        if row[PW] != NONE:
            key = (row[CLIENT], row[PST], row[SENT], row[DST], row[FW], row[DFW], row[LANDED])
            prefill_rows[row[PW]].append(key)
            decode_rows[row[DW]].append(key)
    prefill_writes = [0] * m.prefill_workers
    decode_writes = [0] * m.decode_workers
    for _, src, dst, _ in s.writes:
        prefill_writes[src // prefill_pages] += 1
        decode_writes[dst // decode_pages] += 1
    pool = s.prefill_pool
    prefill = [(tuple(sorted(rows)), prefill_writes[q],
                tuple(page[P_OWNER] == NONE
                      for page in pool[q * prefill_pages:(q + 1) * prefill_pages]))
               for q, rows in enumerate(prefill_rows)]
    pool = s.decode_pool
    decode = [(tuple(sorted(rows)), decode_writes[d],
               tuple((page[OWNER] == NONE, page[GEN], page[TAG])
                     for page in pool[d * decode_pages:(d + 1) * decode_pages]))
              for d, rows in enumerate(decode_rows)]
    return prefill, decode


def _identity(order: tuple[int, ...]) -> bool:
    return all(i == old for i, old in enumerate(order))


def _orders(signatures: list) -> list[tuple[int, ...]]:
    """Every order of the workers (new worker i is old order[i]) that sorts their signatures."""
    order, groups = _runs(signatures)
    if len(groups) == len(signatures):
        return [tuple(order)]
    return [tuple(i for part in pick for i in part)
            for pick in product(*(permutations(g) for g in groups))]


def _runs(keys) -> tuple[list[int], list[list[int]]]:
    """The indices of `keys` in key order, and that order cut into runs of equal keys."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and keys[groups[-1][0]] == keys[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return order, groups


def _canonical_requests(s: State) -> State:
    n = len(s.requests)
    order, groups = _runs(s.requests)
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


def orbit_size(s: State, m=None) -> int:
    """How many states s's orbit holds under the group `canonical` reduces by: the group's
    size over the number of its renamings that leave s unchanged. Summed over the orbits a
    reduced search visits, it is the number of states the search without symmetry would
    visit (the reachable states are a union of orbits: the initial state is fixed by every
    renaming and the next-state relation commutes with them), without running that search.
    Only renamings that keep every worker's signature can fix s, and among those only the
    request renamings that map each row onto an equal one are tried."""
    one_kind = m is None or m.one_pair
    group = factorial(len(s.requests))
    if one_kind:
        worker_orders = [((), ())]
    else:
        group *= factorial(m.prefill_workers) * factorial(m.decode_workers)
        prefill_signatures, decode_signatures = _signatures(s, m)
        worker_orders = [(p, d) for p in _matchings(prefill_signatures, prefill_signatures)
                         for d in _matchings(decode_signatures, decode_signatures)]
    if len(worker_orders) == 1 and len(set(s.requests)) == len(s.requests):
        return group  # no renaming but the identity keeps every worker's and row's place
    fixing = 0
    for prefill, decode in worker_orders:
        if one_kind or (_identity(prefill) and _identity(decode)):
            renamed = s
        else:
            renamed = relabel_workers(s, prefill, decode, m.prefill_pages, m.decode_pages)
        for order in _matchings(renamed.requests, s.requests):
            if relabel(renamed, order) == s:
                fixing += 1
    return group // fixing


def _matchings(values, targets) -> list[list[int]]:
    """Every order (new i is old order[i]) that puts at each position i a member of `values`
    equal to targets[i]; none if the two are not the same multiset. Of request rows: the
    request renamings that can fix a state; of a kind's worker signatures against
    themselves: the worker renamings that keep every signature in its place."""
    where: dict = {}
    for i, value in enumerate(values):
        where.setdefault(value, []).append(i)
    slots: dict = {}
    for i, value in enumerate(targets):
        slots.setdefault(value, []).append(i)
    if {k: len(v) for k, v in where.items()} != {k: len(v) for k, v in slots.items()}:
        return []
    orders = []
    keys = list(slots)
    for pick in product(*(permutations(where[k]) for k in keys)):
        order = [0] * len(targets)
        for k, chosen in zip(keys, pick):
            for position, old in zip(slots[k], chosen):
                order[position] = old
        orders.append(order)
    return orders
