# Sourced by the H200 stage scripts: output folder, environment, the `say` timestamp helper, gpu_tests, the offline
# install (exits 3 with the install log's tail when it fails) and kv_decode_bench.
set -u
OUT=${OUT:-results/session}; mkdir -p "$OUT" "$OUT/logs" models
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
say() { echo "[$(date +%T) +${SECONDS}s] $*"; }
# GPU tests under a time limit into $OUT/logs/<log>.log, then their summary line and first failures:
# gpu_tests seconds workers log "label" test-files...
gpu_tests() {
  local secs=$1 workers=$2 log=$OUT/logs/$3.log label=$4
  shift 4
  timeout "$secs" python3 -m pytest -q -n "$workers" -m gpu "$@" -p no:cacheprovider --durations=4 > "$log" 2>&1
  say "$label GPU tests (exit $?): $(tail -1 "$log")"
  grep -E "^(FAILED|ERROR|E  )" "$log" | cut -c1-300 | head -10
}
make setup PYTHON=python3 OFFLINE=1 > "$OUT/setup.log" 2>&1 || { tail -5 "$OUT/setup.log"; exit 3; }
# a warm machine keeps models/ between calls on a 64 GB disk (a 27B file is 28.6 GB): the oldest model files
# go while less than FREE_GB (default 32) GB is free
free_gb() { df -BG --output=avail . | tail -1 | tr -dc 0-9; }
while [ "$(free_gb)" -lt "${FREE_GB:-32}" ] && ls models/*.gguf > /dev/null 2>&1; do
  oldest=$(ls -tr models/*.gguf | head -1); say "disk: removing $oldest"; rm -f "$oldest"
done
say "setup done"
# llama.cpp's build (carry .cache/llama.cpp/src) and the 9b, then the 27b synthetic file, in the background:
# $build and $gen are their pids, /tmp/ninfer_9b_ready appears once the 9b file is there; $1: the log folder
start_builds() {
  python3 -m benchmarks.llamacpp build > "$1/llamacpp_build.log" 2>&1 &
  build=$!
  rm -f /tmp/ninfer_9b_ready
  ( [ -f models/q35-9b.gguf ] || python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf
    touch /tmp/ninfer_9b_ready
    [ -f models/q35-27b.gguf ] || python3 -m ninfer_numba make-model --shape 27b --no-vocab --out models/q35-27b.gguf
  ) > "$1/make_models.log" 2>&1 &
  gen=$!
}
# our decode at depth 32K on the 9b file with each given KV cache type, as type or type:partial (a coded
# cache's --kvq-partial; no llama.cpp); records in $OUT/kv.tgz
kv_decode_bench() {
  for entry in "$@"; do
    kv=${entry%%:*}; partial=${entry#"$kv"}; partial=${partial#:}; tag=$kv${partial:+_$partial}
    timeout 100 make bench PYTHON=python3 OFFLINE=1 BENCH_ARGS="--models 9b --tests tg128@d32768 --kv-type $kv \
      ${partial:+--kvq-partial $partial} --skip-llamacpp --out $OUT/kv_$tag" > "$OUT/logs/bench_kv_$tag.log" 2>&1
    say "decode, ours $kv${partial:+ with the $partial partial} (exit $?)"
    grep -E "^\| 9b" "$OUT/logs/bench_kv_$tag.log"
  done
  ( cd "$OUT" && tar czf kv.tgz kv_* && rm -rf kv_*/ )
}
