"""What the CLI tests share: the kvproof command run in-process."""

from __future__ import annotations

from api.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `kvproof ARGV`; argparse's exits included."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err
