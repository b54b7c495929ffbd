#!/usr/bin/env bash
# Debian's SLURM (slurm-wlm: slurmctld, slurmd, sbatch/srun/scontrol) and munge for the real-SLURM
# tests (tests/integration/test_slurm_real.py), which start their own one-host cluster of three
# emulated nodes. Idempotent: nothing is installed when the binaries are already there.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"
missing=0
for b in munged slurmctld slurmd sbatch scontrol scancel sinfo; do
  command -v "$b" >/dev/null 2>&1 || missing=1
done
if [ "$missing" -eq 0 ]; then
  echo "[slurm] slurm-wlm and munge already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[slurm] slurm-wlm/munge missing and not root: run 'sudo bash tools/install_slurm.sh'" >&2
  exit 1
fi
echo "[slurm] installing slurm-wlm and munge (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurm-wlm munge >/dev/null
echo "[slurm] ok: $(slurmctld -V)"
