"""kernels/ compiled on a CUDA device (not the interpreter): the Triton decode kernel with
splits and a reallocated page in the batch, the prefill kernel, page checksums and
pack/unpack, against the torch references on the CPU: attention in fp32 and bf16 (bf16
is wrong only in the interpreter), pages in fp32, fp16 and bf16. Skipped here (no GPU);
bench/device_check.sh runs it.

    TRITON_INTERPRET=0 python -m pytest -q -o addopts="" tests/test_kernels_cuda.py
    TRITON_INTERPRET=0 PYTHONPATH=.:tests python tests/test_kernels_cuda.py"""

from __future__ import annotations

import sys

import torch

import kernels
from cuda_cases import run_as_script, skip_marks
from kernel_cases import make_decode_case, make_foreign
from kernels import attention, checksum, pack

pytestmark = skip_marks()

# fp16 arithmetic is covered by the interpreter tests; every variant here is a compile
# (about a second each), and bench/device_check.sh gives this file 50 s.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 4e-2}
SHAPES = ((3, 64), (4, 128))  # (query group, head dim); (3, 64) is SmolLM2's


def on_cuda(*tensors):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in tensors]


def test_decode_kernel_matches_the_reference_with_a_reallocated_page():
    """Contexts 5..200 tokens on 16-token pages, sequence 1's first page reallocated:
    outputs within tolerance of the plain reference, sequence 1 alone failing."""
    for dtype in TOLERANCE:
        for group, head_dim in SHAPES:
            for num_splits in (1, 3):
                case = make_decode_case([5, 33, 1, 45, 200], q_heads=2 * group, kv_heads=2,
                                        head_dim=head_dim, page_tokens=16, dtype=dtype)
                make_foreign(case, 1, 0)
                expected, expected_ok = attention.paged_decode_attention_plain(*case.args())
                args = on_cuda(*case.args())
                assert kernels.backend(args[0]) == "triton"
                out, tag_ok = kernels.paged_decode_attention(*args, num_splits=num_splits)
                assert tag_ok.tolist() == expected_ok.tolist() == [True, False, True, True, True]
                tolerance = TOLERANCE[dtype]
                torch.testing.assert_close(out.float().cpu(), expected.float(), rtol=tolerance,
                                           atol=tolerance,
                                           msg=f"{dtype} group {group} dim {head_dim} "
                                               f"splits {num_splits}")


def test_prefill_kernel_matches_the_reference():
    for dtype in TOLERANCE:
        for group, head_dim in SHAPES:
            for new_tokens in (7, 70) if head_dim == 64 else (70,):  # one and two blocks
                case = make_decode_case([90], q_heads=2 * group, kv_heads=2, head_dim=head_dim,
                                        page_tokens=16, dtype=dtype)
                q = torch.randn(new_tokens, 2 * group, head_dim,
                                generator=torch.Generator().manual_seed(3)).to(dtype)
                row = case.block_table[0]
                start = 90 - new_tokens
                expected = attention.paged_prefill_attention_plain(q, case.kv, 1, row, start,
                                                                   case.scale)
                out = kernels.paged_prefill_attention(*on_cuda(q, case.kv), 1, row.cuda(),
                                                      start, case.scale)
                tolerance = TOLERANCE[dtype]
                torch.testing.assert_close(out.float().cpu(), expected.float(), rtol=tolerance,
                                           atol=tolerance)


def test_checksum_and_pack_are_bit_identical_to_the_reference():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        case = make_decode_case([40, 70], head_dim=128, page_tokens=16, dtype=dtype)
        pages = torch.tensor([4, 0, 2, 5], dtype=torch.int64)
        kv = case.kv.cuda()
        assert torch.equal(kernels.page_checksum(kv, pages.cuda()).cpu(),
                           checksum.page_checksum(case.kv, pages))
        packed = kernels.pack_pages(kv, pages.cuda())
        assert torch.equal(packed.cpu(), pack.pack_pages(case.kv, pages))
        target, expected = torch.zeros_like(kv), torch.zeros_like(case.kv)
        kernels.unpack_pages(packed, target, pages.flip(0).cuda())
        pack.unpack_pages(packed.cpu(), expected, pages.flip(0))
        assert torch.equal(target.cpu(), expected)


if __name__ == "__main__":
    sys.exit(run_as_script(globals()))
