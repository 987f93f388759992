"""What every kvproof subcommand shares: the parser, the exit codes, the file sniffer, the
wording of numbers.

One vocabulary across subcommands is the point of this module. A user who learnt `--bug`,
`--property`, `--itf FILE`, `--json FILE`, `--list-*`, `--quiet`, `--seed` and `--jobs` on
one subcommand finds them meaning the same on the others; an old spelling stays as an alias
for one release and its help says which spelling replaces it.

Bad input is reported as one line on stderr, `kvproof SUBCOMMAND: what is wrong`, with exit
status 2 — never a traceback and never the violation code 1, which a CI job reads as "the
protocol is broken".
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from spec.check.pool import cpus_available

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2
# The shell crashed: an exception inside a simulator run or a fuzz target (sim/crash.py). A
# finding, reported like a violation, but not a verdict on the protocol.
EXIT_CRASH = 3
# What a shell reports for a process ended by SIGPIPE (`kvproof check | head`): the reader
# went away, which is neither a verdict nor bad input.
EXIT_BROKEN_PIPE = 128 + 13
# What a shell reports for a process ended by SIGINT (Ctrl-C): no verdict either.
EXIT_INTERRUPTED = 128 + 2

EXIT_CODES = """exit status:
  0  every property holds (nothing violated, nothing leaked)
  1  a property is violated (the output names it and how to reproduce it)
  2  bad input (an unknown name, an unreadable or malformed file, a bad option value)"""
CRASH_EXIT_LINE = """
  3  the shell crashed: an exception inside the run (the output names its type, message and
     innermost frame, the seed, the command that reproduces it and the saved events)"""


class UsageError(ValueError):
    """The user's input is wrong: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, except that a mistake is one line naming it (with a close match when there
    is one), under the subcommand's own name rather than the top-level usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {message}; see {self.prog} --help\n")

    def unknown_options(self, extras: list[str]) -> None:
        """Report arguments the parser did not recognise, suggesting the option meant."""
        first = extras[0]
        if first.startswith("-"):
            name = first.split("=", 1)[0]
            options = [o for action in self._actions for o in action.option_strings]
            close = difflib.get_close_matches(name, options, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            self.error(f"unknown option {name}{hint}")
        self.error(f"unexpected argument {first!r}")


def help_epilog(examples: list[str], extra: str = "", crash: bool = False) -> str:
    """The end of a subcommand's --help: examples, then the exit codes (with `crash`, also
    the one for a crashed shell: the subcommands that run one, sim and fuzz)."""
    lines = ["examples:"] + [f"  {example}" for example in examples]
    return ("\n".join(lines) + "\n\n" + (extra + "\n\n" if extra else "") + EXIT_CODES
            + (CRASH_EXIT_LINE if crash else ""))


def add_subcommand(commands, name: str, summary: str, description: str,
                   examples: list[str], extra: str = "", crash: bool = False) -> Parser:
    import textwrap

    return commands.add_parser(
        name, help=summary, description=textwrap.fill(description, 88),
        epilog=help_epilog(examples, extra, crash),
        formatter_class=argparse.RawDescriptionHelpFormatter)


def _whole_number(text: str, low: int, bound: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a bound of 0 or below would silently mean nothing)."""
    return _whole_number(text, 1, "at least 1")


def process_count(text: str) -> int:
    """An argparse type for --workers and --jobs: from 1 to the CPUs this process may run on.
    More is refused rather than clamped, as every other out-of-range value is: the work is
    CPU-bound, so extra processes only cost memory (one per process, ~3,700 forked from
    `--workers 100000` took 22 GB)."""
    value = positive_int(text)
    cpus = cpus_available()
    if value > cpus:
        raise argparse.ArgumentTypeError(f"at most {cpus} here (the CPUs this process may "
                                         f"run on), got {value}")
    return value


def non_negative_int(text: str) -> int:
    return _whole_number(text, 0, "0 or more")


# -- words and numbers -------------------------------------------------------------------

def plural(count: int, word: str, words: str | None = None) -> str:
    """`1 request`, `2 requests`, `1,500 requests`."""
    return f"{count:,} {word if count == 1 else (words or word + 's')}"


# -- files -------------------------------------------------------------------------------

SIM_LOG, FUZZ_FAILURE, ITF_TRACE, CFG_FILE, TOML_FILE = (
    "a simulator log", "a saved fuzz failure", "an ITF trace", "a TLC model (.cfg)",
    "a scenario (TOML)")
WHAT_TO_DO = {
    SIM_LOG: "replay it with kvproof sim --replay {path}",
    FUZZ_FAILURE: "replay it with kvproof fuzz --replay {path}",
    ITF_TRACE: "check it with kvproof validate {path}",
    CFG_FILE: "check it with kvproof check --model {path}",
    TOML_FILE: "run it with kvproof sim {path}",
}


def sniff(path: str | Path) -> str | None:
    """Which of kvproof's file kinds this is, from its first bytes; None when none fits.
    Reading a whole trace to say "wrong kind" would be slow, so only the start is read,
    except for ITF files, whose kind is in their "#meta"."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    text = head.decode("utf-8", errors="replace").lstrip()
    first_line = text.split("\n", 1)[0]
    if first_line.startswith("{") and '"format"' in first_line and "kvproof-sim" in first_line:
        return SIM_LOG
    if text.startswith("{"):
        return _sniff_json(path)
    if path.suffix == ".cfg" or text.startswith(("CONSTANT", "\\*", "SPECIFICATION")):
        return CFG_FILE
    if path.suffix == ".toml":
        return TOML_FILE
    return None


def _sniff_json(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or "states" not in data:
        return None
    meta = data.get("#meta")
    if isinstance(meta, dict) and isinstance(meta.get("fuzz"), dict):
        return FUZZ_FAILURE
    return ITF_TRACE


def wrong_kind(path: str, kind: str | None, wanted: str) -> UsageError:
    """The error for a file of another kind than the subcommand reads, saying what to do."""
    if kind is None:
        return UsageError(f"{path} is not {wanted}")
    return UsageError(f"{path} is {kind}, not {wanted}: "
                      + WHAT_TO_DO[kind].format(path=path))


def writable_file(path: str, flag: str) -> None:
    """Fail before a run, not after it, when its output cannot be written. The file is
    opened for real (permission bits say little to root, or on a read-only mount) and left
    as it was found."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    existed = target.exists()
    try:
        with open(target, "a" if existed else "x"):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write there ({_reason(error)})") from None
    if not existed:
        target.unlink()


def writable_folder(path: str, flag: str) -> None:
    """Create the folder (it will be written into anyway) and prove a file can go in it."""
    import tempfile

    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{flag} {path}: is a file; give a folder")
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write there ({_reason(error)})") from None


def _reason(error: OSError) -> str:
    return (error.strerror or str(error)).lower()


def quietly_closed_stdout() -> int:
    """After a BrokenPipeError: point stdout at /dev/null so that the interpreter's final
    flush does not raise again, and report the pipe's exit status."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE
