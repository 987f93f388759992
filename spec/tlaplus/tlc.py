"""Running TLC, the TLA+ model checker, on the same .cfg files, when it is installed.

TLC is a Java program (tla2tools.jar) that no package registry reachable here ships. It runs
when `java` is on PATH and TLA2TOOLS_JAR names the jar; otherwise `find_tlc` says exactly
which of the two is missing. A model with extra switches (`--bug`) is written to a temporary
.cfg, so TLC checks exactly what the Python checker checks.
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


@dataclass
class TlcResult:
    ok: bool
    distinct_states: int | None
    states_generated: int | None
    depth: int | None
    seconds: float
    violation: str | None  # "Invariant X", "Deadlock", "Temporal properties", or TLC's error
    output: str


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


def parse_tlc_output(text: str, seconds: float) -> TlcResult:
    def number(pattern: str) -> int | None:
        found = re.findall(pattern, text)
        return int(found[-1].replace(",", "")) if found else None

    generated = number(r"([\d,]+) states generated")
    distinct = number(r"([\d,]+) distinct states found")
    depth = number(r"depth of the complete state graph search is (\d+)")
    violation = None
    invariant = re.search(r"Error: Invariant (\w+) is violated", text)
    if invariant:
        violation = f"Invariant {invariant.group(1)}"
    elif "Error: Deadlock reached" in text:
        violation = "Deadlock"
    elif "Error: Temporal properties were violated" in text:
        violation = "Temporal properties"
    elif re.search(r"^Error:", text, re.M):
        violation = re.search(r"^Error:.*$", text, re.M).group(0)
    ok = violation is None and "Model checking completed. No error has been found." in text
    return TlcResult(ok, distinct, generated, depth, seconds, violation, text)


def run_tlc(model: Model, invariants: tuple[str, ...], properties: tuple[str, ...],
            workers: int = 1, timeout_s: float = 3600) -> TlcResult:
    found = find_tlc()
    if isinstance(found, str):
        raise RuntimeError(found)
    java, jar = found
    with tempfile.TemporaryDirectory(prefix="kvproof-tlc-") as tmp:
        cfg = Path(tmp) / "model.cfg"
        cfg.write_text(cfg_for(model, invariants, properties))
        command = [java, "-XX:+UseParallelGC", "-cp", jar, "tlc2.TLC", "-workers", str(workers),
                   "-metadir", str(Path(tmp) / "states"), "-config", str(cfg), str(SPEC)]
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                             cwd=SPEC.parent)
        seconds = time.perf_counter() - start
    return parse_tlc_output(out.stdout + out.stderr, seconds)
