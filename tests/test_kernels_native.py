"""kernels/: the C kernels of the CPU engine (layer_native.c) against their torch
references (layer.py, attention.py), the build (native.py) and the dispatch."""

from __future__ import annotations

import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")

import kernels  # noqa: E402
from kernels import attention, checksum, layer, layer_native, native  # noqa: E402

HAVE_COMPILER = shutil.which("cc") is not None
needs_native = pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler (cc) on PATH")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The C code sums in another order and computes exp its own way: in fp32 the results
# differ by an ulp or two; in bf16 / fp16, rounding makes them equal but for the odd
# value one unit of the last place apart.
TOLERANCES = {torch.float32: dict(rtol=4e-6, atol=1e-6),
              torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5),
              torch.float16: dict(rtol=2 ** -10, atol=1e-5)}


def _ulp_apart_at_most_one(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[actual.dtype])
    if actual.dtype != torch.float32:  # and almost always bit-equal
        assert (actual != expected).float().mean() < 0.01


# --- build and dispatch ------------------------------------------------------------------

@needs_native
def test_the_c_source_compiles_without_a_warning(tmp_path):
    source = native.SOURCE_DIR / "layer_native.c"
    result = subprocess.run(["cc", *native.FLAGS, "-Wall", "-Wextra", "-Werror", "-o",
                             str(tmp_path / "out.so"), str(source), "-lm"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@needs_native
def test_a_build_is_cached_under_a_name_its_source_decides(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    compiler = shutil.which("cc")
    source = tmp_path / "probe_native.c"
    source.write_text("int kvproof_probe(void) { return 7; }\n")
    built = native._build(source, compiler)
    assert built.parent == tmp_path / "cache" and built.name.startswith("probe_native-")
    stamp = built.stat().st_mtime_ns
    assert native._build(source, compiler) == built and built.stat().st_mtime_ns == stamp
    source.write_text("int kvproof_probe(void) { return 8; }\n")
    rebuilt = native._build(source, compiler)
    assert rebuilt != built and rebuilt.exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if "partial" in p.name] == []


def _without_native(monkeypatch, tmp_path, compiler: str) -> None:
    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.setattr(kernels, "_warned_no_native", [])
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", compiler)


def test_without_a_compiler_the_cpu_takes_the_references_and_says_why(monkeypatch, tmp_path):
    _without_native(monkeypatch, tmp_path, str(tmp_path / "no-such-cc"))
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert kernels.backend(torch.zeros(1)) == "torch"
    hidden = torch.randn(3, 8)
    assert torch.equal(kernels.rms_norm(hidden, 1e-6, -1), layer.rms_norm(hidden, 1e-6, -1))
    monkeypatch.setenv(kernels.BACKEND_ENV, "native")
    with pytest.raises(RuntimeError, match="C kernels did not build: no C compiler"):
        kernels.backend(torch.zeros(1))


@needs_native
def test_a_failed_build_names_the_compiler_and_its_exit(monkeypatch, tmp_path):
    _without_native(monkeypatch, tmp_path, shutil.which("false") or "false")
    assert native.library("layer") is None
    assert native.why_not("layer").startswith("layer_native.c did not build: false exited 1")


@needs_native
def test_the_cpu_takes_the_c_kernels_unless_told_otherwise(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels.backend(cpu) == "native"
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert kernels.backend(cpu) == "torch"


# --- the kernels against their references ------------------------------------------------

def _layouts(tokens: int, features: int, dtype):
    """(name, hidden, feature dim): the engine's two layouts and two views of them."""
    generator = torch.Generator().manual_seed(tokens * 31 + features)
    rows = (torch.randn(tokens, features, generator=generator) * 3).to(dtype)
    columns = rows.t().contiguous()
    wide = (torch.randn(tokens, 2 * features, generator=generator) * 3).to(dtype)
    return [("rows", rows, -1), ("feature-major", columns, 0),
            ("transposed view", columns.t(), -1), ("strided rows", wide[:, ::2], -1)]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 64, 65, 200])
def test_rms_norm_matches_the_reference(dtype, tokens):
    for name, hidden, dim in _layouts(tokens, 576, dtype):
        actual = layer_native.rms_norm(hidden, 1e-5, dim)
        assert actual.shape == hidden.shape and actual.is_contiguous(), name
        _ulp_apart_at_most_one(actual, layer.rms_norm(hidden, 1e-5, dim))


@needs_native
def test_rms_norm_keeps_a_zero_token_finite_and_a_nan_in_its_own_token():
    hidden = torch.randn(4, 64)
    hidden[1] = 0
    hidden[2, 5] = float("nan")
    normed = layer_native.rms_norm(hidden, 1e-6, -1)
    assert torch.equal(normed[1], torch.zeros(64))
    assert normed[2].isnan().all() and normed[[0, 3]].isfinite().all()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_the_reference_in_both_layouts(dtype):
    generator = torch.Generator().manual_seed(3)
    for shape, dim in (((8, 2 * 1536), -1), ((2 * 1536, 8), 0), ((1, 2 * 40), -1),
                       ((2 * 1536, 8, "transposed"), 0)):
        gate_up = (torch.randn(shape[:2], generator=generator) * 6).to(dtype)
        gate_up.view(-1)[:4] = torch.tensor([0.0, -0.0, 60.0, -60.0])
        gate, up = gate_up.chunk(2, dim=dim)
        if len(shape) == 3:  # a view in neither layout: rows are made contiguous first
            gate, up = gate.t(), up.t()
        _ulp_apart_at_most_one(layer_native.silu_mul(gate, up), layer.silu_mul(gate, up))


@needs_native
def test_silu_is_as_accurate_as_torchs_over_the_range_that_matters():
    """Within 1.5 units of fp32 epsilon relative to the exact value (measured: 1.29, the
    same as F.silu's), so the polynomial of exp has no coefficient wrong."""
    gate = torch.linspace(-80, 80, 100_001)
    exact = gate.double() * torch.sigmoid(gate.double())
    actual = layer_native.silu_mul(gate[None], torch.ones(1, gate.numel()))[0].double()
    epsilons = (actual - exact).abs() / (torch.finfo(torch.float32).eps * exact.abs())
    assert epsilons[exact != 0].max() <= 1.5


def _rotary_case(layout: str, dtype, tokens: int = 5, q_heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16):
    """A pool, KVSlots for distinct slots, a qkv view in the layout, cos and signed sin."""
    generator = torch.Generator().manual_seed(11)
    pool = torch.randn(9, 3, 2, kv_heads, 4, head_dim, generator=generator).to(dtype)
    slots = torch.randperm(9 * 4, generator=generator)[:tokens]
    at = attention.kv_slots(pool, slots)
    heads = q_heads + 2 * kv_heads
    qkv = torch.randn(tokens, heads * head_dim, generator=generator).to(dtype)
    if layout == "rows":
        view = qkv.view(tokens, heads, head_dim)
    else:  # the feature-major step's view of its [heads * dim, tokens] projection
        view = qkv.t().contiguous().view(heads, head_dim, tokens).permute(2, 0, 1)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=1).to(dtype)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=1).to(dtype)
    return pool, at, view, q_heads, cos, signed_sin


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "feature-major"])
def test_rotary_write_kv_matches_the_reference(dtype, layout):
    pool, at, heads, q_heads, cos, signed_sin = _rotary_case(layout, dtype)
    expected_pool, expected_heads = pool.clone(), heads.clone()
    layer.rotary_write_kv(expected_pool, 2, attention.KVSlots(at.rows, expected_pool.view(
        -1, pool.shape[5])), expected_heads, q_heads, cos, signed_sin)
    layer_native.rotary_write_kv(pool, 2, at, heads, q_heads, cos, signed_sin)
    _ulp_apart_at_most_one(heads, expected_heads)
    _ulp_apart_at_most_one(pool, expected_pool)
    written = torch.zeros(pool.numel() // pool.shape[5], dtype=torch.bool)
    written[at.rows[2]] = True
    assert torch.equal(pool.view(-1, pool.shape[5])[~written],
                       expected_pool.view(-1, pool.shape[5])[~written])


@needs_native
def test_rotary_write_kv_refuses_a_row_outside_the_pool_and_writes_nothing():
    pool, at, heads, q_heads, cos, signed_sin = _rotary_case("rows", torch.float32)
    rows = at.rows.clone()
    rows[2, -1] = pool.numel() // pool.shape[5]  # one past the last row
    before_pool, before_heads = pool.clone(), heads.clone()
    with pytest.raises(AssertionError, match="refused its arguments"):
        layer_native.rotary_write_kv(pool, 2, attention.KVSlots(rows, at.target), heads,
                                     q_heads, cos, signed_sin)
    assert torch.equal(pool, before_pool) and torch.equal(heads, before_heads)


@needs_native
def test_tags_match_is_the_reference_check():
    tags = torch.tensor([5, 6, 7, 8], dtype=torch.int64)
    ids = torch.tensor([3, 0, 3], dtype=torch.int64)
    for expected, match in (([8, 5, 8], True), ([8, 5, 9], False), ([9, 5, 8], False)):
        expected = torch.tensor(expected)
        assert layer_native.tags_match(tags, ids, expected) is match
        assert attention.tags_equal(tags, ids, expected) is match
    assert layer_native.tags_match(tags, ids[:0], ids[:0])
    with pytest.raises(AssertionError, match="outside the pool"):
        layer_native.tags_match(tags, torch.tensor([4]), torch.tensor([8]))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_page_checksum_is_the_reference_digest_bit_for_bit(dtype):
    """Pages of 1,536 units (6 blocks of 256), 21 (a partial block) and 737,280 (the
    default model's fp32 page), with repeats and any order."""
    generator = torch.Generator().manual_seed(5)
    for shape in ((9, 2, 2, 3, 4, 16), (4, 7, 3), (3, 30, 2, 3, 16, 64)):
        kv = (torch.randn(shape, generator=generator) * 100).to(dtype)
        kv.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
        pages = torch.tensor([shape[0] - 1, 0, shape[0] - 1, 1])
        assert torch.equal(layer_native.page_checksum(kv, pages),
                           checksum.page_checksum(kv, pages))


@needs_native
def test_page_checksum_refuses_a_page_outside_the_pool():
    kv = torch.zeros(4, 8)
    with pytest.raises(AssertionError, match="outside the pool"):
        layer_native.page_checksum(kv, [1, 4])
    with pytest.raises(AssertionError, match="outside the pool"):
        layer_native.page_checksum(kv, [-1])
