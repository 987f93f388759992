"""A shell that crashes is a finding: what an exception inside a run is reported as.

An exception raised while the simulator (or a fuzz target driving it) carries out the
core's decisions is a bug of the shell, not of the protocol and not of the user's input. It
used to surface as a raw traceback with exit status 1, which reads as "the protocol is
broken". It is now reported like a violation but apart from one: the run stops, and what it
reports names the exception's type and message and the innermost frame it was raised in
(file, line, function: where to look first), next to the seed and the command that
reproduces it; the events up to the crash are in the run's log (or the fuzzer's saved
failure). The CLI exits with its own status (api/clikit.py EXIT_CRASH).
"""

from __future__ import annotations

import os
import traceback

from spec.properties import Violation

SHELL_CRASH = "ShellCrash"  # the name a crash is reported under, beside the properties


def describe(error: BaseException) -> dict:
    """The exception as JSON-able facts: type, message, and the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    where = frames[-1] if frames else None
    return {
        "type": type(error).__name__,
        "message": str(error),
        "frame": (f"{_short(where.filename)}:{where.lineno} in {where.name}"
                  if where else "unknown"),
        "line": (where.line or "") if where else "",
    }


def as_violation(error: BaseException) -> Violation:
    """The crash as the one violation type, kind "crash", for reports that list them."""
    return Violation(SHELL_CRASH, one_line(describe(error)), kind="crash")


def one_line(crash: dict) -> str:
    message = f": {crash['message']}" if crash["message"] else ""
    return f"{crash['type']}{message} (innermost frame {crash['frame']})"


def _short(path: str) -> str:
    """A path inside the project relative to its root; any other path as it is."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        relative = os.path.relpath(path, root)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative
