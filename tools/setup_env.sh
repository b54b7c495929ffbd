#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the CPU install path.
# torch==2.13.0 goes in first so nothing later can pull the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DORA_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
echo "[setup] installing dora_megatron with test extras"
"$VENV/bin/python" -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# SGLang 0.5.23's wheel, unpacked beside the venv (not importable as `sglang`: its request types are
# loaded by tests/sglang_wheel.py to validate what the client sends; SGLang itself needs a GPU)
SGL_DIR="$VENV/sglang-wheel"
if [ ! -f "$SGL_DIR/sglang/_version.py" ] || ! grep -q "'0.5.23'" "$SGL_DIR/sglang/_version.py"; then
  echo "[setup] unpacking sglang==0.5.23 (no dependencies) into $SGL_DIR"
  rm -rf "$SGL_DIR"
  "$VENV/bin/python" -m pip install -q --no-deps --no-compile --target "$SGL_DIR" "sglang==0.5.23"
fi
"$VENV/bin/python" -c "import dora_megatron, torch, megatron.core; print('[setup] ok: torch', torch.__version__)"
