"""engine/graphs.py captured on a CUDA device: one graph per bucket, replayed. Capture
itself fails on any host sync in the recorded region, so a capture that succeeds is the
proof that none is there. Replays must give the eager CUDA decode's logits and verdicts,
write no page but the scratch page and the batch's own slots, follow new inputs step
after step (a whole Generator run), and issue no synchronizing call. Skipped here (no
GPU); bench/device_check.sh runs it.

    TRITON_INTERPRET=0 python -m pytest -q -o addopts="" tests/test_engine_graphs_cuda.py
    TRITON_INTERPRET=0 PYTHONPATH=.:tests python tests/test_engine_graphs_cuda.py"""

from __future__ import annotations

import sys

import torch

import kernels
import graph_cases as cases
from cuda_cases import run_as_script, skip_marks
from engine.generate import Generator, GeneratorConfig, Request, decode_batch
from engine.sampling import SamplingParams

pytestmark = skip_marks()

# Logits of order 1-5. fp32 is the tight check; in bf16 the logits themselves are rounded
# to ~0.016 near 3 and the padded batch's matmuls may take other cuBLAS kernels than the
# unpadded one's, so bf16 only shows the replay runs and agrees to a few ulps (a wrong
# page or position moves bf16 logits by far more).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}


def cuda_model(dtype=torch.float32):
    """The graph tests' tiny model with head dim 64 (the Triton kernel's smallest), on CUDA."""
    return cases.tiny_model(head_dim=64, num_heads=4, num_kv_heads=2, device="cuda",
                                dtype=dtype)


def test_captured_replay_equals_the_eager_cuda_decode():
    """fp32 and bf16: five sequences in bucket 8, replayed; the eager CUDA decode of the
    same pool state gives the same logits and verdicts; only the batch's written pages and
    the scratch page change."""
    for dtype, tolerance in TOLERANCE.items():
        generator, sequences = cases.running_batch(cuda_model(dtype))
        assert generator.graphs.captured
        tags_before = generator.pool.tags.clone()
        logits, tag_ok, padded_logits, padded_tag_ok, kv_before = cases.decode_both_ways(
            generator, sequences)
        torch.testing.assert_close(padded_logits, logits, rtol=0, atol=tolerance)
        assert tag_ok.tolist() == padded_tag_ok.tolist() == [True] * 5
        changed = cases.pages_changed(kv_before, generator.pool.kv)
        assert changed == cases.written_pages(sequences) | {generator.graphs.scratch_page}
        assert torch.equal(generator.pool.tags, tags_before)


def test_a_tag_mismatch_fails_only_its_own_sequence_in_the_replay():
    generator, sequences = cases.running_batch(cuda_model())
    generator.pool.set_tags([sequences[2].pages[1]], [kernels.pack_tag(99, 1)])
    logits, tag_ok, padded_logits, padded_tag_ok, _ = cases.decode_both_ways(
        generator, sequences)
    assert tag_ok.tolist() == padded_tag_ok.tolist() == [True, True, False, True, True]
    others = [0, 1, 3, 4]
    torch.testing.assert_close(padded_logits[others], logits[others], rtol=0,
                               atol=TOLERANCE[torch.float32])


def test_replays_follow_new_inputs_through_a_whole_run():
    """Generator runs with and without graphs (fp32, continuous batching over buckets 1-4,
    one sequence too long for the graphs' tables): the same tokens and logits."""
    model = cuda_model()
    tokens = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(1, 211, (n,), generator=tokens).tolist())
               for n in (2, 11, 5, 20, 7, 3)]
    sampling = SamplingParams(max_tokens=6)
    runs = {}
    for graphs in (False, True):
        generator = Generator(model, GeneratorConfig(
            num_pages=40, page_tokens=cases.PAGE_TOKENS, max_batch=4, prefill_chunk_tokens=9,
            shuffle_pages_seed=2, keep_logits=True, cuda_graphs=graphs, graph_max_pages=4))
        runs[graphs] = generator.run([Request(i, p, sampling) for i, p in enumerate(prompts)])
    for plain, replayed in zip(runs[False], runs[True]):
        assert plain.output_ids == replayed.output_ids
        torch.testing.assert_close(torch.stack(replayed.logits), torch.stack(plain.logits),
                                   rtol=0, atol=TOLERANCE[torch.float32])


def test_filling_and_replaying_issue_no_synchronizing_call():
    """torch's sync debug mode set to error around DecodeGraphs.decode (inputs already on
    the device): the copies into the static buffers, the replay and the output clones."""
    generator, sequences = cases.running_batch(cuda_model())
    graphs = generator.graphs
    batch = decode_batch(generator.model, generator.pool, sequences, graphs.max_pages)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits, tag_ok = graphs.decode(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tag_ok.tolist() == [True] * 5 and logits.shape == (5, 211)


if __name__ == "__main__":
    sys.exit(run_as_script(globals()))
