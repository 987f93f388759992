"""The import rules that keep the architecture what DESIGN.md draws: arrows point down into
spec/'s protocol modules, engine -> kernels, api -> engine, and nothing points back up.

Read from the source with `ast`, so a rule breaks the moment someone writes the import, not
when a test happens to exercise it.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = frozenset(sys.stdlib_module_names)

# The protocol: the pure core and what every shell shares with it. Standard library only.
PROTOCOL = ("spec.core", "spec.commands", "spec.model", "spec.properties", "spec.store",
            "spec.codec", "spec.runtime", "spec.interfaces", "spec.roles", "spec.parts",
            "spec.partlog")
# The TLA+ evaluator: the parser and the standard library only.
EVALUATOR = ("spec.tlaplus.tlaeval", "spec.tlaplus.tlacompile", "spec.tlaplus.tlaexpr",
             "spec.tlaplus.tlaaction", "spec.tlaplus.tlavalues")
SHELLS = ("sim", "fuzz", "engine", "api")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, absolute, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


def is_module(name: str) -> bool:
    """True for a name that is a module of this project (not `spec.core.Event`)."""
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _violations(files: list[Path], allowed) -> list[str]:
    bad = []
    for path in files:
        for name in imports_of(path):
            if not allowed(name):
                bad.append(f"{module_name(path)} imports {name}")
    return bad


def test_the_protocol_modules_import_only_the_standard_library_and_each_other():
    files = [ROOT / (name.replace(".", "/") + ".py") for name in PROTOCOL]

    def allowed(name: str) -> bool:
        return top(name) in STDLIB or name in PROTOCOL or name == "spec" or (
            not is_module(name) and name.rsplit(".", 1)[0] in PROTOCOL + ("spec",))
    assert _violations(files, allowed) == []


def test_the_tla_evaluator_imports_only_the_parser():
    files = [ROOT / (name.replace(".", "/") + ".py") for name in EVALUATOR]

    def allowed(name: str) -> bool:
        return (top(name) in STDLIB or top(name) == "tla" or name in EVALUATOR
                or name.rsplit(".", 1)[0] in EVALUATOR or name == "spec.tlaplus")
    assert _violations(files, allowed) == []


def test_spec_never_imports_a_shell_or_the_kernels():
    def allowed(name: str) -> bool:
        return top(name) not in SHELLS + ("kernels",)
    assert _violations(sources("spec"), allowed) == []


@pytest.mark.parametrize("package, forbidden", [
    ("kernels", ("spec", "sim", "fuzz", "engine", "api")),   # kernels never import the protocol
    ("engine", ("sim", "fuzz", "api")),                        # engine -> spec, kernels
    ("sim", ("fuzz", "engine", "api", "kernels")),
    ("fuzz", ("api",)),
])
def test_arrows_point_down(package, forbidden):
    def allowed(name: str) -> bool:
        return top(name) not in forbidden
    assert _violations(sources(package), allowed) == []


def test_no_module_outside_the_protocol_package_keeps_protocol_bookkeeping():
    """The store (views, in-place commit, crash views, allocator, flatten, local oracles)
    lives in spec/store.py; a shell that defines its own is what the rule forbids."""
    markers = ("def flatten(", "def decide_crash(", "def _check_conservation(")
    offenders = [module_name(path) for package in SHELLS for path in sources(package)
                 if any(marker in path.read_text() for marker in markers)]
    assert offenders == []


def test_the_engine_changes_protocol_state_only_through_the_store():
    """engine/ takes every event with Store.take: no module of it calls the core's apply,
    commit or an action function itself, or writes a store's rows or pools. (eventlog.py
    is the exception by design: it folds a finished log into a fresh state for replay and
    validation, never the live engine's.)"""
    markers = ("core.apply(", "core.commit(", "core.release(", "core.finish(",
               ".rows[", ".decode_pools[", ".prefill_pools[")
    live = [path for path in sources("engine") if path.name != "eventlog.py"]
    offenders = [f"{module_name(path)}: {marker}" for path in live
                 for marker in markers if marker in path.read_text()
                 and not _only_reads(path.read_text(), marker)]
    assert offenders == []


def test_only_the_one_runtime_holds_a_handler_per_command():
    """spec/runtime.py carries out the core's commands for every shell: no module of a
    shell keys a table by a command type (the simulator and the engine each had one)."""
    import re
    names = "|".join(("Send", "Queue", "Compute", "Post", "ArmTimer", "CancelTimer",
                      "StartDecoding", "StopDecoding", "ReleaseWhenReady", "Answer",
                      "FreePages"))
    keyed = re.compile(rf"\b\w+\.({names})\s*:\s*(self|lambda)")
    offenders = [module_name(path) for package in SHELLS
                 for path in sources(package) if keyed.search(path.read_text())]
    assert offenders == []
    assert keyed.search((ROOT / "spec" / "runtime.py").read_text())  # the rule can fail


def _only_reads(text: str, marker: str) -> bool:
    """True when every use of a subscript marker is a read (never `...] =`; a comparison,
    `...] ==`, is a read)."""
    if not marker.endswith("["):
        return False
    assigned = re.compile(r"\]\s*=(?!=)")
    for line in text.splitlines():
        if marker in line and assigned.search(line.split(marker, 1)[1]):
            return False
    return True


def test_the_rules_can_fail(tmp_path):
    """A module that imports a shell from the protocol is seen (so the rules are not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nfrom sim.run import Simulation\n\ndef f():\n    import api.cli\n")
    assert imports_of(bad) >= {"json", "sim.run", "sim.run.Simulation", "api.cli"}
