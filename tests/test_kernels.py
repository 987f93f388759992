"""kernels/: the torch references against plain oracles, the tags, the dispatch.
(The Triton kernels against these references: tests/test_kernels_triton*.py.)"""

from __future__ import annotations

import pathlib

import pytest

torch = pytest.importorskip("torch")

import kernels  # noqa: E402
from kernels import FRESH_TAG, attention, checksum, pack, pack_tag, unpack_tag  # noqa: E402
from kernel_cases import (make_decode_case, make_foreign, oracle_decode,  # noqa: E402
                          oracle_digest, oracle_prefill)

KERNELS_DIR = pathlib.Path(kernels.__file__).parent


# --- tags ------------------------------------------------------------------------------

def test_tags_round_trip_and_fresh_tag_is_never_issued():
    for owner, generation in [(0, 0), (1, 7), (2**31 - 1, 2**32 - 1), (12345, 2**31)]:
        tag = pack_tag(owner, generation)
        assert tag >= 0 and tag != FRESH_TAG
        assert unpack_tag(tag) == (owner, generation)
    assert pack_tag(3, 5) == 3 * 2**32 + 5
    for bad in [(-1, 0), (2**31, 0), (0, 2**32), (0, -1)]:
        with pytest.raises(AssertionError):
            pack_tag(*bad)
    with pytest.raises(AssertionError):
        unpack_tag(FRESH_TAG)


# --- decode attention --------------------------------------------------------------------

@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(2, 2, 64), (8, 2, 128), (4, 1, 64)])
def test_decode_reference_matches_oracle_on_shuffled_partial_pages(q_heads, kv_heads, head_dim):
    case = make_decode_case([5, 12, 1, 9], q_heads=q_heads, kv_heads=kv_heads,
                            head_dim=head_dim, page_tokens=4)
    out, tag_ok = attention.paged_decode_attention(*case.args())
    assert tag_ok.tolist() == [True] * 4
    torch.testing.assert_close(out.double(), oracle_decode(case), rtol=1e-5, atol=1e-5)


def test_decode_reference_handles_empty_context():
    case = make_decode_case([0, 3])
    out, tag_ok = attention.paged_decode_attention(*case.args())
    assert tag_ok.tolist() == [True, True]
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out.double(), oracle_decode(case), rtol=1e-5, atol=1e-5)


def test_tag_mismatch_fails_only_its_sequence_and_check_off_reads_foreign_data():
    case = make_decode_case([7, 10, 6], page_tokens=4)
    before, _ = attention.paged_decode_attention(*case.args())
    make_foreign(case, sequence=1, slot=2)  # the partial last page of sequence 1
    out, tag_ok = attention.paged_decode_attention(*case.args())
    assert tag_ok.tolist() == [True, False, True]
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[[0, 2]], before[[0, 2]])
    unchecked, unchecked_ok = attention.paged_decode_attention(*case.args(), check_tags=False)
    assert unchecked_ok.tolist() == [True, True, True]
    torch.testing.assert_close(unchecked.double(), oracle_decode(case), rtol=1e-5, atol=1e-5)
    assert (unchecked[1] - before[1]).abs().max() > 0.05, "the foreign page changed nothing"


def test_a_page_past_the_context_is_not_checked_and_a_bad_page_id_is_a_mismatch():
    case = make_decode_case([8, 8], page_tokens=4)
    case.block_table[0, 2] = 0  # slot 2 is past sequence 0's 8 tokens: never read
    case.expected_tags[0, 2] = 12345
    case.block_table[1, 1] = -1  # slot 1 holds context: an id outside the pool
    out, tag_ok = attention.paged_decode_attention(*case.args())
    assert tag_ok.tolist() == [True, False]
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_bytes_the_decode_does_not_read_change_nothing(dtype):
    """Pages are never zeroed: past a sequence's context in its last page, and in the
    pages its padded block-table row stands for, lie whatever earlier owners left,
    possibly inf or NaN (an fp16 overflow). Masked out, they must change nothing: not
    the reference (which gathers them and masks), not the plain definition."""
    case = make_decode_case([5, 13, 2], page_tokens=4, dtype=dtype, seed=3)
    before, _ = attention.paged_decode_attention(*case.args())
    rows = case.block_table.long()
    for b, n in enumerate(case.context_lens.tolist()):
        last = rows[b, (n - 1) // 4]
        case.kv[last, :, 0, :, n % 4 or 4:] = float("nan")  # the tail past the context
        case.kv[last, :, 1, :, n % 4 or 4:] = float("inf")
    unowned = set(range(case.kv.shape[0])) - set(rows[rows >= 0].tolist())
    assert 0 in unowned, "page 0 (where -1 entries point once clamped) should be spare"
    for page in unowned:
        case.kv[page] = float("nan")
    for decode in (attention.paged_decode_attention, attention.paged_decode_attention_plain):
        out, tag_ok = decode(*case.args())
        assert tag_ok.tolist() == [True] * 3
        assert bool(out.isfinite().all()), f"{decode.__name__}: stale bytes leaked in"
        torch.testing.assert_close(out, before, rtol=0, atol=1e-5 if dtype == torch.float32
                                   else 2e-2)


# --- prefill attention -------------------------------------------------------------------

@pytest.mark.parametrize("start_pos,new_tokens", [(0, 7), (5, 6), (8, 1)])
def test_prefill_reference_matches_causal_oracle(start_pos, new_tokens):
    case = make_decode_case([start_pos + new_tokens], q_heads=4, kv_heads=2, page_tokens=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(new_tokens, 4, 64, generator=gen)
    row = case.block_table[0]
    pages = [int(p) for p in row if p >= 0]
    out = attention.paged_prefill_attention(q, case.kv, case.layer, row, start_pos, case.scale)
    expected = oracle_prefill(q, case.kv, case.layer, pages, start_pos, case.scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# --- write_kv ----------------------------------------------------------------------------

def test_write_kv_stores_each_token_at_its_slot_and_nothing_else():
    kv = torch.zeros(5, 2, 2, 3, 4, 8)
    slots = torch.tensor([17, 2, 11])  # page 4 offset 1, page 0 offset 2, page 2 offset 3
    k, v = torch.randn(3, 3, 8), torch.randn(3, 3, 8)
    kernels.write_kv(kv, 1, slots, k, v)
    for i, (page, offset) in enumerate([(4, 1), (0, 2), (2, 3)]):
        assert torch.equal(kv[page, 1, 0, :, offset], k[i])
        assert torch.equal(kv[page, 1, 1, :, offset], v[i])
    assert int((kv != 0).sum()) == 2 * k.numel()


# --- checksum ----------------------------------------------------------------------------

def _pool(dtype=torch.float16, pages=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(pages, 2, 2, 2, 4, 8, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_checksum_matches_python_oracle_on_raw_bytes(dtype):
    kv = _pool(dtype)
    digests = checksum.page_checksum(kv, torch.tensor([2, 0, 3]))
    raw = [kv[p].contiguous().view(torch.uint8).numpy().tobytes() for p in (2, 0, 3)]
    assert digests.tolist() == [oracle_digest(b) for b in raw]


def test_checksum_pinned_value():
    kv = torch.arange(2 * 2 * 2 * 2 * 4 * 8, dtype=torch.int16).view(2, 2, 2, 2, 4, 8)
    kv = (kv * 977).view(torch.float16)
    assert checksum.page_checksum(kv, torch.tensor([0, 1])).tolist() == [
        oracle_digest(kv[0].numpy().tobytes()), oracle_digest(kv[1].numpy().tobytes())]
    assert checksum.page_checksum(kv, torch.tensor([1])).item() == 4622156117911115648


def test_checksum_detects_every_single_unit_change_and_two_element_swaps():
    kv = _pool(torch.float16, pages=1)
    base = checksum.page_checksum(kv, torch.tensor([0])).item()
    units = kv.view(1, -1).view(torch.int16)
    for j in range(0, units.shape[1], 7):
        for delta in (1, -32768, 12345):
            changed = units.clone()
            changed[0, j] = (changed[0, j].int() + delta).to(torch.int16)
            pool = changed.view(torch.float16).view(kv.shape)
            assert checksum.page_checksum(pool, torch.tensor([0])).item() != base, (j, delta)
    for i, j in [(0, 1), (3, 200), (0, units.shape[1] - 1)]:
        assert units[0, i] != units[0, j]
        swapped = units.clone()
        swapped[0, [i, j]] = swapped[0, [j, i]]
        pool = swapped.view(torch.float16).view(kv.shape)
        assert checksum.page_checksum(pool, torch.tensor([0])).item() != base, (i, j)


def test_checksum_blind_spot_is_the_documented_one():
    """+1, -2, +1 on three consecutive units cancels both sums (checksum.py says so)."""
    kv = torch.full((1, 1, 2, 1, 4, 8), 1000, dtype=torch.int16)
    base = checksum.page_checksum(kv, torch.tensor([0])).item()
    kv[0, 0, 0, 0, 0, 3:6] += torch.tensor([1, -2, 1], dtype=torch.int16)
    assert checksum.page_checksum(kv, torch.tensor([0])).item() == base


# --- pack / unpack -----------------------------------------------------------------------

def test_pack_then_unpack_moves_pages_bytes_unchanged():
    source, destination = _pool(pages=6, seed=1), _pool(pages=6, seed=2)
    untouched = destination.clone()
    buffer = pack.pack_pages(source, torch.tensor([3, 0, 5]))
    assert buffer.shape == (3, source[0].numel()) and buffer.is_contiguous()
    pack.unpack_pages(buffer, destination, torch.tensor([1, 4, 2]))
    for src, dst in [(3, 1), (0, 4), (5, 2)]:
        assert torch.equal(destination[dst], source[src])
    for other in (0, 3, 5):
        assert torch.equal(destination[other], untouched[other])
    assert torch.equal(checksum.page_checksum(source, torch.tensor([3, 0, 5])),
                       checksum.page_checksum(destination, torch.tensor([1, 4, 2])))
    with pytest.raises(AssertionError):
        pack.unpack_pages(buffer, destination, torch.tensor([1, 1, 2]))


# --- dispatch and architecture -----------------------------------------------------------

def test_dispatch_on_cpu_can_be_forced(monkeypatch):
    """The default on a CPU (the C kernels, or the references where they do not build)
    is tests/test_kernels_native.py's."""
    cpu = torch.zeros(1)
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert kernels.backend(cpu) == "torch"
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    assert kernels.backend(cpu) == "triton"
    monkeypatch.setenv(kernels.BACKEND_ENV, "cuda")
    with pytest.raises(AssertionError):
        kernels.backend(cpu)


def test_public_functions_on_cpu_are_the_references(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    case = make_decode_case([6, 3])
    out, ok = kernels.paged_decode_attention(*case.args())
    ref_out, ref_ok = attention.paged_decode_attention(*case.args())
    assert torch.equal(out, ref_out) and torch.equal(ok, ref_ok)
    case.tags[case.block_table[1, 0]] += 1  # the C tag check, where it runs, fails it too
    out, ok = kernels.paged_decode_attention(*case.args())
    assert ok.tolist() == [True, False] and torch.equal(out[1], torch.zeros_like(out[1]))
    pages = torch.tensor([1, 0])
    assert torch.equal(kernels.page_checksum(case.kv, pages), checksum.page_checksum(case.kv, pages))
    assert torch.equal(kernels.pack_pages(case.kv, pages), pack.pack_pages(case.kv, pages))

