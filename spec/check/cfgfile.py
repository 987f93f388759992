"""Reading TLC model files (.cfg), so that a model is written once for both checkers.

The grammar is TLC's: sections introduced by CONSTANT(S), INIT, NEXT, SPECIFICATION,
INVARIANT(S), PROPERTY/PROPERTIES, SYMMETRY, CONSTRAINT(S), ACTION_CONSTRAINT(S), VIEW,
CHECK_DEADLOCK, POSTCONDITION, ALIAS; comments are `\\*` to end of line and `(* ... *)`.
Constant values are integers, strings, TRUE/FALSE, model values (bare identifiers) and
sets of those. Anything else is reported with its line number, never guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from spec.model import Model, ModelError, TLA_CONSTANTS

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
SOURCE_ROOT = MODELS_DIR.parent.parent
SECTIONS = {
    "CONSTANT": "CONSTANTS", "CONSTANTS": "CONSTANTS", "INIT": "INIT", "NEXT": "NEXT",
    "SPECIFICATION": "SPECIFICATION", "INVARIANT": "INVARIANTS", "INVARIANTS": "INVARIANTS",
    "PROPERTY": "PROPERTIES", "PROPERTIES": "PROPERTIES", "SYMMETRY": "SYMMETRY",
    "CONSTRAINT": "CONSTRAINTS", "CONSTRAINTS": "CONSTRAINTS",
    "ACTION_CONSTRAINT": "ACTION_CONSTRAINTS", "ACTION_CONSTRAINTS": "ACTION_CONSTRAINTS",
    "VIEW": "VIEW", "CHECK_DEADLOCK": "CHECK_DEADLOCK", "POSTCONDITION": "POSTCONDITION",
    "ALIAS": "ALIAS",
}
TOKEN = re.compile(r'\s*(?:(?P<str>"[^"\n]*")|(?P<num>-?\d+)|(?P<id>[A-Za-z_][A-Za-z0-9_]*)'
                   r'|(?P<op><-|[={},]))')


# The constants KVTransfer.tla declares, and the Model field each one sets (a ModelError names
# the field; the user wrote the constant).
CONSTANT_FIELDS = {"Requests": "requests", "NoReq": None,
                   "PrefillWorkers": "prefill_workers", "DecodeWorkers": "decode_workers",
                   "NoWorker": None,
                   **{constant: field for field, constant in TLA_CONSTANTS.items()},
                   "Losses": "losses", "Bugs": "bugs"}
_SIZES = tuple((field, constant) for field, constant in TLA_CONSTANTS.items()
               if field.endswith("_pages") or field in ("tokens", "tenants"))
_FLAGS = tuple((field, constant) for field, constant in TLA_CONSTANTS.items()
               if field not in dict(_SIZES))


class CfgError(ValueError):
    """A .cfg file this tool cannot read, with the file and line."""


@dataclass(frozen=True)
class ModelValueName:
    name: str


def as_written(value) -> str:
    """A parsed constant value as a .cfg file spells it (`two`, `{r1, r2}`, `"x"`, `TRUE`),
    for messages: the reader wrote that, not a Python repr."""
    if isinstance(value, ModelValueName):
        return value.name
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, frozenset):
        return "{" + ", ".join(sorted(as_written(v) for v in value)) + "}"
    return str(value)


@dataclass
class CfgFile:
    path: str
    constants: dict[str, object] = field(default_factory=dict)
    specification: str | None = None
    init: str | None = None
    next: str | None = None
    invariants: list[str] = field(default_factory=list)
    properties: list[str] = field(default_factory=list)
    symmetry: str | None = None
    check_deadlock: bool = True
    unsupported: list[str] = field(default_factory=list)


def _strip_comments(text: str) -> str:
    text = re.sub(r"\(\*.*?\*\)", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"\\\*.*", "", text)


def _tokens(text: str, path: str):
    for lineno, line in enumerate(text.splitlines(), 1):
        pos = 0
        while pos < len(line):
            if line[pos:].strip() == "":
                break
            m = TOKEN.match(line, pos)
            if not m:
                raise CfgError(f"{path}:{lineno}: cannot read {line[pos:].strip()!r}")
            pos = m.end()
            kind = m.lastgroup
            yield lineno, kind, m.group(kind)


def _value(tokens: list, i: int, path: str) -> tuple[object, int]:
    lineno, kind, text = tokens[i]
    if kind == "num":
        return int(text), i + 1
    if kind == "str":
        return text[1:-1], i + 1
    if kind == "id":
        if text in ("TRUE", "FALSE"):
            return text == "TRUE", i + 1
        return ModelValueName(text), i + 1
    if text == "{":
        items: list[object] = []
        i += 1
        while tokens[i][2] != "}":
            item, i = _value(tokens, i, path)
            items.append(item)
            if tokens[i][2] == ",":
                i += 1
            elif tokens[i][2] != "}":
                raise CfgError(f"{path}:{tokens[i][0]}: expected ',' or '}}' in a set")
        return frozenset(items), i + 1
    raise CfgError(f"{path}:{lineno}: a constant value cannot start with {text!r}")


def parse_cfg(text: str, path: str = "<cfg>") -> CfgFile:
    cfg = CfgFile(path=path)
    tokens = list(_tokens(_strip_comments(text), path))
    tokens.append((0, "end", ""))
    section = None
    i = 0
    while tokens[i][1] != "end":
        lineno, kind, text_ = tokens[i]
        if kind == "id" and text_ in SECTIONS:
            section = SECTIONS[text_]
            i += 1
            continue
        if section is None:
            raise CfgError(f"{path}:{lineno}: {text_!r} outside any section")
        if kind != "id":
            raise CfgError(f"{path}:{lineno}: unexpected {text_!r} in {section}")
        if section == "CONSTANTS":
            op = tokens[i + 1]
            if op[2] == "<-":
                raise CfgError(f"{path}:{lineno}: substitution '{text_} <- ...' is not "
                               "supported; assign a value with '='")
            if op[2] != "=":
                raise CfgError(f"{path}:{lineno}: expected '=' after constant {text_}")
            if text_ in cfg.constants:
                # TLC rejects this too; silently keeping the last value hides a typo.
                raise CfgError(f"{path}:{lineno}: constant {text_} is assigned twice")
            value, i = _value(tokens, i + 2, path)
            cfg.constants[text_] = value
            continue
        if section == "INVARIANTS":
            cfg.invariants.append(text_)
        elif section == "PROPERTIES":
            cfg.properties.append(text_)
        elif section == "SPECIFICATION":
            cfg.specification = text_
        elif section == "INIT":
            cfg.init = text_
        elif section == "NEXT":
            cfg.next = text_
        elif section == "SYMMETRY":
            cfg.symmetry = text_
        elif section == "CHECK_DEADLOCK":
            if text_ not in ("TRUE", "FALSE"):
                raise CfgError(f"{path}:{lineno}: CHECK_DEADLOCK takes TRUE or FALSE")
            cfg.check_deadlock = text_ == "TRUE"
        else:
            cfg.unsupported.append(f"{section} {text_}")
        i += 1
    return cfg


def _int_constant(cfg: CfgFile, name: str) -> int:
    if name not in cfg.constants:
        raise CfgError(f"{cfg.path}: constant {name} is not set")
    value = cfg.constants[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise CfgError(f"{cfg.path}: constant {name} must be an integer, got "
                       f"{as_written(value)}")
    return value


def model_from_cfg(cfg: CfgFile, name: str) -> Model:
    """The Model of a KVTransfer .cfg file."""
    if cfg.unsupported:
        raise CfgError(f"{cfg.path}: not supported by the Python checker: "
                       f"{'; '.join(cfg.unsupported)}")
    unknown = sorted(set(cfg.constants) - set(CONSTANT_FIELDS))
    if unknown:
        raise CfgError(f"{cfg.path}: unknown constant(s) {', '.join(unknown)}; KVTransfer.tla "
                       f"declares {', '.join(CONSTANT_FIELDS)}")
    requests = cfg.constants.get("Requests")
    if not isinstance(requests, frozenset) or not requests or not all(
            isinstance(r, ModelValueName) for r in requests):
        raise CfgError(f"{cfg.path}: Requests must be a non-empty set of model values")
    if not isinstance(cfg.constants.get("NoReq"), ModelValueName):
        raise CfgError(f"{cfg.path}: NoReq must be a model value (NoReq = NoReq)")
    workers = {}
    for constant, key, letter in (("PrefillWorkers", "prefill_workers", "p"),
                                  ("DecodeWorkers", "decode_workers", "d")):
        # Absent: a file from before worker sets, one worker of each.
        value = cfg.constants.get(constant, frozenset({ModelValueName(f"{letter}1")}))
        wanted = {ModelValueName(f"{letter}{i + 1}") for i in range(len(value))} \
            if isinstance(value, frozenset) else None
        if not value or value != wanted:
            raise CfgError(f"{cfg.path}: {constant} must be the model values {letter}1, "
                           f"{letter}2, ... (got {as_written(value)})")
        workers[key] = len(value)
    if "NoWorker" in cfg.constants and not isinstance(cfg.constants["NoWorker"],
                                                      ModelValueName):
        raise CfgError(f"{cfg.path}: NoWorker must be a model value (NoWorker = NoWorker)")
    bugs = cfg.constants.get("Bugs", frozenset())
    if not isinstance(bugs, frozenset) or not all(isinstance(b, str) for b in bugs):
        raise CfgError(f"{cfg.path}: Bugs must be a set of strings")
    losses = cfg.constants.get("Losses", frozenset())  # absent: a file from before losses
    if not isinstance(losses, frozenset) or not all(isinstance(k, str) for k in losses):
        raise CfgError(f"{cfg.path}: Losses must be a set of strings")
    if cfg.specification not in (None, "Spec", "FairSpec", "LossyFairSpec"):
        raise CfgError(f"{cfg.path}: SPECIFICATION must be Spec, FairSpec or LossyFairSpec")
    if losses and cfg.specification == "FairSpec":
        # kvproof decides liveness with loss steps left out of the graph; TLC, under FairSpec
        # alone, would find a message lost and sent again for ever.
        raise CfgError(f"{cfg.path}: a model whose network loses things (Losses) is checked "
                       "under SPECIFICATION LossyFairSpec (liveness under finitely many "
                       "losses), not FairSpec")
    names = tuple(sorted(r.name for r in requests))
    sizes = {key: _int_constant(cfg, name) for key, name in _SIZES}
    flags = {}
    for key, constant in _FLAGS:
        if constant not in cfg.constants:
            raise CfgError(f"{cfg.path}: constant {constant} is not set")
        flags[key] = cfg.constants[constant]
        if not isinstance(flags[key], bool):
            raise CfgError(f"{cfg.path}: {constant} must be TRUE or FALSE, got "
                           f"{as_written(flags[key])}")
    try:
        return Model(
            requests=len(names),
            **sizes,
            **workers,
            bugs=frozenset(bugs),
            losses=frozenset(losses),
            **flags,
            name=name,
            request_names=names,
        )
    except ModelError as error:
        raise CfgError(f"{cfg.path}: {_in_constant_names(str(error))}") from error


def _in_constant_names(message: str) -> str:
    """A Model error as the .cfg's author reads it: `DecodePages`, not `decode_pages`."""
    for constant, name in CONSTANT_FIELDS.items():
        if name:
            message = re.sub(rf"\b{name}\b", constant, message)
    return message


def cfg_for(model: Model, invariants: tuple[str, ...], properties: tuple[str, ...],
            symmetry: str = "") -> str:
    """A TLC .cfg file for this model: the inverse of model_from_cfg."""
    requests = ", ".join(model.request_names)
    bugs = ", ".join(f'"{b}"' for b in sorted(model.bugs))
    lines = ["CONSTANTS", f"    Requests = {{{requests}}}", "    NoReq = NoReq",
             f"    PrefillWorkers = {{{', '.join(model.prefill_worker_names)}}}",
             f"    DecodeWorkers = {{{', '.join(model.decode_worker_names)}}}",
             "    NoWorker = NoWorker",
             f"    MaxPromptPages = {model.max_prompt_pages}",
             f"    ContextPages = {model.context_pages}",
             f"    PrefillPages = {model.prefill_pages}", f"    DecodePages = {model.decode_pages}",
             f"    Crashes = {'TRUE' if model.crashes else 'FALSE'}",
             f"    DecodeCrashes = {'TRUE' if model.decode_crashes else 'FALSE'}",
             f"    EarlyTimeouts = {'TRUE' if model.early_timeouts else 'FALSE'}",
             f"    PrefixCache = {'TRUE' if model.prefix_cache else 'FALSE'}",
             f"    Tokens = {model.tokens}", f"    Tenants = {model.tenants}",
             f"    PrefillCache = {'TRUE' if model.prefill_cache else 'FALSE'}",
             f"    Losses = {{{', '.join(chr(34) + k + chr(34) for k in sorted(model.losses))}}}",
             f"    Bugs = {{{bugs}}}",
             f"SPECIFICATION {'LossyFairSpec' if model.losses else 'FairSpec'}", "INVARIANTS",
             *[f"    {n}" for n in invariants]]
    if properties:
        lines += ["PROPERTIES", *[f"    {p}" for p in properties]]
    if symmetry:
        lines += ["SYMMETRY", f"    {symmetry}"]
    return "\n".join(lines + ["CHECK_DEADLOCK FALSE", ""])


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.cfg"))


def model_description(name_or_path: str) -> str:
    """The first sentence of a .cfg file's leading comment (what the model is for)."""
    lines = []
    for line in resolve(name_or_path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("\\*") or "Generated by" in line:
            break
        lines.append(line[2:].strip())
    text = " ".join(lines)
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def resolve(name_or_path: str) -> Path:
    """A model name (a .cfg in spec/models) or a path to a .cfg file: from the working folder,
    or else from the source tree's root, so that `spec/models/large.cfg` reads from anywhere."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".cfg" and candidate.exists():
        return candidate
    in_spec = MODELS_DIR / f"{name_or_path}.cfg"
    if in_spec.exists():
        return in_spec
    if candidate.suffix == ".cfg" or "/" in name_or_path:
        from_root = SOURCE_ROOT / candidate
        if not candidate.is_absolute() and not candidate.exists() and from_root.exists():
            return from_root
        return candidate
    raise CfgError(f"no model {name_or_path!r}: not a .cfg file, and not one of "
                   f"{', '.join(model_names())}")


def load(name_or_path: str) -> tuple[CfgFile, Model]:
    path = resolve(name_or_path)
    if path.is_dir():
        raise CfgError(f"{name_or_path}: is a folder, not a .cfg file")
    if not path.exists():
        raise CfgError(f"{name_or_path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise CfgError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise CfgError(f"{path}: not a text file (byte {error.start} is not UTF-8)") from None
    if not text.strip():
        raise CfgError(f"{name_or_path}: is empty ({len(text.encode())} bytes)")
    cfg = parse_cfg(text, str(path))
    return cfg, model_from_cfg(cfg, path.stem)
