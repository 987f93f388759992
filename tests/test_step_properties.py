"""Step properties and the guard-trip property: each one fails on a small mutant of the core
(not a bug switch) that only it catches, in the checker and in the fuzzer, and holds on the
correct protocol.

The mutants are what reviewers bring from other trackers: an answer rewritten after the
client already had one, a late Done that reopens a request decode had given up on, a decode
restart that reissues generations from zero, a tombstone forgotten when the late bootstrap
is dropped, a transfer that loses a page on the protocol's own path.
"""

from __future__ import annotations

import pytest

from spec import core
from spec.check.checker import Checker
from spec.check.zoo import BASES
from spec.core import (CLIENT, CLOSING, DECODING, DFW, DST, D_NONE, D_WAITING, FW, MSG_DONE,
                       NO_MSG, OK, TOMB)
from spec.model import Model
from spec.properties import STEP_PROPERTIES, STATE_INVARIANTS, REST_INVARIANTS
from spec.store import Store
from fuzz.runner import Campaign, run_campaign


def _finish_rewrites_any_answer(original):
    """Finish answers Ok even when the client already had its answer (it went away)."""
    def finish(m, s, r, tags_ok):
        out = original(m, s, r, tags_ok)
        if type(out) is str or not tags_ok:
            return out
        (_, row), = out.rows
        return out._replace(rows=((r, row[:CLIENT] + (OK,) + row[CLIENT + 1:]),))
    return finish


def _late_done_reopens(original):
    """A Done that reaches decode after it gave up (Closing) starts decoding after all."""
    def accept(m, s, r, checksums_ok):
        row = s.requests[r]
        if row[FW] == MSG_DONE and row[DST] == CLOSING:
            new = row[:DST] + (DECODING,) + row[DST + 1:]
            new = new[:FW] + (NO_MSG,) + new[FW + 1:]
            new = new[:DFW] + (1,) + new[DFW + 1:]
            return core.Change(((r, new),))
        return original(m, s, r, checksums_ok)
    return accept


def _decode_restart_reissues_generations(original):
    """The restarted decode counts generations from zero again (the tag counter did not
    outlive the process)."""
    def decode_crash(m, s, d=0):
        out = original(m, s, d)
        if type(out) is str:
            return out
        pages = dict(out.decode)
        reset = tuple((p, (page[0], 0) + page[2:])
                      for p, page in enumerate(pages.get(q, s.decode_pool[q])
                                               for q in range(len(s.decode_pool))))
        return out._replace(decode=reset)
    return decode_crash


def _dropped_bootstrap_forgets_the_tombstone(original):
    """Dropping a late bootstrap also forgets the tombstone it was dropped for."""
    def drop_bootstrap(m, s, r):
        out = original(m, s, r)
        if type(out) is str:
            return out
        (_, row), = out.rows
        return out._replace(rows=((r, row[:DST] + (D_NONE,) + row[DST + 1:]),))
    return drop_bootstrap


def _done_counts_one_page_less(original):
    """The prefill's Done announces one page fewer than it sent (a lost write on its own
    path): the count check fails a request no fault touched."""
    def send_done(m, s, r):
        out = original(m, s, r)
        if type(out) is str:
            return out
        (_, row), = out.rows
        return out._replace(rows=((r, row[:core.FW_COUNT] + (row[core.FW_COUNT] - 1,)
                                   + row[core.FW_COUNT + 1:]),))
    return send_done


# (property, action, mutant, model the checker uses)
MUTANTS = [
    ("AnswerNeverChanges", core.Finish, _finish_rewrites_any_answer, "solo"),
    ("ClosedNeverReopens", core.Accept, _late_done_reopens, "solo"),
    ("GenerationsNeverGoBack", core.DecodeCrash, _decode_restart_reissues_generations,
     "solo-decode-crash"),
    ("TombstonesStay", core.DropBootstrap, _dropped_bootstrap_forgets_the_tombstone, "solo"),
    ("NoGuardTripWithoutFault", core.SendDone, _done_counts_one_page_less, "solo"),
]
IDS = [name for name, *_ in MUTANTS]


def _patch(monkeypatch, action, mutant):
    monkeypatch.setitem(core.ACTIONS, action, mutant(core.ACTIONS[action]))
    patched = tuple((cls, core.ACTIONS[cls]) for cls, _ in core._SIMPLE_ACTIONS)
    monkeypatch.setattr(core, "_SIMPLE_ACTIONS", patched)
    monkeypatch.setattr(core, "_CACHES", {})
    if action is core.DecodeCrash:
        monkeypatch.setattr(core, "decode_crash", core.ACTIONS[action])


def _all_but(name: str) -> tuple[str, ...]:
    return tuple(n for n in (*STATE_INVARIANTS, *REST_INVARIANTS, *STEP_PROPERTIES) if n != name)


@pytest.mark.parametrize("name, action, mutant, base", MUTANTS, ids=IDS)
def test_the_correct_protocol_keeps_the_property(name, action, mutant, base):
    result = Checker(Model(**BASES[base]), invariants=(name,)).run()
    assert result.ok, result.violation


@pytest.mark.parametrize("name, action, mutant, base", MUTANTS, ids=IDS)
def test_the_checker_catches_the_mutant_and_only_this_property_does(monkeypatch, name, action,
                                                                   mutant, base):
    _patch(monkeypatch, action, mutant)
    m = Model(**BASES[base])
    result = Checker(m, invariants=(name,)).run()
    assert result.violation is not None and result.violation.property == name
    # The shortest counterexample ends with the step that breaks the promise.
    assert result.violation.length >= 1
    others = Checker(m, invariants=_all_but(name)).run()
    assert others.ok, f"{others.violation.property} also catches the {name} mutant"


@pytest.mark.parametrize("name, action, mutant, base", MUTANTS, ids=IDS)
def test_the_fuzzer_catches_the_mutant(monkeypatch, name, action, mutant, base):
    _patch(monkeypatch, action, mutant)
    outcome = run_campaign(Campaign(target="core", seed=1, examples=300, properties=(name,),
                                    shrink_seconds=0, minimize_seconds=0))
    assert outcome.caught, f"the fuzzer missed the {name} mutant"
    assert {v.property for v in outcome.replayed.violations} == {name}


def test_the_store_flags_a_changed_answer_and_a_revived_tombstone():
    m = Model(**BASES["solo"])
    store = Store(m, prefill_workers=1, decode_workers=1)
    store.arrive(0, 0, 0)
    store.take(0, core.Arrive(0, 1))
    store.take(0, core.Abort(0))
    row = store.rows[0]
    store.commit(0, core.Change(((0, row[:CLIENT] + (OK,) + row[CLIENT + 1:]),)))
    row = store.rows[0]
    store.commit(0, core.Change(((0, row[:DST] + (TOMB,) + row[DST + 1:]),)))
    row = store.rows[0]
    store.commit(0, core.Change(((0, row[:DST] + (D_WAITING,) + row[DST + 1:]),)))
    names = [v.property for v in store.violations]
    assert names[:1] == ["AnswerNeverChanges"]
    assert "TombstonesStay" in names and "ClosedNeverReopens" in names


def test_the_store_flags_a_generation_that_goes_back():
    m = Model(**BASES["solo"])
    store = Store(m, prefill_workers=1, decode_workers=1)
    owner, gen, data, tag, *cache = store.decode_pools[0][0]
    store.decode_pools[0][0] = (owner, 5, data, tag, *cache)
    store.arrive(0, 0, 0)
    store.commit(0, core.Change(decode=((0, (owner, 4, data, tag, *cache)),)))
    # (The hand-made change also unbalances the free list: the first report is the step.)
    assert [v.property for v in store.violations][:1] == ["GenerationsNeverGoBack"]


@pytest.mark.parametrize("name, action, mutant, base", MUTANTS[:4], ids=IDS[:4])
def test_the_fused_step_check_agrees_with_the_predicates(monkeypatch, name, action, mutant,
                                                         base):
    """With every property on, the checker takes all step properties in one pass
    (properties.first_step_failure): it must find what the single predicate finds."""
    _patch(monkeypatch, action, mutant)
    m = Model(**BASES[base])
    fused = Checker(m).run()
    alone = Checker(m, invariants=(name,)).run()
    assert fused.violation is not None and fused.violation.property == name
    assert fused.violation.length == alone.violation.length
