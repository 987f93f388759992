"""engine/graphs.py on the CPU: the padded, static-buffer decode path that CUDA graphs
replay, run eagerly (no capture here). It must give the plain decode's logits and tag
verdicts, its padding rows must touch no page but the scratch page, and the region a
graph would record must ask the device for nothing (checked with a dispatch mode that
refuses every op that reads a device value on the host)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kernels  # noqa: E402
from engine.generate import Generator, GeneratorConfig, Request, decode_step  # noqa: E402
from engine.graphs import DecodeGraphs, buckets_for  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from graph_cases import (LOGITS_ATOL, PAGE_TOKENS, decode_both_ways, pages_changed,  # noqa: E402
                         running_batch, tiny_model, written_pages)

def test_buckets_are_powers_of_two_up_to_max_batch():
    assert buckets_for(1) == (1,)
    assert buckets_for(5) == (1, 2, 4, 8)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32, 64)


def test_padded_decode_gives_the_plain_decode_logits_and_verdicts():
    """Five sequences of 2..23 tokens padded to bucket 8, tables 8 pages wide instead of
    6: the same logits (fp32), all tags passing, and distinct rows (not a trivial match)."""
    generator, sequences = running_batch(tiny_model())
    assert generator.graphs.bucket(len(sequences)) == 8
    logits, tag_ok, padded_logits, padded_tag_ok, _ = decode_both_ways(generator, sequences)
    assert padded_logits.shape == logits.shape == (5, 211)
    torch.testing.assert_close(padded_logits, logits, rtol=0, atol=LOGITS_ATOL)
    assert tag_ok.tolist() == padded_tag_ok.tolist() == [True] * 5
    assert min((logits[i] - logits[j]).abs().max() for i in range(5) for j in range(i)) > 0.1


def test_padding_rows_write_the_scratch_page_and_no_real_page():
    """Pool bytes and tags: only the pages the five sequences write this step and the
    scratch page change; every other page (stale data of nobody, or of others) keeps its
    bytes, and no tag changes."""
    generator, sequences = running_batch(tiny_model())
    pool, scratch = generator.pool, generator.graphs.scratch_page
    tags_before = pool.tags.clone()
    *_, kv_before = decode_both_ways(generator, sequences)
    assert pages_changed(kv_before, pool.kv) == written_pages(sequences) | {scratch}
    assert torch.equal(pool.tags, tags_before)
    assert scratch not in {page for s in sequences for page in s.pages}


def test_a_wrong_padding_target_would_be_caught():
    """The checks above can fail: padding aimed at a free page holding stale KV changes
    that page; aimed at slot 0 of a running sequence's first page, it changes that
    sequence's logits."""
    generator, sequences = running_batch(tiny_model())
    model, pool = generator.model, generator.pool
    free_page = generator.free_pages.take(1)[0]
    stale = DecodeGraphs(model, pool, scratch_page=free_page, max_batch=8, max_pages=8)
    *_, kv_before = decode_both_ways(generator, sequences, graphs=stale)
    assert free_page in pages_changed(kv_before, pool.kv) - written_pages(sequences)

    victim = sequences[3].pages[0]
    foreign = DecodeGraphs(model, pool, scratch_page=victim, max_batch=8, max_pages=8)
    logits, _, padded_logits, _, _ = decode_both_ways(generator, sequences, graphs=foreign)
    assert (padded_logits[3] - logits[3]).abs().max() > 1e-2


def test_a_tag_mismatch_fails_only_its_own_sequence():
    """One page of sequence 2 re-tagged (as if reallocated): the padded step says so for
    sequence 2 alone, like the plain step, and the others' logits are unchanged."""
    generator, sequences = running_batch(tiny_model())
    pool = generator.pool
    clean_logits, *_ = decode_both_ways(generator, sequences)
    pool.set_tags([sequences[2].pages[1]], [kernels.pack_tag(99, 1)])
    logits, tag_ok, padded_logits, padded_tag_ok, _ = decode_both_ways(generator, sequences)
    assert tag_ok.tolist() == padded_tag_ok.tolist() == [True, True, False, True, True]
    others = [0, 1, 3, 4]
    torch.testing.assert_close(padded_logits[others], logits[others], rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(padded_logits[others], clean_logits[others], rtol=0,
                               atol=LOGITS_ATOL)


def test_generator_with_graphs_gives_the_same_tokens_and_logits(monkeypatch):
    """Whole runs, continuous batching (buckets 1, 2 and 4 in turn) and a sequence too
    long for 4-page tables (batches holding it take the eager path): the same tokens
    and logits at every step."""
    model = tiny_model()
    tokens = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(1, 211, (n,), generator=tokens).tolist())
               for n in (2, 11, 5, 20, 7, 3)]
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=7)
    completions, used = {}, []
    original = DecodeGraphs.decode
    monkeypatch.setattr(DecodeGraphs, "decode",
                        lambda self, batch: used.append(len(batch.token_ids)) or
                        original(self, batch))
    for graphs in (False, True):
        generator = Generator(model, GeneratorConfig(
            num_pages=40, page_tokens=PAGE_TOKENS, max_batch=4, prefill_chunk_tokens=9,
            shuffle_pages_seed=2, keep_logits=True, cuda_graphs=graphs, graph_max_pages=4))
        completions[graphs] = generator.run([Request(i, p, sampling)
                                             for i, p in enumerate(prompts)])
    for plain, padded in zip(completions[False], completions[True]):
        assert plain.output_ids == padded.output_ids and len(plain.output_ids) == 6
        torch.testing.assert_close(torch.stack(padded.logits), torch.stack(plain.logits),
                                   rtol=0, atol=LOGITS_ATOL)
    assert {1, 2, 3} <= set(used), used  # buckets 1, 2 and 4 (one padding row)
    assert generator.stats.decode_steps > len(used), "the long sequence ran eagerly"


class RefuseHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Raises on every op that hands a device value to the host: what a CUDA graph
    capture cannot hold (.item(), bool(), int(), torch.equal, nonzero; under inference
    mode int() dispatches as aten::item). `.tolist()` on a CPU tensor reads memory
    without dispatching, so it is refused by replacing it while the mode is on."""
    REFUSED = ("aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::nonzero",
               "aten::is_nonzero")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.REFUSED:
            raise AssertionError(f"host read inside the graph region: {func._schema.name}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def refused(tensor):
            raise AssertionError("host read inside the graph region: tolist")

        torch.Tensor.tolist = refused
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def test_the_recorded_region_reads_nothing_back_on_the_triton_path(monkeypatch):
    """The step a graph records, with the Triton kernel CUDA tensors take (interpreted
    here, head dim 64), under a mode refusing host reads: it runs, and its logits and
    verdicts equal the torch path's. The same mode does catch the plain torch decode
    (its plan reads context lengths back), and the rotary table's growth check."""
    model = tiny_model(head_dim=64, num_heads=2, num_kv_heads=1, num_layers=1)
    generator, sequences = running_batch(model)
    graphs = generator.graphs
    logits, tag_ok, *_ = decode_both_ways(generator, sequences)
    decode_step(model, generator.pool, sequences, graphs=graphs)  # fills bucket 8's buffers
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    with RefuseHostReads():
        padded_logits, padded_tag_ok = graphs._run(8)
    torch.testing.assert_close(padded_logits[:5], logits, rtol=0, atol=1e-4)
    assert padded_tag_ok[:5].tolist() == tag_ok.tolist() == [True] * 5
    static = graphs._static[8]
    with pytest.raises(AssertionError, match="host read"), RefuseHostReads():
        model.decode(generator.pool, static)  # the rotary table's max(position)
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    with pytest.raises(AssertionError, match="host read"), RefuseHostReads():
        graphs._run(8)
