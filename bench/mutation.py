"""Mutation score of the engine's data path: cosmic-ray over engine/ and kernels/, with the
engine fuzz target and the engine tests as the killers. A bench/flag job, not CI.

    pip install -e '.[mutation]'
    python bench/mutation.py                     # 30 mutants drawn over engine/ and kernels/
    python bench/mutation.py --files engine/workers.py --mutants 0 --seconds 3600

Theory of operation. The tracked and untracked (not ignored) files of this checkout are
copied to a scratch directory, so that cosmic-ray's in-place mutations never touch the
checkout. `cosmic-ray init` lists every mutation of the chosen files; a seeded sample of
`--mutants` of them is kept (the rest are marked skipped: the machine this runs on is
small, and a mutant costs a torch import, the tests and a fuzz campaign), and `cosmic-ray
exec` runs each kept mutant against the killers: the engine tests named by `--tests` (a
failing test kills), then `kvproof fuzz --target engine` for `--fuzz-examples` examples (a
violation or a crashed target kills). `--seconds` bounds the whole run; what finished by
then is reported. The score is killed / (killed + survived); a mutant that timed out
(`--timeout-s`) counts as killed, as cosmic-ray counts it. Every survivor is printed with
its diff, to be looked at: equivalent (no behaviour changes), or a gap that wants a test.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every module of engine/ and kernels/ (the sample is drawn over all of their mutants).
DEFAULT_FILES = tuple(sorted(str(path.relative_to(ROOT)) for folder in ("engine", "kernels")
                             for path in (ROOT / folder).glob("*.py")
                             if path.name != "__init__.py" or path.stat().st_size > 200))
DEFAULT_TESTS = ("tests/test_wire_faults.py tests/test_kernels.py tests/test_kernels_triton_*.py "
                 "tests/test_engine_workers.py tests/test_fuzz_engine_oracles.py")
PROGRESS_S = 15.0  # how often a running job prints how many mutants are done


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                        help="files under engine/ or kernels/ to mutate")
    parser.add_argument("--mutants", type=int, default=30,
                        help="a seeded sample of this many mutants (0: all of them)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--seconds", type=float, default=1800.0,
                        help="bound on the whole run; what finished is reported")
    parser.add_argument("--timeout-s", type=float, default=240.0,
                        help="per mutant: tests and fuzzing together")
    parser.add_argument("--tests", default=DEFAULT_TESTS,
                        help="the pytest files (or node ids) that are killers")
    parser.add_argument("--fuzz-examples", type=int, default=20,
                        help="examples of the engine fuzz target per mutant (0: none)")
    parser.add_argument("--fuzz-seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in args.files:
        path = ROOT / name
        if not path.is_file() or path.suffix != ".py" or path.parts[-2] not in ("engine", "kernels"):
            parser.error(f"--files: {name} is not a Python file of engine/ or kernels/")
    if args.mutants < 0 or args.seconds <= 0 or args.timeout_s <= 0 or args.fuzz_examples < 0:
        parser.error("--mutants and --fuzz-examples must be >= 0, the times > 0")
    return args


def killers(args: argparse.Namespace) -> str:
    command = (f"{sys.executable} -m pytest -x -q -p no:randomly -p no:cacheprovider -n 0 "
               f"-m 'not slow' {args.tests}")
    if args.fuzz_examples:
        command += (f" && {sys.executable} -m api.cli fuzz --target engine --quiet "
                    f"--examples {args.fuzz_examples} --seed {args.fuzz_seed} "
                    "--shrink-seconds 0")
    return command


def scratch_copy(into: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


KILLERS_SCRIPT = "mutation-killers.sh"


def write_config(into: Path, args: argparse.Namespace) -> Path:
    """The session's config; cosmic-ray runs its test command without a shell (split into
    words), so the killers, a pipeline, are a script of their own."""
    (into / KILLERS_SCRIPT).write_text(f"set -e\n{killers(args)}\n")
    config = into / "cosmic-ray.toml"
    modules = ", ".join(f'"{name}"' for name in args.files)
    config.write_text("[cosmic-ray]\n"
                      f"module-path = [{modules}]\n"
                      f"timeout = {args.timeout_s}\n"
                      "excluded-modules = []\n"
                      f'test-command = "bash {KILLERS_SCRIPT}"\n\n'
                      "[cosmic-ray.distributor]\n"
                      'name = "local"\n')
    return config


def baseline(into: Path, timeout_s: float) -> str:
    """The killers on the unmutated code: "" when they pass, else why not (a score over
    killers that fail anyway would count every mutant killed)."""
    try:
        done = subprocess.run(["bash", KILLERS_SCRIPT], cwd=into, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the killers took more than --timeout-s {timeout_s:.0f} s unmutated"
    if done.returncode:
        return f"the killers fail unmutated (exit {done.returncode}):\n{done.stdout[-2000:]}"
    return ""


def sample(session: Path, count: int, seed: int) -> tuple[int, int]:
    """Keep `count` of the session's mutants (seeded), mark the others skipped."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session)) as db:
        ids = sorted(item.job_id for item in db.pending_work_items)
        kept = set(ids) if not count else set(random.Random(seed).sample(ids, min(count, len(ids))))
        skipped = [i for i in ids if i not in kept]
        if skipped:
            db.set_multiple_results(skipped, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return len(ids), len(kept)


def execute(cwd: Path, config: Path, session: Path, seconds: float) -> bool:
    """cosmic-ray exec, bounded; True when it finished every kept mutant."""
    process = subprocess.Popen(["cosmic-ray", "exec", str(config), str(session)], cwd=cwd,
                               start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    import time

    deadline, shown = time.monotonic() + seconds, -1
    while process.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
            return False
        try:
            process.wait(timeout=PROGRESS_S)
        except subprocess.TimeoutExpired:
            pass
        done, killed = progress(session)
        if done != shown:
            print(f"  {done} mutants done, {killed} killed", flush=True)
            shown = done
    return True


def progress(session: Path) -> tuple[int, int]:
    """Mutants run so far (the skipped ones not counted) and how many of them were killed."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome

    done = killed = 0
    try:
        with use_db(str(session)) as db:
            for _, result in db.completed_work_items:
                if result.worker_outcome != WorkerOutcome.SKIPPED:
                    done += 1
                    killed += bool(result.is_killed)
    except Exception:  # noqa: BLE001 - the database is being written: ask again later
        return -1, 0
    return done, killed


def report(session: Path) -> tuple[int, int, list]:
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome

    killed, survivors = 0, []
    with use_db(str(session)) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            for mutation in item.mutations:
                print(f"{'killed' if result.is_killed else 'SURVIVED':>8}  "
                      f"{mutation.module_path}:{mutation.start_pos[0]}  "
                      f"{mutation.operator_name} #{mutation.occurrence}")
            if result.is_killed:
                killed += 1
            else:
                survivors.append((item, result))
    return killed, len(survivors), survivors


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if shutil.which("cosmic-ray") is None:
        print("bench/mutation.py: cosmic-ray is not installed (pip install -e '.[mutation]')",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvproof-mutation-") as scratch:
        work = Path(scratch)
        scratch_copy(work)
        config, session = write_config(work, args), work / "session.sqlite"
        failed = baseline(work, args.timeout_s)
        if failed:
            print(f"bench/mutation.py: {failed}", file=sys.stderr)
            return 2
        subprocess.run(["cosmic-ray", "init", str(config), str(session)], cwd=work, check=True,
                       stdout=subprocess.DEVNULL)
        total, kept = sample(session, args.mutants, args.seed)
        print(f"mutation: {', '.join(args.files)}: {total} mutants, {kept} run (seed "
              f"{args.seed}); killers: {killers(args)}", flush=True)
        finished = execute(work, config, session, args.seconds)
        killed, survived, survivors = report(session)
    done = killed + survived
    print(f"{done} of {kept} mutants run{'' if finished else f' (stopped at {args.seconds:.0f} s)'}"
          f": {killed} killed, {survived} survived; score "
          f"{killed / done:.0%}" if done else "no mutant finished")
    for item, result in survivors:
        for mutation in item.mutations:
            print(f"\nSURVIVED {mutation.module_path}:{mutation.start_pos[0]} "
                  f"{mutation.operator_name} #{mutation.occurrence}")
        print((result.diff or "").strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
