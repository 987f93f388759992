"""n > 1 siblings in the protocol-driven engine (issue 27's rule, issue 28's engine): the
completions of one prompt share its pages through decode's prefix cache. With the cache on,
the siblings go on the first's workers and each waits for the first's transfer
(core.sibling_waits), then reserves a full decode-side hit of the prompt's full pages; the
tokens are what each gets alone (greedy), and only the first's full pages are transferred.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.model import LlamaModel  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import Finished, GenerationRequest  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402
from engine_cases import make_hf_model  # noqa: E402
from spec import core  # noqa: E402
from test_engine_prefix import PAGE, Recorder, drain, ids  # noqa: E402

N = 4
PROMPT = ids(300, 14)  # three full pages and two tokens of a fourth


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-gqa")
    make_hf_model("llama-gqa", folder)
    return LlamaModel(load_checkpoint(folder))


def serve(model, prefix_cache: bool, group: int | None):
    rt = Runtime(model, RuntimeConfig(prefill_pages=64, decode_pages=64, page_tokens=PAGE,
                                      context_tokens=64, prefill_chunk_tokens=8,
                                      transfer_timeout_s=1e9, lease_s=1e9, decode_workers=2,
                                      prefill_workers=2, prefix_cache=prefix_cache))
    recorder = Recorder(rt)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    reserved_at: dict[int, tuple] = {}  # request -> (step, its workers)
    accepted: list[int] = []
    steps = [0]

    def on_commit(event, change):
        if type(event) is core.Reserve:
            reserved_at[event.request] = (steps[0], rt.store.placement[event.request])
        if type(event) is core.Accept and event.request == 0:
            accepted.append(steps[0])
    rt.on_commit = on_commit
    for _ in range(N):
        rt.arrive(GenerationRequest(PROMPT, sampling, sibling_group=group), recorder)
    for _ in range(3000):
        if rt.idle:
            break
        steps[0] += 1
        rt.step()
    drain(rt)
    return rt, recorder, reserved_at, accepted


def test_siblings_share_the_prompts_pages_and_get_what_each_gets_alone(model):
    _, alone, _, _ = serve(model, prefix_cache=False, group=None)
    rt, got, reserved_at, accepted = serve(model, prefix_cache=True, group=7)
    assert all(got.ends[r].outcome == "Ok" for r in range(N))
    assert all(got.tokens[r] == alone.tokens[r] for r in range(N))
    # Each sibling, on the first's workers, reserved once the first's transfer was
    # accepted, and hit its 3 full pages at decode: sent once, by the first; the partial
    # fourth page is each one's own.
    assert len({workers for _, workers in reserved_at.values()}) == 1
    assert accepted and all(reserved_at[r][0] >= accepted[0] for r in range(1, N))
    assert [got.ends[r].cached_tokens for r in range(N)] == [0] + [3 * PAGE] * (N - 1)
    pages = -(-(len(PROMPT) + 5 - 1) // PAGE)
    assert rt.transport.writes_landed == pages + (N - 1) * (pages - 3)
    assert rt.store.violation_total == 0 and rt.whole()


def test_without_a_group_the_same_prompts_are_placed_apart_and_miss(model):
    """The policy is the group's: the same four prompts without one are placed by the
    router (over two workers of each kind) and reserve at once, all misses."""
    rt, got, reserved_at, _ = serve(model, prefix_cache=True, group=None)
    assert [got.ends[r].cached_tokens for r in range(N)] == [0] * N
    assert len({workers for _, workers in reserved_at.values()}) > 1
    pages = -(-(len(PROMPT) + 5 - 1) // PAGE)
    assert rt.transport.writes_landed == N * pages
