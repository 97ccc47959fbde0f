#!/usr/bin/env bash
# Prefill work on one H200, one stage per device call (each under 10 minutes):
#   STAGE=diag: GPU tests of the f16 activation kernels; W8A16 build variants timed side by side; ncu stall
#               reasons of two variants (M = 8192, 9B gate|up)
#   STAGE=gemm: GPU tests of the W8A16 GEMM and the f16 activation kernels, then bench_prefill_gemm
#               (ours and cuBLAS int8/f16 on every 9B and 27B projection, M = 512, 2048, 8192)
# Usage: STAGE=name OUT=dir bash benchmarks/e2e/h200_prefill.sh   (carry wheelhouse/ for the offline install)
set -u
OUT=${OUT:-results/session}; mkdir -p "$OUT" models
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
say() { echo "[$(date +%T) +${SECONDS}s] $*"; }
make setup PYTHON=python3 OFFLINE=1 > "$OUT/setup.log" 2>&1 || { tail -5 "$OUT/setup.log"; exit 3; }
say "setup done"
case "${STAGE:-gemm}" in
gemm)
  timeout 90 python3 -m pytest -q -x tests/kernels/test_gemm_w8a16.py -k "small or dequant" -p no:cacheprovider \
    > "$OUT/test_gemm_smoke.log" 2>&1
  rc=$?; say "smoke (exit $rc): $(tail -1 "$OUT/test_gemm_smoke.log")"
  [ $rc = 124 ] && { tail -30 "$OUT/test_gemm_smoke.log"; exit 4; }
  tests="tests/kernels/test_gemm_w8a16.py ${EXTRA_TESTS:-}"
  timeout 200 python3 -m pytest -q -n 4 -m "gpu or cudasim" $tests -p no:cacheprovider > "$OUT/test_gemm_gpu.log" 2>&1
  say "GPU tests: $(tail -1 "$OUT/test_gemm_gpu.log")"; grep -E "^(FAILED|E  )" "$OUT/test_gemm_gpu.log" | cut -c1-240 | head -20
  timeout 300 python3 -m benchmarks.kernels.bench_prefill_gemm --models 9b,27b --m 512,2048,8192 --paths w8a16,mma \
    --out "$OUT/bench_prefill_gemm.jsonl" > "$OUT/bench_prefill_gemm.log" 2>&1
  say "prefill GEMM (exit $?):"; grep -v "^WARNING" "$OUT/bench_prefill_gemm.log" | tail -32
  ;;
diag)
  timeout 150 python3 -m pytest -q -n 4 -m "gpu or cudasim" tests/kernels/test_act_f16.py -p no:cacheprovider \
    > "$OUT/test_act_f16_gpu.log" 2>&1
  say "act_f16 GPU tests: $(tail -1 "$OUT/test_act_f16_gpu.log")"; grep -E "^(FAILED|E  )" "$OUT/test_act_f16_gpu.log" | cut -c1-240 | head
  timeout 200 python3 -m benchmarks.kernels.bench_prefill_gemm --models 9b --m 2048,8192 --shapes "gate|up,down" \
    --paths w8a16 --no-cublas --variants "${VARIANTS:-256,1,2;256,0,1;256,0,2}" --out "$OUT/variants.jsonl" \
    > "$OUT/variants.log" 2>&1
  say "variants (exit $?):"; grep -v "^WARNING" "$OUT/variants.log" | tail -6
  for v in ${NCU_VARIANTS:-"256,1,1" "256,1,2"}; do
    timeout 120 ncu --clock-control none -k regex:gemm_w8a16 -c 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 -m benchmarks.kernels.bench_prefill_gemm --models 9b \
      --m 8192 --shapes "gate|up" --paths "" --variants "$v" --no-cublas > "$OUT/ncu_$v.log" 2>&1
    say "ncu $v (exit $?):"; grep -E "Duration|Throughput|Issued|Eligible|Registers|Warp Cycles|stalled" "$OUT/ncu_$v.log" \
      | awk '$NF+0 > 0.05 || !/stalled/' | head -45
  done
  ;;
esac
