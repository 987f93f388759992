"""Wire and device faults (engine/transport.py's fault hook, fuzz/wire_faults.py's moves).

Pinned: each fault on the engine ends as it must (a bit flip or a torn page: ErrTransfer,
the checksum guard; a write that never lands: ErrTransfer, decode's count of pages landed;
a duplicate or a reordered landing: Ok, with the tokens of the run without the fault), and
never with a token streamed; the hook is off by default. At the fuzz level, one mutant per
blind spot, kept here as the core's are in tests/test_step_properties.py: a checksum
reported good without being computed is caught by a bit flip, and a count check removed
is caught by a write that never lands, both by the wire-fault oracle (a damaged request
starts decoding). The correct engine with wire faults on is the engine zoo's none row
(tests/test_fuzz.py), which must end clean.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine.pool import KVPool  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import Finished, GenerationRequest, TokenOut  # noqa: E402
from engine.transport import WIRE_FAULTS, PageWrite  # noqa: E402
from engine.workers import DecodeWorker  # noqa: E402
from fuzz import wire_faults  # noqa: E402
from fuzz.engine_target import tiny_model  # noqa: E402
from fuzz.runner import Campaign, run_campaign  # noqa: E402
from spec import core  # noqa: E402

STEPS_MAX = 200


def one_request(fault: str | None, page_index: int = 0):
    """One request of 5 prompt tokens and 3 output tokens (4 pages of 2 tokens, so 4
    writes); `fault` strikes its write into the `page_index`-th page of its table. Returns
    (outcome, guard, tokens)."""
    rt = Runtime(tiny_model(), RuntimeConfig(prefill_pages=8, decode_pages=8, page_tokens=2,
                                             context_tokens=16, prefill_chunk_tokens=4,
                                             lease_s=1e9, transfer_timeout_s=1e9))
    rt.transport.fault_injection = fault is not None
    rt.transport.paused = True
    events = []
    r = rt.arrive(GenerationRequest((5, 9, 2, 7, 11), SamplingParams(max_tokens=3,
                                                                      ignore_eos=True)),
                  events.append)
    for _ in range(STEPS_MAX):
        if len(rt.transport.writes_of(r)) == 4:
            break
        rt.step()
    table = rt.store.rows[r][core.TABLE]
    if fault is not None:
        page = table[page_index][0]
        write, = (w for w in rt.transport.writes_of(r) if w.decode_page == page)
        rt.transport.inject(write, fault)
    rt.transport.paused = False
    for _ in range(STEPS_MAX):
        if rt.idle:
            break
        rt.step()
    assert rt.whole(), "every page back, nothing in flight"
    end, = (e for e in events if isinstance(e, Finished))
    return end.outcome, end.guard, [e.token_id for e in events if isinstance(e, TokenOut)]


def test_the_fault_names_are_the_transports():
    assert wire_faults.FAULT_NAMES == WIRE_FAULTS


def test_fault_injection_is_off_by_default():
    rt = Runtime(tiny_model(), RuntimeConfig(prefill_pages=4, decode_pages=4, page_tokens=2,
                                             context_tokens=8))
    assert not rt.transport.fault_injection
    with pytest.raises(AssertionError, match="fault injection is off"):
        rt.transport.inject(None, "flip")


@pytest.mark.parametrize("fault, guard", [("flip", "checksum"), ("torn", "checksum"),
                                          ("lost", "count")])
def test_a_damaging_fault_fails_the_transfer_before_any_token(fault, guard):
    assert one_request(fault) == ("ErrTransfer", guard, [])


@pytest.mark.parametrize("fault", ["duplicate", "reorder"])
def test_a_duplicate_or_reordered_landing_changes_nothing(fault):
    clean = one_request(None)
    assert clean[0] == "Ok" and len(clean[2]) == 3
    assert one_request(fault) == clean


def test_a_torn_write_over_identical_bytes_damages_nothing():
    # The last page holds no prompt token: its source bytes are the fresh pool's zeros, as
    # are the decode page's, so half of them landing is all of them landing.
    outcome, _, tokens = one_request("torn", page_index=3)
    assert outcome == "Ok" and len(tokens) == 3


# -- the fuzzer against mutants of the data path's guards --------------------------------

def _checksum_never_computed(pool, pages, expected_checksums):
    return torch.ones(len(pages), dtype=torch.bool)  # "good", whatever the bytes


def _no_count_check(original):
    def transfer_fault(self, request, announced):
        return original(self, request, len(self.received.get(request, {})))
    return transfer_fault


WIRE_SEED, WIRE_EXAMPLES = 0, 60


def _campaign():
    return run_campaign(Campaign(target="engine", seed=WIRE_SEED, examples=WIRE_EXAMPLES,
                                 shrink_seconds=0, minimize_seconds=0))


@pytest.mark.slow
def test_the_fuzzer_catches_a_checksum_reported_good_without_being_computed(monkeypatch):
    monkeypatch.setattr(KVPool, "verify", _checksum_never_computed)
    outcome = _campaign()
    assert outcome.caught, "a bit flip must expose a checksum that is never computed"
    assert any("wire-fault oracle" in v.detail for v in outcome.replayed.violations)


@pytest.mark.slow
def test_the_fuzzer_catches_a_count_check_removed(monkeypatch):
    monkeypatch.setattr(DecodeWorker, "transfer_fault",
                        _no_count_check(DecodeWorker.transfer_fault))
    outcome = _campaign()
    assert outcome.caught, "a write that never lands must expose a missing count check"
    assert any("landed lost" in v.detail for v in outcome.replayed.violations)


def test_a_lost_write_is_not_offered_where_a_landing_can_be_stale():
    """Under EagerRelease a lost write could land after its page moved on, and the core's
    page contents (which say it landed) would then be wrong: no lost write there."""
    def offered(bugs):
        rt = Runtime(tiny_model(), RuntimeConfig(prefill_pages=4, decode_pages=4, page_tokens=2,
                                                 context_tokens=8, bugs=bugs))
        rt.on_commit = lambda event, change: None
        return {wire_faults.FAULT_NAMES[k] for k in wire_faults.WireFaults(rt).offered}
    assert offered(frozenset()) == set(wire_faults.FAULT_NAMES)
    assert offered(frozenset({"EagerRelease"})) == set(wire_faults.FAULT_NAMES) - {"lost"}


def test_a_wire_fault_move_is_saved_and_replayed_as_it_was():
    from fuzz.replay import decode_event, encode_event

    event = wire_faults.WireFault(2, 7, wire_faults.LOST)
    assert encode_event(event) == {"a": "WireFault", "request": 2, "page": 7, "fault": 4}
    assert decode_event(encode_event(event)) == event
    assert event.label() == "WireFault(r3, page 8, lost)"


def test_a_torn_write_lands_exactly_its_first_half():
    """The fault itself, byte for byte (a mutant that tore at 0 bytes still failed the
    transfer, and so survived the outcome tests)."""
    rt = Runtime(tiny_model(), RuntimeConfig(prefill_pages=2, decode_pages=2, page_tokens=2,
                                             context_tokens=4))
    transport = rt.transport
    transport.fault_injection = True
    source, target = transport.sources[0], transport.targets[0]
    source.kv[0] = torch.arange(source.kv[0].numel(), dtype=source.kv.dtype).view_as(source.kv[0])
    target.kv[1] = -1.0
    write = PageWrite(0, 0, 1, 1, 0)
    transport.post(write)
    transport.inject(write, "torn")
    assert transport.ready() == [write]
    transport.land(write)
    sent, landed = source.pack([0])[0], target.pack([1])[0]
    half = sent.numel() // 2
    assert torch.equal(landed[:half], sent[:half]) and bool((landed[half:] == -1.0).all())
    assert transport.damaged == {write: "torn"}


def test_stopping_one_prefill_request_keeps_the_others_computing():
    """A mutation survivor of bench/mutation.py (PrefillWorker.stop keeping only higher
    request ids): stopping r2 must leave r1 and r3 computing."""
    from engine.generate import Request
    from engine.pool import PoolConfig
    from engine.workers import PrefillWorker

    model = tiny_model()
    worker = PrefillWorker(model, PoolConfig.for_model(model.config, 6, 2, model.dtype,
                                                       model.device), chunk_tokens=4)
    params = SamplingParams(max_tokens=1)
    for r in range(3):
        worker.start(Request(r, (1, 2, 3), params), (2 * r, 2 * r + 1))
    worker.stop(1)
    assert [s.request.request_id for s in worker.computing] == [0, 2]
