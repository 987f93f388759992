"""Build and load the CPU kernels written in C (`*_native.c` beside this file).

Why C on the CPU: a decode step's non-matmul work is a few kilobytes per layer, far too
little for torch's per-call cost (10-20 us a call in caches the weights just streamed
through, 30 layers a step); one C call per step does it in place (layer_native.c's
header; the figures in kernels/README.md). Triton has no CPU backend (its interpreter is
for tests).

How: at first use the source is compiled with the machine's C compiler (`$CC`, else
`cc`) into a shared library in a cache folder (`$KVPROOF_NATIVE_CACHE`, else
`~/.cache/kvproof/native`), named by a digest of everything the binary depends on: the
source, the flags, the compiler's version and this CPU's feature flags (-march=native
code must not run on another CPU). A library is written to a temporary name and renamed
into place, so processes that build at once (pytest workers) never load half a file.
Nothing is downloaded; a build takes about a second.

When there is no compiler or the build fails, `library` returns None and `why_not` says
why (the compiler's last lines); kernels/ then takes the torch reference, which computes
the same thing, and warns once. KVPROOF_KERNELS=native makes that an error instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
CACHE_ENV = "KVPROOF_NATIVE_CACHE"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=gnu11", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120

_libraries: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}


def library(name: str) -> ctypes.CDLL | None:
    """The loaded `<name>_native.c`, built on first use; None if it cannot be built."""
    if name not in _libraries:
        _libraries[name] = _load(name)
    return _libraries[name]


def why_not(name: str) -> str | None:
    """Why `library(name)` is None (None when it loaded)."""
    library(name)
    return _reasons.get(name)


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvproof" / "native"


def _load(name: str) -> ctypes.CDLL | None:
    source = SOURCE_DIR / f"{name}_native.c"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _reasons[name] = f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH"
        return None
    try:
        built = _build(source, compiler)
        return ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        _reasons[name] = f"{source.name} did not build: {error}"
        return None


def _build(source: Path, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S).stdout
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                 version.encode(), _cpu_features().encode(), sys.platform.encode()):
        digest.update(part)
        digest.update(b"\0")
    target = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so.partial", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run([compiler, *FLAGS, "-o", partial, str(source), "-lm"],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            last_lines = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"{Path(compiler).name} exited {result.returncode}: "
                               f"{last_lines}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), or '' off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
