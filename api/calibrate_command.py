"""`kvproof sim calibrate`: measure the engine here and write a compute model for the simulator.

    kvproof sim calibrate [--model PATH] [--device D] [--dtype T] [--threads N] --out FILE
                          [--prompt-tokens 16,64,...] [--chunk-tokens 256,512]
                          [--batch-sizes 1,2,4,...] [--context-tokens 32,128,...]
                          [--page-tokens N] [--repeats N] [--seconds-max S] [--quiet]

The measurements are engine/calibrate.py's; the file's layout and how the simulator reads
it (interpolation inside the grid, the extrapolation rule outside) are sim/compute.py's.
A scenario names the file as `[compute] model = "FILE"`. The grid flags bound the time;
--seconds-max bounds it again (checked before every cell). Nothing is written unless every
cell was measured.
"""

from __future__ import annotations

import argparse
import sys

from api import engine_options
from api.clikit import (EXIT_OK, EXIT_USAGE, UsageError, help_epilog, positive_float,
                        positive_int, writable_file)

EXAMPLES = [
    "kvproof sim calibrate --out compute.toml",
    "kvproof sim calibrate --model tiny/ --prompt-tokens 16,64 --batch-sizes 1,4 "
    "--context-tokens 16,64 --chunk-tokens 64 --repeats 1 --out tiny.toml",
    "kvproof sim default --set compute.model=compute.toml --set compute.transport=in-process",
]
EXIT_CODES = """exit status:
  0  every cell of the grid was measured and the file written
  2  bad input (an option's value, a model that cannot be used, a grid too large or too slow
     for its bounds): one line, nothing written"""
NAME = "sim-calibrate"  # reached as `kvproof sim calibrate` (api/cli.py)
PROG = "kvproof sim calibrate"


def _grid_points(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got "
                                         f"{text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return values


def add_parser(commands) -> None:
    from engine.calibrate import Grid

    default = Grid()
    import textwrap

    # Not listed among the subcommands (no help=): it is `kvproof sim calibrate`.
    parser = commands.add_parser(
        NAME, prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=help_epilog(EXAMPLES, exit_codes=EXIT_CODES), description=textwrap.fill(
        "Measure the engine on this machine (prefill time by prompt length and chunk size, "
        "decode step time by batch size and context, page-write time per transport) and "
        "write a compute model that a scenario names with [compute] model = \"FILE\": the "
        "simulator then reads its times from the measured tables (sim/README.md).", 88))
    engine_options.add_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the compute model file to write (TOML)")

    def points(flag: str, values: tuple, what: str) -> None:
        parser.add_argument(flag, type=_grid_points, default=values, metavar="N,N,...",
                            help=f"{what} (default {','.join(map(str, values))})")
    points("--prompt-tokens", default.prompt_tokens, "prefill: prompt lengths")
    points("--chunk-tokens", default.chunk_tokens, "prefill: chunk sizes")
    points("--batch-sizes", default.batch_sizes, "decode: batch sizes")
    points("--context-tokens", default.context_tokens, "decode: context per sequence")
    parser.add_argument("--page-tokens", type=positive_int, default=default.page_tokens,
                        metavar="N", help=f"KV page size (default {default.page_tokens}, "
                        "the engine's)")
    parser.add_argument("--repeats", type=positive_int, default=default.repeats, metavar="N",
                        help=f"runs per cell after a warm-up; the median is kept (default "
                             f"{default.repeats})")
    parser.add_argument("--seconds-max", type=positive_float, default=default.seconds_max,
                        metavar="S", help=f"stop with an error once the measurements take "
                        f"longer (default {default.seconds_max:g})")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.calibrate import CalibrationError
    from engine.config import ModelFileError
    from sim.compute import ComputeFileError

    try:
        return _calibrate(args)
    except (UsageError, ModelFileError, CalibrationError, ComputeFileError) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_USAGE


def _calibrate(args: argparse.Namespace) -> int:
    writable_file(args.out, "--out")
    for flag in ("prompt_tokens", "chunk_tokens", "batch_sizes", "context_tokens"):
        if flag != "chunk_tokens" and len(set(getattr(args, flag))) < 2:
            raise UsageError(f"--{flag.replace('_', '-')}: give at least two grid points "
                             "(the table interpolates between them)")
    threads = engine_options.prepare(args)
    from engine.calibrate import Grid, calibrate
    from engine.load import load_model
    from pydantic import ValidationError

    from sim.compute import CalibratedTables, explain, read_compute_file, write_compute_file

    grid = Grid(args.prompt_tokens, args.chunk_tokens, args.batch_sizes, args.context_tokens,
                args.page_tokens, args.repeats, args.seconds_max)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    name = loaded.path.name
    print(f"{PROG}: {name} on {args.device} ({args.dtype}, {threads} torch thread"
          f"{'s' if threads > 1 else ''}), {grid.cells} cells x {grid.repeats} repeats, at "
          f"most {grid.seconds_max:g} s", flush=True)
    progress = None if args.quiet else (lambda line: print(line, flush=True))
    data = calibrate(loaded.model, grid, name, progress)
    try:
        tables = CalibratedTables.model_validate(data)
    except ValidationError as error:  # a measurement the file cannot hold: our bug
        raise AssertionError(f"calibration produced an invalid table: {explain(error)}")
    write_compute_file(args.out, tables)
    read_compute_file(args.out)  # what a scenario will read, read back once
    print(f"wrote {args.out}: name it in a scenario as [compute] model = \"{args.out}\" "
          f"(and transport = \"in-process\" for its page writes)")
    return EXIT_OK
