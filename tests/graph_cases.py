"""Builders shared by the graph tests (tests/test_engine_graphs.py on the CPU,
tests/test_engine_graphs_cuda.py on a GPU): a tiny random Llama straight from tensors, a
Generator with five prefilled sequences of mixed lengths ready for a decode step, and
that step taken both ways (plain and padded) from the same pool state. No pytest here:
the CUDA file also runs with plain python."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.generate import Generator, GeneratorConfig, Request, decode_step, prefill_step
from engine.model import LlamaModel
from engine.weights import Checkpoint

PAGE_TOKENS = 4
PROMPT_LENGTHS = (1, 3, 9, 14, 22)  # 5 sequences: bucket 8, three padding rows
LOGITS_ATOL = 1e-5  # fp32; a wrong page or position moves logits by ~1e-1


def tiny_model(head_dim: int = 16, num_heads: int = 4, num_kv_heads: int = 2,
               num_layers: int = 2, seed: int = 0, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A random Llama (GQA, untied output) built straight from tensors."""
    config = ModelConfig(architecture="llama", hidden_size=64, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         intermediate_size=96, vocab_size=211, rms_norm_eps=1e-6,
                         rope_theta=10000.0)
    generator = torch.Generator().manual_seed(seed)

    def random(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    hidden, q_out, kv_out = config.hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    tensors = {"embed": random(config.vocab_size, hidden, scale=1.0),
               "output": random(config.vocab_size, hidden), "final_norm": 1 + random(hidden)}
    for i in range(num_layers):
        tensors.update({f"layers.{i}.{name}": tensor for name, tensor in (
            ("attention_norm", 1 + random(hidden)), ("mlp_norm", 1 + random(hidden)),
            ("q", random(q_out, hidden)), ("k", random(kv_out, hidden)),
            ("v", random(kv_out, hidden)), ("o", random(hidden, q_out)),
            ("gate", random(96, hidden)), ("up", random(96, hidden)),
            ("down", random(hidden, 96)))})
    return LlamaModel(Checkpoint(config, tensors, source=None, gguf_metadata=None), device,
                      dtype)


def running_batch(model: LlamaModel, graph_max_pages: int = 8):
    """A Generator (with graphs, not captured) and five prefilled sequences of mixed
    lengths on shuffled pages, each with one output token: ready for a decode step."""
    generator = Generator(model, GeneratorConfig(
        num_pages=48, page_tokens=PAGE_TOKENS, max_batch=8, shuffle_pages_seed=3,
        cuda_graphs=True, graph_max_pages=graph_max_pages))
    tokens = torch.Generator().manual_seed(1)
    sequences = []
    for index, length in enumerate(PROMPT_LENGTHS):
        prompt = tuple(torch.randint(1, 211, (length,), generator=tokens).tolist())
        pages = generator.free_pages.take(-(-(length + 4) // PAGE_TOKENS))
        sequences.append(generator.start_sequence(Request(index, prompt), pages))
    prefill_step(model, generator.pool, sequences, token_budget=1000)
    for sequence in sequences:
        sequence.output_ids.append(int(torch.randint(1, 211, (), generator=tokens)))
    return generator, sequences


def decode_both_ways(generator, sequences, graphs=None):
    """(eager logits, eager tag_ok, padded logits, padded tag_ok, pool kv after the
    padded step, written slots), each path from the same pool state."""
    pool = generator.pool
    kv_before = pool.kv.clone()
    logits, tag_ok = decode_step(generator.model, pool, sequences)
    pool.kv.copy_(kv_before)
    padded_logits, padded_tag_ok = decode_step(generator.model, pool, sequences,
                                               graphs=graphs or generator.graphs)
    return logits, tag_ok, padded_logits, padded_tag_ok, kv_before


def pages_changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return {page for page in range(before.shape[0]) if not torch.equal(before[page], after[page])}


def written_pages(sequences) -> set[int]:
    return {s.pages[(s.num_tokens - 1) // PAGE_TOKENS] for s in sequences}
