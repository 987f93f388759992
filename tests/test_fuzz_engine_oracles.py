"""The engine fuzz target's oracles have teeth: one deliberately broken engine per blind spot
of issue 24, each caught by the engine fuzz target (fuzz/engine_target.py, judged against
fuzz/engine_reference.py's independent forward), and the correct engine clean on the same
campaigns.

The mutants, each a monkeypatch of one engine function (the blind spot it stands for):
- `decode_page_start_misplaced`: decode writes the K/V of a token that starts a new page
  into the previous page (one-shape requests: one decode step at an odd position never
  starts a page);
- `chunk_crossing_a_page_misplaced`: a prefill chunk that starts mid-page writes the
  positions of the next page into the page before (the old leak oracle read its "own KV"
  back from the prefill pool this bug corrupts, and compared it with itself);
- `tokens_before_the_tag_verdict`: decode streams the tokens of steps whose tag check
  failed and fails the request only at Finish (only Ok outcomes were judged);
- `startup_check_skipped`: the startup capacity check advertises the configured context
  whatever the pools hold (the target built a Runtime directly, past the check);
- `context_one_short`: decode attends every position but the token it just wrote, in
  `decode_batch`, which the Generator shares: the Generator-comparison tests pass on it.

Four run as fuzz campaigns (a few examples each, seed 0: each is caught within 3 to 4
examples there, within 10 on seeds 0-2). The late write of `tokens_before_the_tag_verdict`
needs an interleaving the fuzzer finds about once in a few hundred examples, so its test
drives the fuzz target through that interleaving with the target's own moves and judges
it with the fuzzer's own checks after every move.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from engine import generate, serving  # noqa: E402
from engine.generate import Generator, GeneratorConfig, Request  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import GenerationRequest, TokenOut  # noqa: E402
from engine.workers import DecodeWorker  # noqa: E402
from fuzz import engine_target  # noqa: E402
from fuzz.engine_target import PAGE_TOKENS, EngineTarget, tiny_model  # noqa: E402
from fuzz.oracles import LEAK_ORACLE, Checks, check  # noqa: E402
from fuzz.target import Open, Wait  # noqa: E402
from spec import core  # noqa: E402
from spec.model import Model  # noqa: E402
from fuzz.runner import Campaign, run_campaign  # noqa: E402

LEAK_PROPERTIES = ("Isolation", "OkIsClean")


def decode_page_start_misplaced(original):
    def decode_batch(model, pool, sequences, table_pages):
        batch = original(model, pool, sequences, table_pages)
        pt = pool.page_tokens
        slots = batch.slots.clone()
        for i, position in enumerate(batch.positions.tolist()):
            if position % pt == 0:  # a new page: written at the end of the one before
                slots[i] = batch.block_table[i, position // pt - 1] * pt + pt - 1
        return dataclasses.replace(batch, slots=slots)
    return decode_batch


def context_one_short(original):
    def decode_batch(model, pool, sequences, table_pages):
        batch = original(model, pool, sequences, table_pages)
        return dataclasses.replace(batch, context_lengths=batch.context_lengths - 1)
    return decode_batch


def chunk_crossing_a_page_misplaced(original):
    def slots_for(sequence, positions, page_tokens):
        slots = original(sequence, positions, page_tokens)
        if int(positions[0]) % page_tokens == 0:
            return slots
        pages = sequence.page_tensor.long()[(positions - 1) // page_tokens]
        return pages * page_tokens + positions % page_tokens
    return slots_for


def tokens_before_the_tag_verdict(original):
    def step(self):
        """DecodeWorker.step with every row's logits and a pass, whatever the kernel's tag
        verdict: the runtime streams them, and only Finish's look at the tags fails it."""
        batch = self.running[:self.max_batch]
        if not batch:
            return []
        logits, _ = generate.decode_step(self.model, self.pool, batch, check_tags=True)
        return [(s, True, logits[i]) for i, s in enumerate(batch)]
    return step


def startup_check_skipped(original):
    def advertised_context(config, model_context):
        return original(dataclasses.replace(config, bugs=config.bugs | {"PoolBelowContext"}),
                        model_context)
    return advertised_context


# (name, module, attribute, mutant, bugs, properties, seed, examples)
MUTANTS = [
    ("decode_page_start_misplaced", generate, "decode_batch", decode_page_start_misplaced,
     frozenset(), None, 0, 6),
    ("chunk_crossing_a_page_misplaced", generate, "slots_for", chunk_crossing_a_page_misplaced,
     frozenset(), None, 0, 6),
    ("startup_check_skipped", serving, "advertised_context", startup_check_skipped,
     frozenset(), None, 0, 6),
    ("context_one_short", generate, "decode_batch", context_one_short,
     frozenset(), None, 0, 6),
]
IDS = [m[0] for m in MUTANTS]


def _patch(monkeypatch, module, attribute, mutant):
    monkeypatch.setattr(module, attribute, mutant(getattr(module, attribute)))


def _campaign(bugs, properties, seed, examples):
    return run_campaign(Campaign(target="engine", bugs=bugs, properties=properties,
                                 seed=seed, examples=examples, shrink_seconds=0,
                                 minimize_seconds=0.5))


@pytest.mark.parametrize("name, module, attribute, mutant, bugs, properties, seed, examples",
                         MUTANTS, ids=IDS)
def test_the_engine_fuzz_target_catches_the_mutant(monkeypatch, name, module, attribute,
                                                   mutant, bugs, properties, seed, examples):
    _patch(monkeypatch, module, attribute, mutant)
    outcome = _campaign(bugs, properties, seed, examples)
    assert outcome.caught, f"the engine fuzz target missed the {name} mutant"
    expected = "FittingRequestsSucceed" if name == "startup_check_skipped" else LEAK_ORACLE
    assert outcome.replayed.property == expected, outcome.replayed


def test_the_correct_engine_is_clean_on_the_same_campaign():
    """The campaign every mutant above runs (no switch, every property, seed 0, 6
    examples; each mutant is caught within 3 or 4 of them), on the correct engine."""
    outcome = _campaign(frozenset(), None, 0, 6)
    assert not outcome.caught, outcome.replayed


def test_the_generator_comparison_cannot_see_a_shared_decode_batch_bug(monkeypatch):
    """Why the reference shares nothing with the engine: with `context_one_short`, the
    protocol-driven workers and the one-process Generator still agree token for token
    (both build their decode inputs with decode_batch), while the fuzz target above catches
    it."""
    monkeypatch.setattr(generate, "decode_batch", context_one_short(generate.decode_batch))
    model = tiny_model()
    prompt, params = (5, 9, 2, 33, 7), SamplingParams(max_tokens=6, ignore_eos=True)
    expected = Generator(model, GeneratorConfig(num_pages=16, page_tokens=PAGE_TOKENS)).run(
        [Request(0, prompt, params)])[0].output_ids
    rt = Runtime(model, RuntimeConfig(prefill_pages=16, decode_pages=16,
                                      page_tokens=PAGE_TOKENS, context_tokens=32))
    tokens = []
    rt.arrive(GenerationRequest(prompt, params),
              lambda e: tokens.append(e.token_id) if isinstance(e, TokenOut) else None)
    for _ in range(100):
        if rt.idle:
            break
        rt.step()
    assert tokens == list(expected) and len(tokens) == 6


class Driven:
    """The engine fuzz target on model `m`, moved by its own moves, every check of the fuzz
    target's (fuzz.oracles.check with `properties`) after each move, the findings kept."""

    def __init__(self, m: Model, properties) -> None:
        self.m, self.checks, self.found = m, Checks.for_properties(properties), []
        self.target = EngineTarget()
        self.target.reset(m, 0)
        self.rt = self.target.rt

    def move(self, event) -> None:
        self.target.step(event)
        self.found.extend(check(self.checks, self.m, self.target))

    def wait_until(self, condition) -> None:
        for _ in range(50):
            if condition():
                return
            self.move(Wait())
        raise AssertionError("the condition never held")


def _late_write_into_a_decoding_request(monkeypatch) -> tuple[EngineTarget, list]:
    """EagerRelease on the fuzz target, moved by its own moves: x is aborted while its
    writes are held on the wire, decode frees its pages at once, y reserves them and
    decodes (a long output), and then x's writes land in y's pages (the engine's
    `land_only`, as the fuzz target's Delay ending would). Every check is the fuzz
    target's own (fuzz.oracles.check with the leak oracle's properties), after every move."""
    monkeypatch.setattr(engine_target, "request_shape", lambda rng, pages: (
        PAGE_TOKENS, pages * PAGE_TOKENS + 1 - PAGE_TOKENS))  # a page of prompt, then output
    m = Model(requests=2, max_prompt_pages=8, context_pages=8, prefill_pages=16,
              decode_pages=16, bugs=frozenset({"EagerRelease"}))
    driven = Driven(m, LEAK_PROPERTIES)
    target, found, rt, move, wait_until = (driven.target, driven.found, driven.rt,
                                           driven.move, driven.wait_until)
    move(Open("Arrive", 0, 0, (3,)).close(3))
    wait_until(lambda: any(w.request == 0 for w in rt.transport.writes_of_all()))
    move(Open("Delay", 0, 0, (30,)).close(30))
    move(core.Abort(0))
    wait_until(lambda: 0 not in rt.store.rows or rt.store.rows[0][core.DST] == core.RELEASED)
    move(Open("Arrive", 1, 0, (8,)).close(8))
    wait_until(lambda: 1 in rt.store.rows and rt.store.rows[1][core.DST] == core.DECODING)
    assert {p for p, _ in rt.store.rows[1][core.TABLE]} >= {w.decode_page for w in
                                                           rt.transport.writes_of_all()}
    assert rt.land_only(lambda w: w.request == 0) > 0  # x's late writes, into y's pages
    wait_until(lambda: 1 not in rt.live)
    return target, found


def test_a_token_streamed_before_an_error_is_judged(monkeypatch):
    """tokens_before_the_tag_verdict: y streams tokens computed over x's late write, then
    fails its tag check at Finish (ErrTag). The fuzz target reports the first such token;
    the correct engine streams none of them."""
    monkeypatch.setattr(DecodeWorker, "step", tokens_before_the_tag_verdict(DecodeWorker.step))
    target, found = _late_write_into_a_decoding_request(monkeypatch)
    assert target._outcomes[1] == "ErrTag"
    assert [v.property for v in found][:1] == [LEAK_ORACLE], found
    assert "r2 streamed token" in found[0].detail
    assert "held a tag other than its reservation's" in found[0].detail


def test_the_correct_engine_streams_nothing_from_the_late_write(monkeypatch):
    target, found = _late_write_into_a_decoding_request(monkeypatch)
    assert target._outcomes[1] == "ErrTag"
    assert found == []
