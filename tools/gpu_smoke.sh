#!/usr/bin/env bash
# GPU smoke test of the Megatron trainer's production knobs (tools/gpu_trainer_smoke.py: TE spec and
# fusions, bf16/fp16, recompute, grouped GEMM, alltoall/flex dispatchers, SP/ETP/CP/VPP, optimizer CPU
# offload, overlapped gradient reduction; each against transformers, a few steps, tokens/s, memory, MFU)
# and of the SGLang production path against a real SGLang 0.5.23 server: /v1/loads,
# /model_info, abort (empty reply, a race with the dispatch), plain-text flush, the weight-update
# session rule, a pause across a disk update, and with 2+ GPUs the NCCL push choreography (pause,
# begin, buckets, end, continue; a retract push crossed by a request; a push failing halfway);
# then a dry-run of the shipped GPU configs. Run on a machine with CUDA:
#   bash tools/gpu_smoke.sh
# Environment:
#   DORA_VENV            venv with dora (default .venv)
#   DORA_SGLANG_PYTHON   interpreter that has sglang 0.5.23, if not the venv's (SGLang pins its own torch)
#   DORA_GPU_MODEL       small HF model dir to serve (default: the tiny MoE preset, created on the fly)
#   DORA_TRAINER_SMOKE_JSON  where the trainer smoke writes its results (default gpu_trainer_smoke.json)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DORA_VENV:-.venv}"
PY="$VENV/bin/python"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
PY
"$PY" tools/gpu_trainer_smoke.py --dry-run > /dev/null
# the trainer first: it needs no SGLang (a failure is reported at the end, after the SGLang checks)
trainer_rc=0
"$PY" tools/gpu_trainer_smoke.py --json "${DORA_TRAINER_SMOKE_JSON:-gpu_trainer_smoke.json}" || trainer_rc=$?
SGL="${DORA_SGLANG_PYTHON:-$PY}"
# usable, not merely importable: the server stack must import (an unpacked wheel does not count)
if ! "$SGL" -c "import sglang.srt.entrypoints.http_server, sglang; print('sglang', sglang.__version__)"; then
  echo "[gpu_smoke] no usable sglang in $SGL (sglang.srt.entrypoints.http_server does not import): set DORA_SGLANG_PYTHON" >&2
  exit 2
fi
"$SGL" -c "import sglang, sys; v = sglang.__version__; sys.exit(0) if v == '0.5.23' else print(f'[gpu_smoke] warning: sglang {v}; dora is tested with 0.5.23')"
"$PY" -m dora_megatron train --config configs/gpu_ci_small.yaml --dry-run > /dev/null
"$PY" -m dora_megatron train --config configs/qwen3_30b_a3b_multinode.yaml --dry-run \
  --set model.path=configs/models/Qwen3-30B-A3B --slurm-env 'SLURM_JOB_NODELIST=gpu[0001-0016]' \
  --slurm-env SLURM_GPUS_ON_NODE=8 --plan-nodes 1 | tail -10
"$PY" -m dora_megatron train --config configs/gpu_ci_small.yaml --dry-run --set launch.backend=slurm \
  --set cluster.share_node=true --slurm-env SLURM_JOB_NODELIST=localhost --slurm-env SLURM_GPUS_ON_NODE=4 | tail -1
"$PY" -m pytest tests/gpu -m gpu -v -rs "$@"
if [ "$trainer_rc" -ne 0 ]; then
  echo "[gpu_smoke] tools/gpu_trainer_smoke.py failed (rc=$trainer_rc): see ${DORA_TRAINER_SMOKE_JSON:-gpu_trainer_smoke.json}" >&2
  exit "$trainer_rc"
fi
