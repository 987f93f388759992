"""Tiny models for the server tests: a random Llama (tests/engine_cases.py's shape) with a
character-level tokenizer of its own, so that text goes in and text comes out.

The tokenizer maps each printable ASCII character (and newline) to one token and fuses
tokens back into text, so every token decodes to exactly one character and a completion's
text is as long as its token count. Its chat template wraps each message in <role> tags.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tests.engine_cases import TINY

SPECIAL = ("<unk>", "<s>", "</s>")
CHARACTERS = tuple(string.printable[:95]) + ("\n",)  # digits, letters, punctuation, space
VOCAB = SPECIAL + CHARACTERS
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_tiny_chat_model(folder: Path, seed: int = 0, max_position_embeddings: int = 512) -> Path:
    """A random tiny Llama with a character tokenizer, saved into `folder`."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    shape = dict(TINY, vocab_size=len(VOCAB), max_position_embeddings=max_position_embeddings)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**shape, rope_theta=10000.0, bos_token_id=1,
                                 eos_token_id=2)).eval().save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        dict(eos_token="</s>", bos_token="<s>", add_bos_token=False,
             chat_template=CHAT_TEMPLATE)))
    return folder
