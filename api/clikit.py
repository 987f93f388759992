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
import time
from pathlib import Path

from spec.check.pool import cpus_available

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2
# The shell crashed: an exception inside a simulator run or a fuzz target (sim/crash.py). A
# finding, reported like a violation, but not a verdict on the protocol.
EXIT_CRASH = 3
# What a shell reports for a process ended by SIGPIPE (`kvproof check | head`): the reader
# went away, which is neither a verdict nor bad input.
EXIT_BROKEN_PIPE = 128 + 13
# Ctrl-C (SIGINT), as a shell reports it: the run stopped before its verdict.
EXIT_INTERRUPTED = 128 + 2

EXIT_CODES = """exit status:
  0  every property holds (nothing violated, nothing leaked)
  1  a property is violated (the output names it and how to reproduce it)
  2  bad input (an unknown name, an unreadable or malformed file, a bad option value)"""
# `kvproof fuzz --zoo`: an entry the fuzzer must catch went uncaught within its budget. A
# finding about the fuzzer's reach (nothing was violated), so neither 0 nor 1.
EXIT_MISSED = 4
MISSED_EXIT_LINE = """
  4  (--zoo) a zoo entry was MISSED: a bug the fuzzer must catch went uncaught within the
     budget (nothing was violated; a larger --examples or --seconds, or another --seed)"""
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


def help_epilog(examples: list[str], extra: str = "", crash: bool = False,
                exit_codes: str = EXIT_CODES, more_codes: str = "") -> str:
    """The end of a subcommand's --help: examples, then the exit codes (with `crash`, also
    the one for a crashed shell: the subcommands that run one, sim and fuzz; then
    `more_codes`, a subcommand's own). A subcommand that gives no verdict on the protocol
    (generate, serve) passes its own `exit_codes`."""
    lines = ["examples:"] + [f"  {example}" for example in examples]
    return ("\n".join(lines) + "\n\n" + (extra + "\n\n" if extra else "") + exit_codes
            + (CRASH_EXIT_LINE if crash else "") + more_codes)


def add_subcommand(commands, name: str, summary: str, description: str,
                   examples: list[str], extra: str = "", crash: bool = False,
                   exit_codes: str = EXIT_CODES, more_codes: str = "") -> Parser:
    import textwrap

    return commands.add_parser(
        name, help=summary, description=textwrap.fill(description, 88),
        epilog=help_epilog(examples, extra, crash, exit_codes, more_codes),
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


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (the system picks a free one) to 65535."""
    value = _whole_number(text, 0, "a port from 0 to 65535")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {value}")
    return value


def nice_increment(text: str) -> int:
    """An argparse type: a nice increment, 0 to 19 (Linux's range; more is refused)."""
    value = _whole_number(text, 0, "from 0 to 19")
    if value > 19:
        raise argparse.ArgumentTypeError(f"must be from 0 to 19, got {value}")
    return value


def _finite_number(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(
            f"must be {'above 0' if positive else '0 or more'}, got {value:g}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a target or a rate of 0 means nothing)."""
    return _finite_number(text, positive=True)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a duration; 0 is "at once")."""
    return _finite_number(text, positive=False)


# -- words and numbers -------------------------------------------------------------------

def plural(count: int, word: str, words: str | None = None) -> str:
    """`1 request`, `2 requests`, `1,500 requests`."""
    return f"{count:,} {word if count == 1 else (words or word + 's')}"


# -- files -------------------------------------------------------------------------------

SIM_LOG, FUZZ_FAILURE, ITF_TRACE, CFG_FILE, TOML_FILE, ENGINE_LOG, PART_LOG = (
    "a simulator log", "a saved fuzz failure", "an ITF trace", "a TLC model (.cfg)",
    "a scenario (TOML)", "an engine event log", "a part's event log")
WHAT_TO_DO = {
    SIM_LOG: "replay it with kvproof sim --replay {path}",
    FUZZ_FAILURE: "replay it with kvproof fuzz --replay {path}",
    ITF_TRACE: "check it with kvproof validate {path}",
    CFG_FILE: "check it with kvproof check --model {path}",
    TOML_FILE: "run it with kvproof sim {path}",
    ENGINE_LOG: "check it against the spec with kvproof validate {path}",
    PART_LOG: "check it with the other logs of its deployment: kvproof validate {path} ...",
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
    if first_line.startswith("{") and '"format"' in first_line \
            and "kvproof-engine-log" in first_line:
        return ENGINE_LOG
    if first_line.startswith("{") and '"format"' in first_line \
            and "kvproof-part-log" in first_line:
        return PART_LOG
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


def readable_file(path: str | Path, label: str) -> None:
    """Refuse, saying what it really is, a path a subcommand would read that is no file with
    content: a folder (whatever its name ends with), nothing at all, a device or pipe, an
    empty file. `label` starts the message (`--replay run.ndjson`, or the path itself)."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{label}: is a folder, not a file")
    if not target.exists():
        raise UsageError(f"{label}: no such file")
    if not target.is_file():
        raise UsageError(f"{label}: is not a regular file (a device, pipe or socket)")
    try:
        empty = target.stat().st_size == 0
    except OSError as error:
        raise UsageError(f"{label}: cannot read it ({_reason(error)})") from None
    if empty:
        raise UsageError(f"{label}: is empty (0 bytes)")


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


class interrupts_kept:
    """While in this block, a Ctrl-C is never lost, and `seen` says whether one came.

    Python reports an exception raised inside a garbage-collector callback or a __del__ as
    "Exception ignored" and carries on; a KeyboardInterrupt that lands there (Hypothesis
    times the collector with a callback, so a fuzz run is often inside one) is lost, and the
    run goes on for its whole budget. The hook sees the lost interrupt and raises it again
    in the main thread, a moment later, outside the callback. A library can also turn the
    interrupt into another error on its way out (Hypothesis asserts on its own state when
    one lands while it sets a test up): `seen` lets the caller still call it an interrupt."""

    seen = False
    active = False
    REARM_S, REARM_TIMES = 3.0, 10

    def __enter__(self):
        import signal
        import threading

        self.previous = sys.unraisablehook
        sys.unraisablehook = self._hook
        self.handler = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.handler = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        self.active = False
        sys.unraisablehook = self.previous
        if self.handler is not None:
            signal.signal(signal.SIGINT, self.handler)

    def _interrupt(self, signum, frame) -> None:
        if not self.seen:
            self._rearm()
        self.seen = True
        raise KeyboardInterrupt

    def _rearm(self) -> None:
        """A KeyboardInterrupt can also be swallowed where no hook sees it (a library's
        broad except on its way out): a fuzz run in CI went on for its whole budget after
        Ctrl-C. While the run has not unwound, interrupt it again, every REARM_S, at most
        REARM_TIMES times; an interrupt that did its work is never repeated (the unwind
        left the `with` first: __exit__ clears `active`)."""
        import _thread
        import threading

        self.active = True

        def again() -> None:
            for _ in range(self.REARM_TIMES):
                time.sleep(self.REARM_S)
                if not self.active:
                    return
                _thread.interrupt_main()
        threading.Thread(target=again, daemon=True).start()

    def _hook(self, unraisable) -> None:
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.previous(unraisable)
            return
        import _thread
        import threading

        threading.Timer(0.01, _thread.interrupt_main).start()


def quietly_closed_stdout() -> int:
    """After a BrokenPipeError: point stdout at /dev/null so that the interpreter's final
    flush does not raise again, and report the pipe's exit status."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE
