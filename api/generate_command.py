"""`kvproof generate`: complete prompts with the engine and print tokens/s.

    kvproof generate [--model PATH] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                     [--threads N] [--max-tokens N] [--temperature T] [--top-p P]
                     [--top-k K] [--seed S] [--stop TEXT ...] [--chat] PROMPT...

All prompts run as one batch (continuous batching over one paged pool). Exit status 0,
or 2 on bad input (a missing model, an unreadable file, an empty prompt) with one line
saying why, found before the model loads wherever it can be (api/engine_options.py); the
default model is never downloaded: when it is missing the line gives the install command.
"""

from __future__ import annotations

import argparse
import sys

from api import engine_options
from api.clikit import EXIT_OK, EXIT_USAGE, UsageError, non_negative_float

EXIT_CODES = """exit status:
  0  every prompt was completed (its finish reason is printed after it)
  2  bad input (an option's value, a model that cannot be used, an empty prompt): one line,
     before the model loads wherever it can be known then"""
EXAMPLES = [
    'kvproof generate --chat "What is the capital of France?"',
    "kvproof generate --model path/to/model.gguf --dtype bfloat16 --max-tokens 64 "
    '"Once upon a time"',
    'kvproof generate --threads 1 "Once upon a time"     # one torch thread',
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    engine_options.add_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt in the model's chat template")


def run(args: argparse.Namespace) -> int:
    from engine.config import ModelFileError

    try:
        return _generate(args)
    except (UsageError, ModelFileError, AssertionError) as error:
        print(f"kvproof generate: {error}", file=sys.stderr)
        return EXIT_USAGE


def _generate(args: argparse.Namespace) -> int:
    empty = [str(number) for number, prompt in enumerate(args.prompts, 1) if prompt == ""]
    if empty:  # before torch is imported: the quickest refusal
        raise UsageError(f"prompt {', '.join(empty)} is empty; give the text to complete")
    from engine.config import ModelFileError
    from engine.generate import Generator, GeneratorConfig, Request, pages_needed
    from engine.load import load_model
    from engine.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              stop=tuple(args.stop))
    threads = engine_options.prepare(args)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ModelFileError(f"{loaded.path}: no tokenizer.json; cannot read text prompts")
    prompts = [tokenizer.encode_chat(p) if args.chat else tokenizer.encode(p)
               for p in args.prompts]
    config = GeneratorConfig()
    num_pages = sum(pages_needed(len(p), args.max_tokens, config.page_tokens) for p in prompts)
    generator = Generator(loaded.model, GeneratorConfig(num_pages=num_pages), tokenizer)
    completions = generator.run([Request(i, tuple(p), sampling) for i, p in enumerate(prompts)])
    for prompt, completion in zip(args.prompts, completions):
        print(f"> {prompt}\n{completion.text}\n[{completion.finish_reason}, "
              f"{len(completion.output_ids)} tokens]\n")
    stats = generator.stats
    print(f"{loaded.path.name} on {args.device} ({args.dtype}, {threads} torch "
          f"thread{'s' if threads > 1 else ''}), loaded in {loaded.load_s:.1f} s; "
          f"prefill {stats.prefill_tokens} tokens at "
          f"{stats.prefill_tokens / max(stats.prefill_s, 1e-9):,.0f} tok/s; decode "
          f"{stats.decode_tokens} tokens at {stats.decode_tokens / max(stats.decode_s, 1e-9):,.1f} "
          f"tok/s (batch {len(prompts)})")
    return EXIT_OK
