#!/usr/bin/env bash
# Create (or check) the virtual environment that runs real SGLang 0.5.23 rollout servers on CPU.
#
#   bash tools/setup_sglang_cpu.sh [VENV_DIR]
#
# VENV_DIR defaults to ~/.cache/dora_megatron/sglang-cpu-0.5.23; set `sglang.python` to
# VENV_DIR/bin/python (configs/cpu_sglang.yaml does). Why its own venv: SGLang pins a CUDA torch
# (torch==2.14.1) and CUDA-only kernels the trainer's venv must not get.
# Order matters: torch==2.13.0 first (the CPU build), then SGLang's own requirements read from the
# wheel's METADATA minus the CUDA-only ones (and minus the torch pins, so pip keeps the CPU torch),
# then sglang and torchvision without dependencies. Then the two import-time fixes of
# tools/sglang_cpu/ go into the venv's site-packages (never into the project's package):
#   sgl_kernel/            stands in for the CUDA-only `sgl_kernel` (sglang-kernel) module;
#   dora_tv_ops.py + .pth  define torchvision's nms/qnms op schemas before torchvision loads.
# Idempotent: a complete venv (stamp file written last) is checked and left as it is, so CI can
# keep it between runs. Needs only the package registry; nothing is compiled.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HOME/.cache/dora_megatron/sglang-cpu-0.5.23}"
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
SGLANG_VERSION="0.5.23"
TORCHVISION_VERSION="0.28.0"
STAMP="$VENV/.dora-sglang-ready"
FIXES="$HERE/sglang_cpu"
# the stamp names the fixes' content too, so a changed fix reinstalls them
WANT="torch==$TORCH_VERSION sglang==$SGLANG_VERSION torchvision==$TORCHVISION_VERSION fixes=$(cat "$FIXES"/sgl_kernel/__init__.py "$FIXES"/dora_tv_ops.py "$FIXES"/dora_tv_ops.pth | sha256sum | cut -c1-12)"

check() {
  SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - "$TORCH_VERSION" "$SGLANG_VERSION" <<'EOF'
import importlib.metadata as md, sys
torch_v, sglang_v = sys.argv[1], sys.argv[2]
assert md.version("torch").split("+")[0] == torch_v, md.version("torch")
assert md.version("sglang") == sglang_v, md.version("sglang")
import torchvision  # noqa: F401  (needs the nms/qnms schemas)
import sglang.srt.entrypoints.http_server  # noqa: F401  (the server's module)
import sglang.srt.managers.scheduler  # noqa: F401  (imports sgl_kernel on the CPU path)
EOF
}

install_fixes() {
  local site
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$site/sgl_kernel"
  cp -r "$FIXES/sgl_kernel" "$site/sgl_kernel"
  cp "$FIXES/dora_tv_ops.py" "$FIXES/dora_tv_ops.pth" "$site/"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && check >/dev/null 2>&1; then
  echo "sglang venv ready: $VENV ($WANT)"
  exit 0
fi

start=$(date +%s)
echo "creating the sglang venv in $VENV ($WANT) ..."
rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"   # an unfinished venv is completed in place
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" packaging
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
  WHEELS="$(mktemp -d)"
  trap 'rm -rf "$WHEELS"' EXIT
  "$VENV/bin/python" -m pip download -q --no-deps -d "$WHEELS" "sglang==$SGLANG_VERSION" 2>&1 | grep -v "is ignored" || true
  # SGLang's requirements (Requires-Dist of the wheel, markers evaluated, extras left out) minus the
  # CUDA-only packages and the torch family, whose versions stay the CPU ones installed here
  "$VENV/bin/python" - "$WHEELS"/sglang-*.whl > "$WHEELS/requirements.txt" <<'EOF'
import re, sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
CUDA_ONLY = re.compile(
    r"^(cuda-python|flash-attn-4|flashinfer[-_]python|humming-kernels|nvidia-.*|nvshmem4py-.*|"
    r"quack-kernels|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|sglang-kernel|tilelang|"
    r"torch|torchaudio|torchcodec|torchvision|torch[-_]memory[-_]saver)$", re.I)
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    dists = Parser().parsestr(whl.read(meta).decode()).get_all("Requires-Dist")
for line in dists:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if CUDA_ONLY.match(req.name):
        continue
    req.marker = None
    print(req)
EOF
  "$VENV/bin/python" -m pip install -q -r "$WHEELS/requirements.txt" "torch==$TORCH_VERSION" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION" 2>&1 | grep -v "is ignored" || true
fi
install_fixes
check
echo "$WANT" > "$STAMP"
echo "sglang venv ready: $VENV ($WANT) in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
