"""The Triton checksum and pack/unpack kernels on the CPU (TRITON_INTERPRET=1): digests
bit-identical to the reference (integer arithmetic), copies byte-identical."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import checksum, pack  # noqa: E402
from kernel_cases import interpreted_modules  # noqa: E402

NAMES = ("kernels.checksum_triton", "kernels.pack_triton")


@pytest.fixture(scope="module")
def triton_pages():
    return interpreted_modules(*NAMES)


def _pool(dtype, pages=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    units = torch.randint(-2**15, 2**15, (pages, 2, 2, 2, 16, 64), generator=gen,
                          dtype=torch.int32).to(torch.int16)
    return units.view(dtype)  # random bits: NaNs and infinities included


def _same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_checksum_is_bit_identical_to_the_reference(triton_pages, dtype):
    checksum_triton, _ = triton_pages
    kv = _pool(dtype)
    pages = torch.tensor([4, 0, 5, 2])
    assert torch.equal(checksum_triton.page_checksum(kv, pages),
                       checksum.page_checksum(kv, pages))
    assert checksum_triton.page_checksum(kv, pages[:0]).shape == (0,)


def test_checksum_over_many_chunks_with_a_partial_block(triton_pages, monkeypatch):
    """Small blocks and chunks, so one page spans 9 chunks and ends inside a block."""
    checksum_triton, _ = triton_pages
    monkeypatch.setattr(checksum_triton, "BLOCK_UNITS", 64)
    monkeypatch.setattr(checksum_triton, "MAX_ITERS", 3)
    kv = torch.randint(-2**15, 2**15, (4, 1, 2, 1, 16, 50), dtype=torch.int32).to(torch.int16)
    pages = torch.tensor([2, 1, 3])
    assert torch.equal(checksum_triton.page_checksum(kv, pages),
                       checksum.page_checksum(kv, pages))


@pytest.mark.parametrize("chunk_words", [None, 96])
def test_pack_and_unpack_match_the_reference(triton_pages, monkeypatch, chunk_words):
    _, pack_triton = triton_pages
    if chunk_words:  # several chunks per page, the last one partial
        monkeypatch.setattr(pack_triton, "CHUNK_WORDS", chunk_words)
        monkeypatch.setattr(pack_triton, "BLOCK_WORDS", 32)
    source, destination = _pool(torch.float16, seed=1), _pool(torch.float16, seed=2)
    expected_destination = destination.clone()
    buffer = pack_triton.pack_pages(source, torch.tensor([3, 0, 5]))
    assert _same_bytes(buffer, pack.pack_pages(source, torch.tensor([3, 0, 5])))
    pack_triton.unpack_pages(buffer, destination, torch.tensor([1, 4, 2]))
    pack.unpack_pages(buffer, expected_destination, torch.tensor([1, 4, 2]))
    assert _same_bytes(destination, expected_destination)
