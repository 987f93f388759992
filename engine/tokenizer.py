"""Tokenizer and chat template, from the same source as the weights.

An HF folder carries tokenizer.json (a `tokenizers` pipeline, loaded as is) and
tokenizer_config.json (the chat template, the BOS/EOS tokens). A GGUF file carries the
vocabulary in its metadata instead: `tokenizer.ggml.tokens` (id -> token string),
`tokenizer.ggml.merges` ("left right" BPE merges in priority order), `token_type` (3 =
control, 4 = user-defined: both are matched whole in text, never split by BPE) and the
special ids; `tokenizer.ggml.model == "gpt2"` means byte-level BPE, which we rebuild as a
`tokenizers` BPE model with a byte-level pre-tokenizer and decoder. llama.cpp's "smollm"
pre-tokenizer first splits every digit on its own, then applies GPT-2's regex; that is
Digits(individual) + ByteLevel here. Other pre-tokenizer names get plain ByteLevel (the
GPT-2 regex), which is close but not guaranteed identical for them.

Chat templates are Jinja2, rendered in a sandbox with the variables transformers gives
them (messages, add_generation_prompt, bos_token, eos_token) and its whitespace options
(trim_blocks, lstrip_blocks), so that a template written for transformers renders the same.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelFileError

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types matched whole in text
INCOMPLETE = "\ufffd"  # what a decoder shows for bytes that are not a whole character


@dataclass(frozen=True)
class Tokenizer:
    backend: object  # tokenizers.Tokenizer
    eos_token_ids: frozenset
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to messages ({"role", "content"} dicts)."""
        if not self.chat_template:
            raise ModelFileError("this model has no chat template (run without --chat)")
        return _render_template(self.chat_template, messages, add_generation_prompt,
                                self._token_or_empty(self.bos_token_id),
                                self._token_or_empty(min(self.eos_token_ids, default=None)))

    def encode_chat(self, user_text: str) -> list[int]:
        """Token ids of one user turn with the assistant's turn opened. Rendered templates
        spell out their BOS token themselves, so none is added here."""
        text = self.render_chat([{"role": "user", "content": user_text}])
        return self.backend.encode(text, add_special_tokens=False).ids

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def _render_template(template: str, messages, add_generation_prompt: bool, bos: str,
                     eos: str) -> str:
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos, eos_token=eos)
    except TemplateError as error:
        raise ModelFileError(f"the chat template failed: {error}") from None


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The chat template compiled once: compiling took ~3.5 ms of pure Python per request
    (rendering the compiled one ~0.05 ms), all of it holding the GIL on a tokenizing thread
    while the event loop waited to answer a burst's 503s. A compiled template renders from
    many threads at once (jinja2 keeps no state between renders)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template)


def tokenizer_from_gguf_metadata(metadata: dict, source: Path) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFileError(f"{source}: tokenizer model {kind!r} is not supported (only "
                             "byte-level BPE, 'gpt2')")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFileError(f"{source}: no tokenizer.ggml.tokens in the metadata")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab={token: i for i, token in enumerate(tokens)},
                                 merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if metadata.get("tokenizer.ggml.pre") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types)
                                if kind in (_CONTROL, _USER_DEFINED)])
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    return Tokenizer(backend=backend,
                     eos_token_ids=frozenset(i for i in (eos, eot) if i is not None),
                     bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                     add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=metadata.get("tokenizer.chat_template"))


def tokenizer_from_hf_folder(folder: Path) -> Tokenizer | None:
    """None when the folder has no tokenizer.json (the tests' random models)."""
    from tokenizers import Tokenizer as Backend

    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        backend = Backend.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception on a bad file
        raise ModelFileError(f"{file}: not a readable tokenizer ({error})") from None
    settings = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    config = _read_json(folder / "config.json")
    eos = _token_ids(backend, settings.get("eos_token"))
    for source in (generation, config):
        eos |= _as_id_set(source.get("eos_token_id"))
    bos_ids = _token_ids(backend, settings.get("bos_token"))
    template = settings.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return Tokenizer(backend=backend, eos_token_ids=frozenset(eos),
                     bos_token_id=min(bos_ids) if bos_ids else None,
                     add_bos_token=bool(settings.get("add_bos_token", False)),
                     chat_template=template)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{file}: not valid JSON ({error})") from None


def _token_ids(backend, token) -> set[int]:
    """The id of a special token given as a string or an {"content": ...} dict."""
    if isinstance(token, dict):
        token = token.get("content")
    token_id = backend.token_to_id(token) if isinstance(token, str) else None
    return set() if token_id is None else {token_id}


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {int(value)}


@dataclass
class IncrementalText:
    """The decoded text of a growing list of token ids (the same list, only appended to),
    one decode of a short window per new token instead of the whole list (quadratic).

    Two offsets into the ids: the text of ids[:read_offset] is `text`, whole characters;
    each update decodes the window ids[prefix_offset:] and its first part, up to
    read_offset, and what the window adds beyond that part is new. The window starts
    before the new ids because a token's text can depend on the ones before it (a leading
    space, a character whose bytes span tokens). New text is taken only when it does not
    end with U+FFFD (half a character); then prefix_offset moves to the old read_offset
    and read_offset to the end. Until then it is `tail`, and `incomplete` says so: the
    whole text ends with half a character exactly when the window does."""

    tokenizer: Tokenizer
    text: str = ""
    tail: str = ""
    incomplete: bool = False
    prefix_offset: int = 0
    read_offset: int = 0
    seen: int = 0  # len(ids) at the last update
    prefix: str = ""  # the text of ids[prefix_offset:read_offset]

    @property
    def whole(self) -> str:
        """The whole text, half a character at the end included (as U+FFFD)."""
        return self.text + self.tail

    def update(self, ids: list[int]) -> str:
        """`text` for `ids` (the list seen before, appended to)."""
        if len(ids) == self.seen:
            return self.text
        self.seen = len(ids)
        self.tail = self._new_text(ids)
        self.incomplete = self.tail.endswith(INCOMPLETE)
        if self.tail and not self.incomplete:
            self.text += self.tail
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self.prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset])
            self.tail = ""
        return self.text

    def peek(self, ids: list[int], token: int) -> str:
        """The whole text of ids + [token], taking nothing (`ids` as of the last update)."""
        assert len(ids) == self.seen, "update before peeking"
        return self.text + self._new_text(ids, token)

    def _new_text(self, ids: list[int], token: int | None = None) -> str:
        """The text after `text` of ids (+ token): what the window adds to `prefix`."""
        extra = [] if token is None else [token]
        window = self.tokenizer.decode(ids[self.prefix_offset:] + extra)
        if window.startswith(self.prefix):
            return window[len(self.prefix):]
        # A decoder that rewrites text it showed already (none that kvproof loads does):
        # the whole text, decoded once.
        whole = self.tokenizer.decode(ids + extra)
        return whole[len(self.text):] if whole.startswith(self.text) else ""
