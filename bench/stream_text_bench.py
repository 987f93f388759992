"""The stream's text handling per token, for one long completion: decoding the whole output
at every token (engine.streaming.emit_whole_text and, with stop strings,
engine.generate.hits_stop_whole_text: the rules before) next to the incremental text
(engine.streaming.emit, engine.generate's stop check). No model runs: the completion's
token ids are the default model's tokenizer's encoding of a long mixed text (English,
accents, CJK, emoji), fed to the stream one at a time as a decode step would.

    python bench/stream_text_bench.py                 # 2,000 tokens, 3 repeats
    python bench/stream_text_bench.py --tokens 500 --stop "\\n\\n"

Prints, for each: the median time per token over the whole completion and over its last
100 tokens (where the whole-text rule is slowest), and whether both streamed the same
events. Repeats alternate so a neighbour's load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import generate, streaming  # noqa: E402
from engine.generate import Request, SamplingParams, Sequence  # noqa: E402
from engine.load import load_tokenizer  # noqa: E402
from engine.service import GenerationRequest  # noqa: E402

TEXT = ("The café on the corner serves crème brûlée and naïve jokes. 東京の天気は晴れです。"
        "我们明天见 🎉👍🏽 Ünïcödé façade, señor! 😀 日本語のテキスト and plain English words. ")


def completion_ids(tokenizer, tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(TEXT)
    return ids[:tokens]


def stream_once(tokenizer, ids: list[int], stop: tuple[str, ...], emit) -> tuple[list, list]:
    """(seconds per token, events) streaming `ids` through next_token with `emit`."""
    events: list = []
    sampling = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop)
    live = streaming.Live(0, GenerationRequest((1,), sampling), events.append, 1, 0.0)
    live.sequence = Sequence(Request(0, (1,), sampling), [], None, None, None)
    times = []
    saved = streaming.emit, generate._hits_stop
    streaming.emit = emit
    if emit is streaming.emit_whole_text:
        generate._hits_stop = generate.hits_stop_whole_text
    try:
        for token in ids:
            started = time.perf_counter()
            reason = streaming.next_token(live, token, None, tokenizer)
            times.append(time.perf_counter() - started)
            if reason is not None:
                break
    finally:
        streaming.emit, generate._hits_stop = saved
    return times, [(e.token_id, e.text) for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop", action="append", default=[])
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    ids = completion_ids(tokenizer, args.tokens)
    rules = {"whole text (before)": streaming.emit_whole_text, "incremental (now)": streaming.emit}
    per_token = {name: [] for name in rules}
    tail = {name: [] for name in rules}
    events = {}
    for _ in range(args.repeats):
        for name, emit in rules.items():
            times, events[name] = stream_once(tokenizer, ids, tuple(args.stop), emit)
            per_token[name].append(statistics.median(times))
            tail[name].append(statistics.median(times[-100:]))
    print(f"{len(ids)}-token completion, default model's tokenizer, {args.repeats} repeats, "
          f"stop {args.stop or 'none'}")
    for name in rules:
        print(f"  {name:20s} median {statistics.median(per_token[name]) * 1e6:8.1f} us/token, "
              f"last 100 tokens {statistics.median(tail[name]) * 1e6:8.1f} us/token")
    before, now = (statistics.median(per_token[name]) for name in rules)
    print(f"  ratio before/now {before / now:.1f}x; same events: "
          f"{len(set(map(tuple, events.values()))) == 1}")


if __name__ == "__main__":
    main()
