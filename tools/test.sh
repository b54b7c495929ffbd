#!/usr/bin/env bash
# README command 2: set up the environment and run the test suite (unit + integration).
# Extra arguments go to pytest, e.g. `bash tools/test.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
VENV="${DORA_VENV:-.venv}"
set +e
"$VENV/bin/python" -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
