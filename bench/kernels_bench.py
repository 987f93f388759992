"""Achieved bandwidth of the kernels next to the best library path, measured in the same run.

On a GPU (`--device cuda`, the default when one is present) it times the Triton kernels:
- paged decode attention with tag checks, over a shuffled block table, against torch SDPA
  over contiguous KV (cuDNN, flash and efficient backends, the best one named), bytes =
  K + V of the context; the tag check's cost as the on/off time ratio; at small batch also
  the kernel without split-K, to show what split-K buys;
- page checksum against a device-to-device copy (bytes read + written) and torch.sum over
  the same bytes;
- pack (gather) and unpack (scatter) against the copy, index_select and index_copy_.
On the CPU it prints the same rows for the torch reference paths (what the engine runs
there) next to the same library paths, at smaller shapes.

Every figure is the median of --repeat timed calls after warm-up; on CUDA each call is
timed with events after a 256 MiB write that evicts L2. Issue 12's GPU targets (H200,
bf16, batch 64, 32 query / 8 KV heads): attention >= 90% of cuDNN SDPA (>= 100% at small
batch, long context), tag check <= 1%, checksum >= 90% of copy, pack/unpack >= 80% of copy.

    python bench/kernels_bench.py [--device cpu|cuda] [--repeat N] [--threads N] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels import pack_tag  # noqa: E402

GPU_ATTENTION_SHAPES = [  # (batch, context tokens, head dim)
    (64, 4096, 64), (64, 4096, 128), (64, 16384, 64), (64, 16384, 128),
    (2, 65536, 128), (4, 32768, 64)]  # small batch, long context: split-K's case
CPU_ATTENTION_SHAPES = [(4, 1024, 64), (4, 1024, 128), (1, 4096, 128)]
TINY_ATTENTION_SHAPES = [(2, 64, 64)]
Q_HEADS, KV_HEADS = 32, 8
CPU_HEADS = (8, 2)  # keeps the CPU run short; the grouping (4) is the GPU shapes'
PAGE_TOKENS = 16
# A page of all layers: (layers, kv heads, head dim); 2 MiB in bf16 on the GPU.
GPU_PAGE, GPU_POOL_PAGES, GPU_MOVED_PAGES = (32, 8, 128), 2048, 1024
CPU_PAGE, CPU_POOL_PAGES, CPU_MOVED_PAGES = (4, 2, 64), 512, 256
TINY_PAGE, TINY_POOL_PAGES, TINY_MOVED_PAGES = (2, 1, 64), 8, 4
L2_FLUSH_BYTES = 256 << 20


class Timer:
    """Median seconds of fn() on one device."""

    def __init__(self, device, repeat):
        self.device, self.repeat = device, repeat
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) \
            if device.type == "cuda" else None

    def median_s(self, fn, warmup=2):
        for _ in range(warmup):
            fn()
        self._sync()
        times = [self._once(fn) for _ in range(self.repeat)]
        return statistics.median(times)

    def median_pair_s(self, fn_a, fn_b, warmup=2):
        """Medians of fn_a and fn_b timed alternately, so that drift in a shared machine's
        speed falls on both alike (the tag check's on/off ratio)."""
        for _ in range(warmup):
            fn_a()
            fn_b()
        self._sync()
        pairs = [(self._once(fn_a), self._once(fn_b)) for _ in range(self.repeat)]
        return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)

    def _once(self, fn):
        if self.flush is None:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def gb_per_s(num_bytes, seconds):
    return num_bytes / seconds / 1e9


def fmt(num_bytes, seconds):
    """'x.x GB/s (y.yyy ms)' or 'n/a'."""
    if seconds is None:
        return "n/a"
    return f"{gb_per_s(num_bytes, seconds):8.1f} GB/s ({seconds * 1e3:8.3f} ms)"


# --- attention -------------------------------------------------------------------------

def paged_case(batch, context, head_dim, heads, dtype, device, generator):
    """A one-layer pool holding batch sequences of `context` tokens on shuffled pages, and
    the same K/V contiguous for the library path."""
    q_heads, kv_heads = heads
    pages_per_seq = math.ceil(context / PAGE_TOKENS)
    num_pages = batch * pages_per_seq
    kv = torch.randn(num_pages, 1, 2, kv_heads, PAGE_TOKENS, head_dim, device=device,
                     dtype=dtype, generator=generator)
    order = torch.randperm(num_pages, device=device, generator=generator)
    block_table = order.view(batch, pages_per_seq).to(torch.int32)
    tags = torch.arange(num_pages, dtype=torch.int64, device=device) + pack_tag(1, 0)
    expected = tags[block_table.long()]
    tiles = kv[block_table.long(), 0]  # [batch, pages, 2, kv_heads, page_tokens, dim]
    contiguous = tiles.permute(2, 0, 3, 1, 4, 5).reshape(2, batch, kv_heads, -1, head_dim)
    keys = contiguous[0, :, :, :context].contiguous()
    values = contiguous[1, :, :, :context].contiguous()
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=generator)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return dict(q=q, kv=kv, block_table=block_table, context_lens=lens, expected=expected,
                tags=tags, keys=keys, values=values)


def library_attention_s(timer, case, scale):
    """{backend name: median s or None} for torch SDPA over the contiguous K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q4 = case["q"][:, :, None, :]
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if timer.device.type == "cpu":
        backends = {"sdpa-cpu": None}
    results = {}
    for name, backend in backends.items():
        def call():
            return torch.nn.functional.scaled_dot_product_attention(
                q4, case["keys"], case["values"], scale=scale, enable_gqa=True)
        try:
            if backend is None:
                results[name] = timer.median_s(call)
            else:
                with sdpa_kernel(backend):
                    results[name] = timer.median_s(call)
        except RuntimeError as error:  # a backend that does not take these shapes
            results[name] = None
            print(f"    ({name}: {str(error).splitlines()[0][:90]})")
    return results


def kernel_attention(case, scale, **options):
    """A call of the dispatched paged decode attention on the case."""
    def call():
        return kernels.paged_decode_attention(
            case["q"], case["kv"], 0, case["block_table"], case["context_lens"],
            case["expected"], case["tags"], scale, **options)
    return call


def bench_attention(timer, shapes, heads, dtype, generator):
    print(f"paged decode attention, {heads[0]} q / {heads[1]} kv heads, {PAGE_TOKENS}-token "
          f"pages, {dtype}; bytes = K + V of the context")
    for batch, context, head_dim in shapes:
        case = paged_case(batch, context, head_dim, heads, dtype, timer.device, generator)
        scale = head_dim ** -0.5
        kv_bytes = case["keys"].nbytes + case["values"].nbytes
        print(f"  batch {batch}, context {context}, head dim {head_dim}:")
        library = library_attention_s(timer, case, scale)
        for name, seconds in library.items():
            print(f"    library {name:<10} {fmt(kv_bytes, seconds)}")
        with_tags, without_tags = timer.median_pair_s(
            kernel_attention(case, scale), kernel_attention(case, scale, check_tags=False))
        best_name, best_s = min(((n, s) for n, s in library.items() if s is not None),
                                key=lambda item: item[1], default=(None, None))
        versus = f", {best_s / with_tags:.0%} of {best_name}" if best_s else ""
        print(f"    kvproof tags on   {fmt(kv_bytes, with_tags)}{versus}")
        print(f"    kvproof tags off  {fmt(kv_bytes, without_tags)}; tag check costs "
              f"{with_tags / without_tags - 1:+.1%} (on/off = {with_tags / without_tags:.3f})")
        splits = _automatic_splits(case)
        if splits > 1:
            no_split = timer.median_s(kernel_attention(case, scale, num_splits=1))
            print(f"    kvproof 1 split   {fmt(kv_bytes, no_split)} (split-K, {splits} "
                  f"splits, gives {no_split / with_tags:.2f}x)")
        del case


def _automatic_splits(case):
    """The split count the Triton kernel picks for this case (1 on the reference path)."""
    if kernels.backend(case["q"]) != "triton":
        return 1
    from kernels.attention_triton import choose_num_splits
    batch, pages = case["block_table"].shape
    return choose_num_splits(batch, case["kv"].shape[3], pages, case["q"].device)


# --- pages -----------------------------------------------------------------------------

def bench_pages(timer, page_shape, pool_pages, moved_pages, dtype, generator):
    layers, kv_heads, head_dim = page_shape
    kv = torch.randn(pool_pages, layers, 2, kv_heads, PAGE_TOKENS, head_dim,
                     device=timer.device, dtype=dtype, generator=generator)
    pages = torch.randperm(pool_pages, device=timer.device, generator=generator)[:moved_pages]
    destination = torch.randperm(pool_pages, device=timer.device, generator=generator)[:moved_pages]
    page_bytes = kv[0].nbytes
    moved = moved_pages * page_bytes
    print(f"pages: {moved_pages} of {pool_pages} pages of {page_bytes / 2**20:.2f} MiB "
          f"({layers} layers x K,V x {kv_heads} heads x {PAGE_TOKENS} tokens x {head_dim}), "
          f"{dtype}, random page order")
    source = kv.view(pool_pages, -1)[:moved_pages].clone()
    target = torch.empty_like(source)
    copy_s = timer.median_s(lambda: target.copy_(source))
    print(f"  library copy (contiguous, read+write)  {fmt(2 * moved, copy_s)}")
    _bench_checksum(timer, kv, pages, moved, copy_s)
    _bench_pack(timer, kv, pages, destination, moved, copy_s)


def _bench_checksum(timer, kv, pages, moved, copy_s):
    rows = kv.view(kv.shape[0], -1)
    words = rows.view(torch.int32)
    sum_s = timer.median_s(lambda: words[: pages.shape[0]].sum(dtype=torch.int64))
    digest_s = timer.median_s(lambda: kernels.page_checksum(kv, pages))
    print(f"  library torch.sum of as many bytes     {fmt(moved, sum_s)}")
    print(f"  kvproof page_checksum (read)           {fmt(moved, digest_s)}, "
          f"{gb_per_s(moved, digest_s) / gb_per_s(2 * moved, copy_s):.0%} of copy")


def _bench_pack(timer, kv, pages, destination, moved, copy_s):
    rows = kv.view(kv.shape[0], -1)
    buffer = kernels.pack_pages(kv, pages)
    gather_s = timer.median_s(lambda: rows.index_select(0, pages))
    scatter_s = timer.median_s(lambda: rows.index_copy_(0, destination, buffer))
    pack_s = timer.median_s(lambda: kernels.pack_pages(kv, pages))
    unpack_s = timer.median_s(lambda: kernels.unpack_pages(buffer, kv, destination))
    copy_gb = gb_per_s(2 * moved, copy_s)
    print(f"  library index_select (gather)          {fmt(2 * moved, gather_s)}")
    print(f"  library index_copy_ (scatter)          {fmt(2 * moved, scatter_s)}")
    print(f"  kvproof pack_pages                     {fmt(2 * moved, pack_s)}, "
          f"{gb_per_s(2 * moved, pack_s) / copy_gb:.0%} of copy")
    print(f"  kvproof unpack_pages                   {fmt(2 * moved, unpack_s)}, "
          f"{gb_per_s(2 * moved, unpack_s) / copy_gb:.0%} of copy")


# --- main ------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed calls per figure (default 20 on CUDA, 15 on the CPU)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: steady figures on a shared "
                             "machine, where waking idle threads costs milliseconds per op)")
    parser.add_argument("--tiny", action="store_true",
                        help="smallest shapes, one repeat: a smoke run for tests")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(args.threads)
    repeat = 1 if args.tiny else args.repeat or (20 if cuda else 15)
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 matmuls on the CPU are slow
    print(_header(device, dtype, repeat))
    timer = Timer(device, repeat)
    generator = torch.Generator(device=device).manual_seed(0)
    if args.tiny:
        shapes, heads, page = TINY_ATTENTION_SHAPES, CPU_HEADS, (TINY_PAGE, TINY_POOL_PAGES,
                                                                  TINY_MOVED_PAGES)
    elif cuda:
        shapes, heads, page = GPU_ATTENTION_SHAPES, (Q_HEADS, KV_HEADS), (
            GPU_PAGE, GPU_POOL_PAGES, GPU_MOVED_PAGES)
    else:
        shapes, heads, page = CPU_ATTENTION_SHAPES, CPU_HEADS, (CPU_PAGE, CPU_POOL_PAGES,
                                                                CPU_MOVED_PAGES)
    bench_attention(timer, shapes, heads, dtype, generator)
    bench_pages(timer, *page, dtype, generator)


def _header(device, dtype, repeat):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    probe = torch.empty(1, device=device)
    path = kernels.backend(probe)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return (f"kernels_bench: {name}, torch {torch.__version__}, triton {triton_version}, "
            f"kernels path {path!r}, {dtype}, median of {repeat}, "
            f"{torch.get_num_threads()} CPU thread(s)")


if __name__ == "__main__":
    main()
