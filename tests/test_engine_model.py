"""engine/: the paged Llama-family model against transformers on tiny random models
(fp32), through the safetensors loader; tags, pages reused, chunked prefill, sampling,
and one-line errors for bad model files."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kernels  # noqa: E402
from engine.config import ModelConfig, ModelFileError  # noqa: E402
from engine.generate import Generator, GeneratorConfig, Request, decode_step  # noqa: E402
from engine.load import load_model  # noqa: E402
from engine.model import LlamaModel, PrefillChunk, can_pack  # noqa: E402
from engine.pool import KVPool, PoolConfig  # noqa: E402
from engine.sampling import SamplingParams, sample  # noqa: E402
from engine.weights import load_checkpoint, unpermute_rope_rows  # noqa: E402
from engine_cases import CONFIGS, LOGITS_ATOL, make_hf_model, reference_logits  # noqa: E402

PROMPT_LENGTHS = [1, 3, 9, 14, 22, 5]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_model(request.param, folder)
    return request.param, hf_model, LlamaModel(load_checkpoint(folder))


def prompts(seed: int, lengths=PROMPT_LENGTHS, vocab: int = 211) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (n,), generator=generator).tolist()) for n in lengths]


def run_and_compare(generator: Generator, hf_model, prompt_ids, first_id: int = 0,
                    max_tokens: int = 7) -> list:
    requests = [Request(first_id + i, p, SamplingParams(max_tokens=max_tokens))
                for i, p in enumerate(prompt_ids)]
    completions = generator.run(requests)
    for completion in completions:
        assert completion.finish_reason == "length"
        assert len(completion.output_ids) == max_tokens
        expected = reference_logits(hf_model, completion.prompt_ids, completion.output_ids)
        # row 0 came from the prefill, rows 1.. from decode steps
        torch.testing.assert_close(torch.stack(completion.logits), expected, rtol=0,
                                   atol=LOGITS_ATOL)
    return completions


def test_prefill_and_every_decode_step_match_transformers(tiny):
    """Mixed prompt lengths, 3 sequences at a time (continuous batching: requests join as
    others finish), prompts split into 5-token chunks, pages shuffled in the pool."""
    name, hf_model, model = tiny
    generator = Generator(model, GeneratorConfig(
        num_pages=64, page_tokens=4, max_batch=3, prefill_chunk_tokens=5,
        shuffle_pages_seed=1, keep_logits=True))
    run_and_compare(generator, hf_model, prompts(0))
    assert generator.stats.decode_steps > 7  # the batch really was refilled


def test_logits_match_after_other_requests_used_and_freed_the_same_pages(tiny):
    """A pool too small for both rounds: the second round runs on pages the first round
    wrote and freed (not zeroed), in a different order."""
    name, hf_model, model = tiny
    generator = Generator(model, GeneratorConfig(
        num_pages=24, page_tokens=4, max_batch=4, prefill_chunk_tokens=7,
        shuffle_pages_seed=2, keep_logits=True))
    run_and_compare(generator, hf_model, prompts(1, [13, 6, 20, 2]), first_id=0)
    run_and_compare(generator, hf_model, prompts(2, [5, 21, 9, 17, 1]), first_id=10)
    generations = [generation for generation in generator._page_generation]
    assert max(generations) >= 2, "the second round should have reused pages"


def test_every_prefill_position_matches_transformers_under_chunking(tiny):
    """All positions' logits, prefilled in chunks of 1, 4 and 6 tokens into scattered
    pages of 4 tokens, equal one transformers forward pass."""
    name, hf_model, model = tiny
    prompt = prompts(3, [23])[0]
    expected = reference_logits(hf_model, prompt[:1], prompt[1:] + (0,))
    pool = KVPool(PoolConfig.for_model(model.config, 16, 4, torch.float32, "cpu"))
    pages = torch.tensor([9, 2, 14, 0, 7, 11], dtype=torch.int32)
    rows, start = [], 0
    for size in (1, 4, 6, 6, 6):
        positions = torch.arange(start, start + size)
        slots = pages.long()[positions // 4] * 4 + positions % 4
        chunk = PrefillChunk(torch.tensor(prompt[start:start + size]), start, slots, pages)
        rows.append(model.prefill(pool, [chunk], all_logits=True))
        start += size
    torch.testing.assert_close(torch.cat(rows), expected, rtol=0, atol=LOGITS_ATOL)


def test_a_foreign_tag_fails_only_that_request_and_check_off_reads_the_page(tiny):
    name, hf_model, model = tiny
    generator = Generator(model, GeneratorConfig(num_pages=32, page_tokens=4))
    sequences = []
    for request_id, prompt in enumerate(prompts(4, [9, 11])):
        request = Request(request_id, prompt, SamplingParams(max_tokens=4))
        sequence = generator.start_sequence(request, generator.free_pages.take(3))
        sequence.prefilled_tokens = 0
        from engine.generate import prefill_step

        (_, logits), = prefill_step(model, generator.pool, [sequence], 64)
        sequence.output_ids.append(int(logits.argmax()))
        sequences.append(sequence)
    _, tag_ok = decode_step(model, generator.pool, sequences)
    assert tag_ok.tolist() == [True, True]
    generator.pool.set_tags([sequences[1].pages[1]], [kernels.pack_tag(77, 1)])  # reallocated
    logits, tag_ok = decode_step(model, generator.pool, sequences)
    assert tag_ok.tolist() == [True, False]
    _, unchecked = decode_step(model, generator.pool, sequences, check_tags=False)
    assert unchecked.tolist() == [True, True]


def test_generator_fails_a_request_whose_page_changed_owner(tiny):
    """The generator ends the request with tag_mismatch, the others finish normally."""
    name, hf_model, model = tiny
    generator = Generator(model, GeneratorConfig(num_pages=32, page_tokens=4))
    original = generator.start_sequence

    def start_and_corrupt(request, pages):
        sequence = original(request, pages)
        if request.request_id == 1:
            generator.pool.set_tags([pages[0]], [kernels.pack_tag(99, 5)])
        return sequence

    generator.start_sequence = start_and_corrupt
    completions = generator.run([Request(i, p, SamplingParams(max_tokens=5))
                                 for i, p in enumerate(prompts(5, [6, 7, 8]))])
    assert [c.finish_reason for c in completions] == ["length", "tag_mismatch", "length"]
    assert len(completions[1].output_ids) == 1  # the prefill's token, then nothing read
    assert len(generator.free_pages) == 32  # every page came back


def test_a_request_larger_than_the_pool_is_rejected_before_allocation(tiny):
    name, hf_model, model = tiny
    generator = Generator(model, GeneratorConfig(num_pages=4, page_tokens=4))
    completions = generator.run([Request(0, tuple(range(30)), SamplingParams(max_tokens=2)),
                                 Request(1, (1, 2, 3), SamplingParams(max_tokens=2))])
    assert [c.finish_reason for c in completions] == ["rejected", "length"]
    assert completions[0].output_ids == ()
    assert max(generator._page_generation) == 1  # only request 1 ever held pages


def test_pool_checksums_are_sealed_where_pages_are_written_and_verify(tiny):
    name, hf_model, model = tiny
    generator = Generator(model, GeneratorConfig(num_pages=8, page_tokens=4,
                                                 shuffle_pages_seed=3))
    generator.run([Request(0, prompts(6, [10])[0], SamplingParams(max_tokens=7))])
    pool = generator.pool
    written = [p for p in range(8) if generator._page_generation[p] == 1]  # 4 pages: 16 tokens
    assert len(written) == 4
    assert pool.verify(written, pool.checksums[written]).all()
    buffer = pool.pack(written)
    pool.kv[written[0], 0, 0, 0, 0, 0] += 1.0
    assert pool.verify(written, pool.checksums[written]).tolist() == [False, True, True, True]
    pool.unpack(buffer, written)
    assert pool.verify(written, pool.checksums[written]).all()


# --- sampling --------------------------------------------------------------------------

def test_seeded_sampling_does_not_depend_on_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11)
    generators = [params.make_generator("cpu") for _ in range(3)]
    together = [sample(logits, [params] * 3, generators) for _ in range(5)]
    alone = params.make_generator("cpu")
    by_itself = [sample(logits[1:2], [params], [alone])[0] for _ in range(5)]
    assert [row[1] for row in together] == by_itself


def test_top_k_one_and_tiny_top_p_are_greedy_and_greedy_is_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(), SamplingParams(temperature=1.5, top_k=1, seed=3),
                   SamplingParams(temperature=1.5, top_p=1e-6, seed=3)):
        generators = [params.make_generator("cpu") for _ in range(4)]
        assert sample(logits, [params] * 4, generators) == argmax


def test_sampling_rejects_bad_parameters():
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                dict(stop=("",))):
        with pytest.raises(AssertionError):
            SamplingParams(**bad)


# --- configs and files -----------------------------------------------------------------

def test_configs_read_from_config_json(tmp_path):
    make_hf_model("llama3-scaled-tied", tmp_path / "llama3")
    make_hf_model("qwen2", tmp_path / "qwen2")
    llama3 = load_checkpoint(tmp_path / "llama3").config
    qwen2 = load_checkpoint(tmp_path / "qwen2").config
    assert (llama3.rope_scaling.kind, llama3.rope_scaling.factor) == ("llama3", 8.0)
    assert llama3.tie_word_embeddings and not llama3.qkv_bias
    assert qwen2.architecture == "qwen2" and qwen2.qkv_bias and qwen2.rope_theta == 1e6
    assert (qwen2.num_heads, qwen2.num_kv_heads, qwen2.head_dim) == (4, 2, 16)
    with pytest.raises(AssertionError):
        ModelConfig(**{**llama3.__dict__, "num_kv_heads": 3})


def test_gguf_rope_permutation_is_undone():
    """llama.cpp's conversion interleaves each head's two halves row by row; unpermute
    restores the HF order exactly."""
    heads, head_dim, columns = 3, 8, 5
    weight = torch.arange(heads * head_dim * columns, dtype=torch.float32).view(-1, columns)
    as_gguf = weight.view(heads, 2, head_dim // 2, columns).transpose(1, 2).reshape(-1, columns)
    assert not torch.equal(as_gguf, weight)
    assert torch.equal(unpermute_rope_rows(as_gguf, heads), weight)


def one_line_error(path) -> str:
    with pytest.raises(ModelFileError) as caught:
        load_model(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def test_bad_model_paths_and_files_give_one_clear_line(tmp_path):
    assert "no such file" in one_line_error(tmp_path / "missing.gguf")
    (tmp_path / "empty").mkdir()
    assert "config.json" in one_line_error(tmp_path / "empty")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    assert "not a readable GGUF" in one_line_error(corrupt)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 64)
    assert ".gguf" in one_line_error(not_gguf)
    folder = tmp_path / "truncated"
    make_hf_model("llama-gqa", folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    assert "safetensors" in one_line_error(folder)
    broken = tmp_path / "broken"
    make_hf_model("llama-gqa", broken)
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    assert "config.json" in one_line_error(broken)


def test_cli_reports_a_bad_model_in_one_line_and_exits_2(tmp_path, capsys):
    from api.cli import main

    assert main(["generate", "--model", str(tmp_path / "nope.gguf"), "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope.gguf" in err and err.startswith("kvproof generate:")


# -- fp32 decode batches through MKL's packed GEMM -----------------------------------------

@pytest.mark.skipif(not can_pack(), reason="this torch has no MKL packed GEMM")
def test_packed_projections_equal_mm_for_every_row_count_and_serve_2_to_16_rows():
    """Projection with the packed copy (decode batches of 2..PACKED_ROWS rows) gives what
    mm on the transposed weight gives, with a bias, a residual or neither, for every row
    count from 1 to 40; the packed op runs exactly for 2..PACKED_ROWS rows."""
    from unittest import mock

    from engine.model import PACKED_ROWS, Projection

    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    real = torch.ops.mkl._mkl_linear
    rows_packed: list[int] = []

    def spy(x, *rest):
        rows_packed.append(x.shape[0])
        return real(x, *rest)
    with mock.patch.object(torch.ops.mkl, "_mkl_linear", spy):
        for with_bias in (False, True):
            packed = Projection.of(weight, bias if with_bias else None, pack=True)
            plain = Projection.of(weight, bias if with_bias else None, pack=False)
            assert packed.packed is not None and plain.packed is None
            for rows in range(1, 41):
                x = torch.randn(rows, 64, generator=generator)
                torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
                if not with_bias:
                    residual = torch.randn(rows, 96, generator=generator)
                    torch.testing.assert_close(packed(x, residual), plain(x, residual),
                                               atol=1e-5, rtol=1e-5)
    assert sorted(set(rows_packed)) == list(range(2, PACKED_ROWS + 1))


def test_a_model_with_packed_weights_decodes_what_one_without_decodes(tmp_path):
    """The whole path, packed (fp32 on a CPU: the default) or not: the Generator over a
    batch of mixed prompts (decode batches of 6 rows down to 1) samples the same tokens,
    and every sampled position's logits agree within the tolerance above."""
    make_hf_model("qwen2", tmp_path)  # qkv bias and tied embeddings: every packed form
    checkpoint = load_checkpoint(tmp_path)
    runs = []
    for pack in (True, False):
        model = LlamaModel(checkpoint, pack_weights=pack)
        assert (model.output.packed is not None) == (pack and can_pack())
        generator = Generator(model, GeneratorConfig(num_pages=64, page_tokens=4,
                                                     keep_logits=True))
        runs.append(generator.run([Request(i, p, SamplingParams(max_tokens=6 + i,
                                                                ignore_eos=True))
                                   for i, p in enumerate(prompts(7))]))
    for packed, plain in zip(*runs):
        assert packed.output_ids == plain.output_ids
        torch.testing.assert_close(packed.logits, plain.logits, atol=LOGITS_ATOL, rtol=0)


# -- bf16 / fp16 on a CPU: feature-major steps ---------------------------------------------

# Half-precision tolerance on these tiny models' logits (order 1): the engine and
# transformers (fp32) differ by a few roundings of the logits, up to 8e-3 in bf16 and
# 1e-3 in fp16 here; a wrong page, position, norm weight or rope frequency moves them
# by ~1e-1.
HALF_ATOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_feature_major_steps_match_the_row_path_and_transformers(tiny, dtype,
                                                                               tmp_path):
    """In bf16 and fp16 on a CPU, steps of 2..FEW_ROWS tokens (decode batches, prefill
    chunks) run feature-major (_forward_columns): the same tokens and logits as the row
    path, and transformers' fp32 logits within the dtype's rounding, under continuous
    batching, 5-token chunks and shuffled pages."""
    from unittest import mock

    name, hf_model, _ = tiny
    hf_model.save_pretrained(tmp_path)
    model = LlamaModel(load_checkpoint(tmp_path), dtype=dtype)
    column_steps = []
    forward_columns = model._forward_columns

    def spy(pool, token_ids, *rest):
        column_steps.append(token_ids.shape[0])
        return forward_columns(pool, token_ids, *rest)
    runs = {}
    for path in ("columns", "rows"):
        with mock.patch.object(model, "_forward_columns", spy), \
                mock.patch.object(model, "columns", model.columns if path == "columns"
                                  else (lambda tokens: False)):
            generator = Generator(model, GeneratorConfig(
                num_pages=64, page_tokens=4, max_batch=4, prefill_chunk_tokens=5,
                shuffle_pages_seed=1, keep_logits=True))
            runs[path] = generator.run([Request(i, p, SamplingParams(max_tokens=7))
                                        for i, p in enumerate(prompts(0))])
        if path == "columns":
            assert set(column_steps) >= {2, 3, 4, 5}, column_steps  # decode and prefill
            column_steps.clear()
    assert column_steps == []  # the row path never went feature-major
    for columns, rows in zip(runs["columns"], runs["rows"]):
        assert columns.output_ids == rows.output_ids
        torch.testing.assert_close(torch.stack(columns.logits), torch.stack(rows.logits),
                                   rtol=0, atol=HALF_ATOL[dtype])
        expected = reference_logits(hf_model, columns.prompt_ids, columns.output_ids)
        torch.testing.assert_close(torch.stack(columns.logits), expected, rtol=0,
                                   atol=HALF_ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_c_kernels_and_the_torch_references_decode_alike(tiny, dtype, tmp_path,
                                                             monkeypatch):
    """The CPU engine's C kernels (norm, SiLU * up, rotary + KV write, tag check) against
    the torch references in a whole run: the same tokens, logits within the dtype's
    rounding, in both layouts (bf16 batches run feature-major), and the C path taken."""
    if not kernels.layer_native.available():
        pytest.skip(f"the C kernels did not build: {kernels.native.why_not('layer')}")
    from unittest import mock

    name, hf_model, _ = tiny
    hf_model.save_pretrained(tmp_path)
    model = LlamaModel(load_checkpoint(tmp_path), dtype=dtype)
    runs, calls = {}, []
    for path in ("native", "torch"):
        monkeypatch.setenv(kernels.BACKEND_ENV, path)
        rotary = kernels._layer_native.rotary_write_kv
        with mock.patch.object(kernels._layer_native, "rotary_write_kv",
                               lambda *args: calls.append(path) or rotary(*args)):
            generator = Generator(model, GeneratorConfig(
                num_pages=64, page_tokens=4, max_batch=4, prefill_chunk_tokens=5,
                shuffle_pages_seed=1, keep_logits=True))
            runs[path] = generator.run([Request(i, p, SamplingParams(max_tokens=7))
                                        for i, p in enumerate(prompts(0))])
    assert calls and set(calls) == {"native"}
    atol = LOGITS_ATOL if dtype == torch.float32 else HALF_ATOL[dtype]
    for native_run, torch_run in zip(runs["native"], runs["torch"]):
        assert native_run.output_ids == torch_run.output_ids
        torch.testing.assert_close(torch.stack(native_run.logits),
                                   torch.stack(torch_run.logits), rtol=0, atol=atol)
