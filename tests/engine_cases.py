"""Tiny random Llama-family models for the engine tests, built with transformers and saved
as HF folders (config.json + model.safetensors), and the comparison with transformers.

Each config is small enough that building, saving and loading it takes well under a
second, and covers one feature: grouped-query attention with untied output, tied
embeddings with Llama 3 rope scaling, linear rope scaling, Qwen2's qkv bias."""

from __future__ import annotations

import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=211, max_position_embeddings=512,
            rms_norm_eps=1e-6)

CONFIGS = {
    "llama-gqa": ("llama", dict(rope_theta=10000.0)),
    "llama3-scaled-tied": ("llama", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-linear": ("llama", dict(rope_theta=10000.0,
                                   rope_scaling=dict(rope_type="linear", factor=4.0))),
    "qwen2": ("qwen2", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
}

# fp32 everywhere; the engine fuses q|k|v and gate|up and uses torch's fused attention,
# so sums run in another order than transformers': differences are ~1e-6 on logits of
# order 1. The tolerance leaves two orders of magnitude and still catches any real error
# (a wrong page, position or rope frequency moves logits by ~1e-1).
LOGITS_ATOL = 1e-4


def make_hf_model(name: str, folder, seed: int = 0):
    """A random transformers model of config `name`, saved into `folder`; returned in
    eval mode for comparison."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, extra = CONFIGS[name]
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, **extra))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, **extra))
    with torch.no_grad():
        # random biases and norm weights: transformers initialises them to zero and one,
        # values under which a bias or a norm weight applied twice, or not at all, or to
        # the wrong layer, changes nothing
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("bias"):
                parameter.normal_(0, 0.5)
            elif parameter_name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def reference_logits(hf_model, prompt_ids, output_ids) -> torch.Tensor:
    """transformers' logits at the positions that chose each output token:
    [len(output_ids), vocab]."""
    tokens = torch.tensor([list(prompt_ids) + list(output_ids)])
    logits = hf_model(tokens).logits[0]
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(output_ids)]


class FaultyPrefill:
    """A model whose prefill step fails for the chunks holding `marker` (a token id only the
    victim's prompt has), the way a real step fails for one request: "raise" raises
    torch.OutOfMemoryError for the whole step that computes such a chunk (batched with
    others or not); "nan_logits" makes that chunk's logits NaN; "nan_kv" writes NaN into
    the last layer's K/V at that chunk's slots, which no logit of the step reads. Everything
    else is the wrapped model's. `failed_batches`: the chunk count of every failed step."""

    MODES = ("raise", "nan_logits", "nan_kv")

    def __init__(self, model, marker: int, mode: str):
        assert mode in self.MODES, mode
        self.model, self.marker, self.mode = model, marker, mode
        self.failed_batches: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def prefill(self, pool, chunks, all_logits: bool = False):
        hit = [i for i, chunk in enumerate(chunks) if bool((chunk.token_ids == self.marker).any())]
        if hit and self.mode == "raise":
            self.failed_batches.append(len(chunks))
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        logits = self.model.prefill(pool, chunks, all_logits)
        if hit:
            self.failed_batches.append(len(chunks))
        with torch.inference_mode():  # the logits are an inference tensor
            for i in hit:
                if self.mode == "nan_logits":
                    logits[i] = float("nan")
                else:
                    slots = chunks[i].slots.long()
                    page_tokens = pool.kv.shape[4]
                    pool.kv[slots // page_tokens, -1, :, :, slots % page_tokens] = float("nan")
        return logits
