"""Running TLC, the TLA+ model checker, on the same .cfg files, when it is installed.

TLC is a Java program (tla2tools.jar) that no package registry reachable here ships. It runs
when `java` is on PATH and TLA2TOOLS_JAR names the jar; otherwise `find_tlc` says exactly
which of the two is missing. The model is written to a temporary .cfg (for a shipped model
the same constants, invariants and properties as its file in spec/models/, so TLC checks
exactly what the Python checker checks, `--bug` switches included).

Before Java starts, spec/tlaplus/sany.py checks the spec for what SANY (TLC's front end)
would refuse, and names the line; TLC itself exits 150 when SANY refuses the spec, which is
reported as bad input, not as a property violation. Liveness is checked once, after the
safety search (`-lncheck final`): TLC's default re-checks the growing graph periodically,
which is most of the time a FairSpec run takes on these models.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from spec.check.cfgfile import cfg_for
from spec.model import Model

SPEC = Path(__file__).resolve().parent.parent / "KVTransfer.tla"
# TLC's exit statuses for a spec SANY refuses (150) and a .cfg it cannot use (151).
SPEC_OR_CONFIG_REFUSED = (150, 151)


@dataclass
class TlcResult:
    ok: bool
    distinct_states: int | None
    states_generated: int | None
    depth: int | None
    seconds: float
    violation: str | None  # "Invariant X", "Action property X" (a step property), "Deadlock",
    #                        "Temporal properties", or TLC's error
    output: str
    returncode: int | None = None
    command: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        """SANY refused the spec or TLC the .cfg: nothing was checked (bad input)."""
        return self.returncode in SPEC_OR_CONFIG_REFUSED or "Semantic errors:" in self.output \
            or "*** Parse Error ***" in self.output


def find_tlc() -> tuple[str, str] | str:
    """(java, jar), or a sentence saying what is missing."""
    java = shutil.which("java")
    jar = os.environ.get("TLA2TOOLS_JAR", "")
    missing = []
    if not java:
        missing.append("`java` is not on PATH")
    if not jar:
        missing.append("TLA2TOOLS_JAR is not set (it must name tla2tools.jar)")
    elif not Path(jar).is_file():
        missing.append(f"TLA2TOOLS_JAR={jar} is not a file")
    if missing:
        return "TLC is not available: " + "; ".join(missing)
    return java, jar


def parse_tlc_output(text: str, seconds: float, returncode: int | None = None) -> TlcResult:
    def number(pattern: str) -> int | None:
        found = re.findall(pattern, text)
        return int(found[-1].replace(",", "")) if found else None

    generated = number(r"([\d,]+) states generated")
    distinct = number(r"([\d,]+) distinct states found")
    depth = number(r"depth of the complete state graph search is (\d+)")
    violation = None
    invariant = re.search(r"Error: (Invariant|Action property) (\w+) is violated", text)
    if invariant:
        violation = f"{invariant.group(1)} {invariant.group(2)}"
    elif "Error: Deadlock reached" in text:
        violation = "Deadlock"
    elif "Error: Temporal properties were violated" in text:
        violation = "Temporal properties"
    elif "Semantic errors:" in text:
        violation = "SANY refused the spec: " + _first_semantic_error(text)
    elif re.search(r"^Error:", text, re.M):
        violation = re.search(r"^Error:.*$", text, re.M).group(0)
    ok = violation is None and "Model checking completed. No error has been found." in text \
        and returncode in (None, 0)
    return TlcResult(ok, distinct, generated, depth, seconds, violation, text, returncode)


def _first_semantic_error(text: str) -> str:
    after = text.split("Semantic errors:", 1)[1]
    lines = [line.strip() for line in after.splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith("***")), "see TLC's output")


def tlc_command(java: str, jar: str, cfg: Path, metadir: Path, workers: int,
                liveness: bool) -> list[str]:
    """The command kvproof runs; spec/README.md gives its short form."""
    options = ["-workers", str(workers), "-metadir", str(metadir), "-config", str(cfg)]
    if liveness:
        options += ["-lncheck", "final"]
    return [java, "-XX:+UseParallelGC", "-cp", jar, "tlc2.TLC", *options, str(SPEC)]


def static_errors() -> list[str]:
    """What SANY would refuse in the spec, as `line N: message` (empty: nothing)."""
    from spec.tlaplus.sany import check_file

    return [str(e) for e in check_file(SPEC)]


def run_tlc(model: Model, invariants: tuple[str, ...], properties: tuple[str, ...],
            workers: int = 1, timeout_s: float = 3600) -> TlcResult:
    found = find_tlc()
    if isinstance(found, str):
        raise RuntimeError(found)
    java, jar = found
    with tempfile.TemporaryDirectory(prefix="kvproof-tlc-") as tmp:
        cfg = Path(tmp) / "model.cfg"
        cfg.write_text(cfg_for(model, invariants, properties))
        command = tlc_command(java, jar, cfg, Path(tmp) / "states", workers, bool(properties))
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                             cwd=SPEC.parent)
        seconds = time.perf_counter() - start
    result = parse_tlc_output(out.stdout + out.stderr, seconds, out.returncode)
    result.command = tuple(command)
    return result
