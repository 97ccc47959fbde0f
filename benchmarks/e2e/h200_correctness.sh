#!/usr/bin/env bash
# Correctness checks against other implementations on one H200, one stage per device call:
#   STAGE=follow: for each of SHAPES (default "0.8b 9b"; the 9b pair may need a call of its own) the files from
#               both block-scale generators (varied, one), then the tie-following reference
#               (benchmarks/e2e/gpu_vs_reference.py, tie-following part only) on each, one at a time with the
#               machine to itself (beside llama.cpp's build they did not finish: session 16); PARALLEL=1 runs
#               the two generators' files at once (the reference dequantizes each layer per call, one thread)
#   STAGE=gate: llama.cpp's build (carry .cache/llama.cpp/src) and the files in the background; llama.cpp as a
#               gate (benchmarks/llamacpp_logits.py --gate): its GPU test (tiny F32 and F16 files, 0.8b Q8_0
#               from both generators) and the figures on the 9b Q8_0 files and the 0.8b F16 / F32 files;
#               during the build, the model's GPU tests and the attention kernels' (MODEL_TESTS_S, 240 s)
# JSON under $OUT, logs in $OUT/logs.tgz
# Usage: STAGE=name OUT=dir bash benchmarks/e2e/h200_correctness.sh   (carry wheelhouse/ and .cache/llama.cpp/src)
source "$(dirname "$0")/h200_setup.sh"
left() { echo $(( ${DEADLINE:-570} - SECONDS > 10 ? ${DEADLINE:-570} - SECONDS : 10 )); }
blas() { OPENBLAS_NUM_THREADS=$1 OMP_NUM_THREADS=$1 MKL_NUM_THREADS=$1 "${@:2}"; }
# make-model into models/q35-<shape>-<scales>-<type>.gguf (vocab-less), unless an earlier step of the call made it
model() {   # shape scales type
  [ -f models/q35-$1-$2-$3.gguf ] || python3 -m ninfer_numba make-model --shape $1 --no-vocab --block-scales $2 --matrix-type $3 \
    --out models/q35-$1-$2-$3.gguf > "$OUT/logs/make_$1_$2_$3.log" 2>&1
}
# the tie-following reference on one file, in at most $1 seconds with $2 BLAS threads
follow() {   # seconds threads shape scales
  local tag=$3_$4
  blas $2 timeout $1 python3 -m benchmarks.e2e.gpu_vs_reference --model models/q35-$3-$4-q8_0.gguf --skip-float \
    --skip-emulating --skip-layers ${REF_CACHE_GB:+--ref-cache-gb $REF_CACHE_GB} --out "$OUT/following_$tag.json" \
    > "$OUT/logs/following_$tag.log" 2>&1
  say "$3 ($4 block scales) tie-following (exit $?):"; grep "^int8_following" "$OUT/logs/following_$tag.log" | cut -c1-1200
}
case "${STAGE:-gate}" in
follow)
  for shape in ${SHAPES:-0.8b 9b}; do for scales in varied one; do model $shape $scales q8_0; done; done
  say "files: $(ls models | tr '\n' ' ')"
  for shape in ${SHAPES:-0.8b 9b}; do
    if [ -n "${PARALLEL:-}" ]; then      # both generators at once, 8 BLAS threads each (much of the
      for scales in varied one; do REF_CACHE_GB=${REF_CACHE_GB:-38} follow $(( $(left) - 5 )) 8 $shape $scales & done
      wait                               # reference is one thread; two 9B weight caches of 36 GB fit 128 GB)
    else
      for scales in varied one; do follow $(( $(left) < 300 ? $(left) : 300 )) 16 $shape $scales; done
    fi
  done
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
gate)
  python3 -m benchmarks.llamacpp build > "$OUT/logs/llamacpp_build.log" 2>&1 &
  build=$!
  ( model 9b varied q8_0; model 9b one q8_0; model 0.8b varied f16; model 0.8b varied f32 ) &
  files=$!
  # meanwhile the whole model's GPU tests and the kernels of the attention path (the forward the gate
  # checks; the coded cache's too), in at most MODEL_TESTS_S seconds
  gpu_tests ${MODEL_TESTS_S:-240} 4 test_model "model and attention" tests/model tests/kernels/test_rope_kernel.py \
    tests/kernels/test_flash_attn_mma.py tests/kernels/test_kvq_append.py tests/kernels/test_kvq_prefill.py
  wait $build; say "llama.cpp build: $(tail -1 "$OUT/logs/llamacpp_build.log")"
  gpu_tests 150 2 test_gate "llama.cpp gate" tests/bench/test_llamacpp_gate.py
  wait $files
  for f in 9b-varied-q8_0:cuda 9b-one-q8_0:cuda 0.8b-varied-f16:cpu,cuda 0.8b-varied-f32:cpu,cuda; do
    timeout $(left) python3 -m benchmarks.llamacpp_logits --gate --model models/q35-${f%%:*}.gguf \
      --backend ${f##*:} --out "$OUT/gate_${f%%:*}.json" > "$OUT/logs/gate_${f%%:*}.log" 2>&1
    say "gate ${f%%:*} (exit $?): $(tail -1 "$OUT/logs/gate_${f%%:*}.log" | cut -c1-900)"
  done
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
*) echo "unknown STAGE=$STAGE"; exit 2 ;;
esac
