# Sourced by the H200 stage scripts: output folder, environment, the `say` timestamp helper and the offline
# install (exits 3 with the install log's tail when it fails).
set -u
OUT=${OUT:-results/session}; mkdir -p "$OUT" "$OUT/logs" models
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
say() { echo "[$(date +%T) +${SECONDS}s] $*"; }
make setup PYTHON=python3 OFFLINE=1 > "$OUT/setup.log" 2>&1 || { tail -5 "$OUT/setup.log"; exit 3; }
say "setup done"
