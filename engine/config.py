"""The shape of a Llama-family decoder, validated once, from either source.

Llama 2/3, SmolLM2 and Qwen2 are one architecture with a few switches: grouped-query
attention (fewer KV heads than query heads), a bias on the Q/K/V projections (Qwen2),
the input embedding reused as the output projection (tied embeddings: SmolLM2, small
Qwen2), and how rotary position embeddings stretch to longer contexts (rope scaling).
`ModelConfig` names exactly those choices; `from_hf_config` reads a transformers
config.json dict and `from_gguf_metadata` the `{architecture}.*` keys of a GGUF file, so
that the model code never looks at either format.

Rope scaling kinds:
- "none": frequencies theta^(-2i/d) as trained.
- "linear": every position divided by `factor` (equivalently every frequency).
- "llama3": Llama 3.1's piecewise rule: wavelengths shorter than
  original_max_position_embeddings / high_frequency_factor keep their frequency, those
  longer than original_max_position_embeddings / low_frequency_factor are divided by
  `factor`, and the band between is interpolated smoothly.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_KINDS = ("none", "linear", "llama3")
ARCHITECTURES = ("llama", "qwen2")


class ModelFileError(ValueError):
    """A model file or folder that cannot be used: the message is one line naming the
    file and the problem (the user's input, not our bug)."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"
    factor: float = 1.0
    low_frequency_factor: float = 1.0
    high_frequency_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        assert self.kind in ROPE_KINDS, f"rope scaling {self.kind!r}: expected one of {ROPE_KINDS}"
        assert self.factor > 0, "rope scaling factor must be positive"
        if self.kind == "llama3":
            assert 0 < self.low_frequency_factor < self.high_frequency_factor
            assert self.original_max_position_embeddings > 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        assert self.architecture in ARCHITECTURES, f"architecture {self.architecture!r}"
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            assert getattr(self, name) > 0, f"{name} must be positive"
        assert self.num_heads % self.num_kv_heads == 0, \
            f"{self.num_heads} query heads do not share {self.num_kv_heads} KV heads evenly"
        assert self.head_dim % 2 == 0, "rotary embeddings rotate pairs: head_dim must be even"
        assert self.rms_norm_eps > 0 and self.rope_theta > 0

    @property
    def query_group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelConfig:
        """From a transformers config.json (LlamaForCausalLM, Qwen2ForCausalLM)."""
        model_type = config.get("model_type", "llama")
        if model_type not in ARCHITECTURES:
            raise ModelFileError(f"config.json: model_type {model_type!r} is not one of "
                                 f"{ARCHITECTURES}")
        if config.get("hidden_act", "silu") != "silu":
            raise ModelFileError(f"config.json: hidden_act {config['hidden_act']!r} (only silu)")
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        return cls(
            architecture=model_type, hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=rope.get("rope_theta") or config.get("rope_theta", 10000.0),
            rope_scaling=_hf_rope_scaling(rope),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            max_position_embeddings=config.get("max_position_embeddings", 4096))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, has_output_weight: bool) -> ModelConfig:
        """From a GGUF file's metadata (plain Python values); `has_output_weight` says
        whether the file stores an output projection (otherwise it is tied)."""
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelFileError(f"GGUF architecture {arch!r} is not one of {ARCHITECTURES}")

        def key(name: str, default=None):
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelFileError(f"GGUF metadata lacks {arch}.{name}")
            return value

        num_heads = int(key("attention.head_count"))
        hidden_size = int(key("embedding_length"))
        return cls(
            architecture=arch, hidden_size=hidden_size, num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("rope.dimension_count", hidden_size // num_heads)),
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(key("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(metadata, arch),
            tie_word_embeddings=not has_output_weight, qkv_bias=arch == "qwen2",
            max_position_embeddings=int(key("context_length", 4096)))


def _hf_rope_scaling(rope: dict) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(rope["factor"]),
            low_frequency_factor=float(rope["low_freq_factor"]),
            high_frequency_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    raise ModelFileError(f"config.json: rope scaling {kind!r} is not supported "
                         f"(supported: default, linear, llama3)")


def _gguf_rope_scaling(metadata: dict, arch: str) -> RopeScaling:
    """GGUF stores linear scaling as metadata; llama.cpp stores Llama 3 scaling as a
    `rope_freqs` tensor of per-frequency divisors instead, which the weights loader hands
    to the model (so the config says "none" for it)."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
    raise ModelFileError(f"GGUF rope scaling {kind!r} is not supported (supported: linear)")
