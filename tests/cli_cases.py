"""What the CLI tests share: the kvproof command run in-process, and the preparation of
one run as a process that a test interrupts with Ctrl-C."""

from __future__ import annotations

import signal

from api.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `kvproof ARGV`; argparse's exits included."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def ctrl_c_reaches_it() -> None:
    """A `preexec_fn`: in the child, before exec, SIGINT neither ignored nor blocked. Both
    are inherited, and a command started by a process that ignores or blocks it (a shell's
    background job, a test worker some earlier test left so) would not see the Ctrl-C a
    test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
