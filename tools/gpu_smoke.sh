#!/usr/bin/env bash
# GPU smoke test of the SGLang production path (launch, generate, one weight update, version echo),
# then a dry-run of the shipped GPU configs. Run on a machine with CUDA and sglang 0.5.x:
#   bash tools/gpu_smoke.sh
# Environment:
#   DORA_VENV            venv with dora (default .venv)
#   DORA_SGLANG_PYTHON   interpreter that has sglang, if not the venv's (SGLang pins its own torch)
#   DORA_GPU_MODEL       small HF model dir to serve (default: the tiny MoE preset, created on the fly)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DORA_VENV:-.venv}"
PY="$VENV/bin/python"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
PY
SGL="${DORA_SGLANG_PYTHON:-$PY}"
if ! "$SGL" -c "import sglang, sys; print('sglang', sglang.__version__)"; then
  echo "[gpu_smoke] sglang is not importable from $SGL: set DORA_SGLANG_PYTHON" >&2
  exit 2
fi
"$PY" -m dora_megatron train --config configs/gpu_ci_small.yaml --dry-run > /dev/null
"$PY" -m dora_megatron train --config configs/gpu_ci_small.yaml --dry-run --set launch.backend=slurm \
  --set cluster.share_node=true --slurm-env SLURM_JOB_NODELIST=localhost --slurm-env SLURM_GPUS_ON_NODE=3 | tail -1
"$PY" -m pytest tests/gpu -m gpu -v -rs "$@"
