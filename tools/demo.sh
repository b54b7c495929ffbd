#!/usr/bin/env bash
# README command 1: set up the environment and run the main job (`dora train` on
# the tiny MoE model with embedded rollout engines). Extra arguments go to
# `dora train`, e.g. `bash tools/demo.sh --set run.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
VENV="${DORA_VENV:-.venv}"
exec "$VENV/bin/dora" train --config configs/cpu_tiny.yaml "$@"
