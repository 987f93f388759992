"""The Triton attention kernels on the CPU (TRITON_INTERPRET=1) against the torch
references: fp32 and fp16 (bf16 arithmetic is wrong in the interpreter), shuffled pages,
partial last pages, tag mismatches, split-K boundaries, GQA 1 and 4, dims 64 and 128."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import attention  # noqa: E402
from kernel_cases import (interpreted_modules, make_decode_case, make_foreign,  # noqa: E402
                          oracle_decode)

NAMES = ("kernels.attention_triton",)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}


@pytest.fixture(scope="module")
def triton_attention():
    (module,) = interpreted_modules(*NAMES)
    return module


def _assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128)])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_decode_matches_reference_with_a_mismatch_in_the_batch(
        triton_attention, dtype, group, head_dim, num_splits):
    # pages of 4 tokens: 5 tokens = 2 pages (partial), 13 = 4 (3 splits: 2+2+empty),
    # 1 = 1 page, 45 = 12 pages (two loop steps of 8 pages with one split)
    case = make_decode_case([5, 13, 1, 45], q_heads=2 * group, kv_heads=2,
                            head_dim=head_dim, page_tokens=4, dtype=dtype)
    make_foreign(case, sequence=1, slot=3)
    for check_tags in (True, False):
        out, tag_ok = triton_attention.paged_decode_attention(
            *case.args(), check_tags=check_tags, num_splits=num_splits)
        ref_out, ref_ok = attention.paged_decode_attention(*case.args(), check_tags=check_tags)
        assert tag_ok.tolist() == ref_ok.tolist() == [True, not check_tags, True, True]
        _assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_mismatch_is_reported_and_check_off_attends_over_the_foreign_page(
        triton_attention, num_splits):
    case = make_decode_case([9, 30], q_heads=4, kv_heads=1, head_dim=64, page_tokens=4)
    before, _ = triton_attention.paged_decode_attention(*case.args(), num_splits=num_splits)
    make_foreign(case, sequence=1, slot=5)  # page reallocated: foreign data, foreign tag
    out, tag_ok = triton_attention.paged_decode_attention(*case.args(), num_splits=num_splits)
    assert tag_ok.tolist() == [True, False]
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], before[0])
    unchecked, unchecked_ok = triton_attention.paged_decode_attention(
        *case.args(), check_tags=False, num_splits=num_splits)
    assert unchecked_ok.tolist() == [True, True]
    torch.testing.assert_close(unchecked.double(), oracle_decode(case), rtol=1e-4, atol=1e-4)
    assert (unchecked[1] - before[1]).abs().max() > 0.05, "the foreign page changed nothing"


@pytest.mark.parametrize("num_splits", [5, 16, None])
def test_more_splits_than_pages_and_automatic_splits(triton_attention, num_splits):
    case = make_decode_case([3, 17, 0, 8], q_heads=4, kv_heads=2, head_dim=64, page_tokens=4)
    out, tag_ok = triton_attention.paged_decode_attention(*case.args(), num_splits=num_splits)
    ref_out, _ = attention.paged_decode_attention(*case.args())
    assert tag_ok.tolist() == [True] * 4
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context: zeros, not NaN
    _assert_close(out, ref_out, torch.float32)


def test_gpu_sized_pages_and_dispatch_forced_to_triton(triton_attention, monkeypatch):
    case = make_decode_case([40, 70], q_heads=8, kv_heads=2, head_dim=128, page_tokens=16,
                            dtype=torch.float16)
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    out, tag_ok = kernels.paged_decode_attention(*case.args(), num_splits=2)
    ref_out, _ = attention.paged_decode_attention(*case.args())
    assert tag_ok.tolist() == [True, True]
    _assert_close(out, ref_out, torch.float16)


def test_a_bad_page_id_in_the_context_is_a_mismatch(triton_attention):
    case = make_decode_case([8, 8], page_tokens=4)
    case.block_table[0, 2] = 0  # past sequence 0's context: never read nor checked
    case.expected_tags[0, 2] = 12345
    case.block_table[1, 1] = -1
    out, tag_ok = triton_attention.paged_decode_attention(*case.args(), num_splits=2)
    assert tag_ok.tolist() == [True, False]
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("start_pos,new_tokens,group,head_dim",
                         [(0, 7, 1, 64), (5, 20, 4, 64), (9, 3, 2, 128)])
def test_prefill_matches_reference(triton_attention, dtype, start_pos, new_tokens, group,
                                   head_dim):
    case = make_decode_case([start_pos + new_tokens], q_heads=2 * group, kv_heads=2,
                            head_dim=head_dim, page_tokens=4, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(new_tokens, 2 * group, head_dim, generator=gen).to(dtype)
    row = case.block_table[0]
    out = triton_attention.paged_prefill_attention(q, case.kv, case.layer, row, start_pos,
                                                   case.scale)
    expected = attention.paged_prefill_attention(q, case.kv, case.layer, row, start_pos,
                                                  case.scale)
    _assert_close(out, expected, dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN
@pytest.mark.parametrize("num_splits", [1, 3])
def test_foreign_page_full_of_nan_and_inf_cannot_leak(triton_attention, num_splits):
    """The K/V loads do not wait for the tag compare, so a foreign page's bytes reach the
    registers; a NaN or inf there must still leave the output of a mismatched sequence
    all zeros and every other sequence untouched."""
    case = make_decode_case([12, 12], q_heads=2, kv_heads=1, page_tokens=4)
    before, _ = triton_attention.paged_decode_attention(*case.args(), num_splits=num_splits)
    page = make_foreign(case, sequence=1, slot=1)
    case.kv[page, :, 0, :, 0] = float("inf")
    case.kv[page, :, 1, :, 1] = float("nan")
    out, tag_ok = triton_attention.paged_decode_attention(*case.args(), num_splits=num_splits)
    assert tag_ok.tolist() == [True, False]
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], before[0])
