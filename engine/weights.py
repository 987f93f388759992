"""Loading a Llama-family checkpoint: an HF safetensors folder or a GGUF file.

Both formats end as one thing: a `Checkpoint` with a validated `ModelConfig`, the
weights as fp32 CPU tensors under *our* names (below), and where the tokenizer lives. The
model (engine/model.py) converts, fuses and moves them; it never sees a file format.

Our names, one set per layer i:
    embed, output (absent when tied), final_norm, rope_frequency_divisors (optional)
    layers.i.attention_norm, layers.i.{q,k,v,o}, layers.i.{q,k,v}_bias (qkv bias only),
    layers.i.mlp_norm, layers.i.{gate,up,down}
Matrices are [out_features, in_features], as torch's linear wants them.

GGUF specifics. Quantized tensors (Q8_0, Q4_0, Q4_1, ...) are dequantized with the gguf
package; its reader already gives each tensor as [rows = out_features, ...]. llama.cpp
stores Llama's Q and K projections with the rows of each head reordered so that its
rotary embedding can rotate *adjacent* pairs (x0, x1), (x2, x3), ...; transformers, and
this engine, rotate the two *halves* of a head, (x_i, x_{i + d/2}). Within a head, HF row
(half, i) was stored as row 2i + half; undoing it is a reshape to [heads, d/2, 2, in] and
a swap of the two middle axes. Qwen2 files are stored in the halves convention already
(llama.cpp rotates halves for them), so only `llama` files are un-permuted.

Every problem with the input is one `ModelFileError` line naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig, ModelFileError

GGUF_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}
_HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "lm_head.weight": "output",
                    "model.norm.weight": "final_norm"}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "embed", "output.weight": "output",
                      "output_norm.weight": "final_norm",
                      "rope_freqs.weight": "rope_frequency_divisors"}


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    tensors: dict  # our name -> fp32 CPU tensor
    source: Path  # the folder or the .gguf file
    gguf_metadata: dict | None  # the GGUF's metadata (tokenizer, chat template); None for HF


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A GGUF file or an HF folder (config.json + *.safetensors); ModelFileError otherwise."""
    path = check_model_path(path)
    return _load_hf_folder(path) if path.is_dir() else _load_gguf(path)


GGUF_MAGIC = b"GGUF"


def check_model_path(path: str | Path) -> Path:
    """The path, when it can be a checkpoint: a file that starts like a GGUF file, or a
    folder with a config.json and *.safetensors files. Reads nothing else (a command checks
    this before a load of many seconds); ModelFileError otherwise."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(f"{path}: no config.json (not an HF model folder)")
        if not any(path.glob("*.safetensors")):
            raise ModelFileError(f"{path}: no *.safetensors files")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelFileError(f"{path}: expected a .gguf file or a folder with config.json "
                             "and *.safetensors")
    try:
        with path.open("rb") as opened:
            magic = opened.read(len(GGUF_MAGIC))
    except OSError as error:
        raise ModelFileError(f"{path}: cannot read it ({error.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it does not start with "
                             f"{GGUF_MAGIC.decode()})")
    return path


def expected_names(config: ModelConfig) -> set[str]:
    names = {"embed", "final_norm"} | (set() if config.tie_word_embeddings else {"output"})
    per_layer = ["attention_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"]
    if config.qkv_bias:
        per_layer += ["q_bias", "k_bias", "v_bias"]
    return names | {f"layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer}


def _rename(name: str, global_names: dict, layer_names: dict, layer_prefix: str) -> str | None:
    """Our name for a file's tensor name, or None for tensors we do not use."""
    if name in global_names:
        return global_names[name]
    if not name.startswith(layer_prefix):
        return None
    index, _, rest = name[len(layer_prefix):].partition(".")
    ours = layer_names.get(rest)
    return f"layers.{index}.{ours}" if ours and index.isdigit() else None


def _check_complete(config: ModelConfig, tensors: dict, source: Path) -> None:
    missing = sorted(expected_names(config) - tensors.keys())
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        shown = ", ".join(missing[:4]) + more
        raise ModelFileError(f"{source}: missing weights {shown}")
    embed_shape = (config.vocab_size, config.hidden_size)
    if tuple(tensors["embed"].shape) != embed_shape:
        raise ModelFileError(f"{source}: embedding is {tuple(tensors['embed'].shape)}, "
                             f"the config says {embed_shape}")


def _load_hf_folder(folder: Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    config_file = folder / "config.json"
    try:
        config = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
    except (json.JSONDecodeError, KeyError, AssertionError) as error:
        raise ModelFileError(f"{config_file}: unusable config ({type(error).__name__}: "
                             f"{error})") from None
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as opened:
                for name in opened.keys():
                    ours = _rename(name, _HF_GLOBAL_NAMES, _HF_LAYER_NAMES, "model.layers.")
                    if ours is not None:
                        tensors[ours] = opened.get_tensor(name).float()
        except (SafetensorError, OSError) as error:
            raise ModelFileError(f"{file}: not a readable safetensors file ({error})") from None
    if config.tie_word_embeddings:
        tensors.pop("output", None)
    _check_complete(config, tensors, folder)
    return Checkpoint(config, tensors, folder, None)


def _read_gguf(file: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(file))
    except Exception as error:  # the reader raises many kinds on a damaged file
        raise ModelFileError(f"{file}: not a readable GGUF file "
                             f"({type(error).__name__}: {error})") from None


def _load_gguf(file: Path) -> Checkpoint:
    reader = _read_gguf(file)
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    names = {tensor.name for tensor in reader.tensors}
    config = ModelConfig.from_gguf_metadata(metadata, has_output_weight="output.weight" in names)
    tensors = {}
    for tensor in reader.tensors:
        ours = _rename(tensor.name, _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES, "blk.")
        if ours is not None:
            tensors[ours] = _dequantize(file, tensor)
    if config.architecture == "llama":
        for i in range(config.num_layers):
            for name, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
                key = f"layers.{i}.{name}"
                if key in tensors:
                    tensors[key] = unpermute_rope_rows(tensors[key], heads)
    _check_complete(config, tensors, file)
    return Checkpoint(config, tensors, file, metadata)


def _dequantize(file: Path, tensor) -> torch.Tensor:
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in GGUF_SUPPORTED_TYPES:
        raise ModelFileError(f"{file}: tensor {tensor.name} has type {kind} "
                             f"(supported: {', '.join(GGUF_SUPPORTED_TYPES)})")
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except Exception as error:
        raise ModelFileError(f"{file}: tensor {tensor.name} cannot be dequantized "
                             f"({type(error).__name__}: {error})") from None
    # a copy: F32 tensors come back as views of the read-only file map
    return torch.from_numpy(np.array(values, dtype=np.float32))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection (module header)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    assert head_dim * num_heads == rows and head_dim % 2 == 0
    trailing = weight.shape[1:]
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *trailing)
    return grouped.transpose(1, 2).reshape(rows, *trailing).contiguous()
