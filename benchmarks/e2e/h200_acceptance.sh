#!/usr/bin/env bash
# The acceptance runs on one H200, one stage per device call (each under 10 minutes; run them back to back
# so the machine, the llama.cpp build and the model files stay: some stages use files an earlier one made):
#   STAGE=1: offline install, llama.cpp build + both 9b files in the background, whole-model GPU tests,
#            FlashAttention prefill at 8K/32K, 9b against the reference (end to end and layer by layer)
#   STAGE=2: streamed chat through the openai client against `ninfer serve` (9b with vocabulary), then
#            `make bench` with its defaults (both engines, synthetic 9b)
#   STAGE=3: 27b: make the file, prefill and decode through the harness (our engine), the GPU test suite
#   STAGE=4: (a fresh machine) whole-model GPU tests, the server again, llama.cpp as a logits oracle on the
#            9b and 0.8b files, 0.8b against the reference
#   STAGE=5: the whole GPU suite, GDN stage timings, the GEMM (and the previous GEMM kernel from ab/, if there)
#   STAGE=6: cold and warm start with a fresh kernel cache, our prefill and decode on the 9b file
#   STAGE=7: whole-model GPU tests, the 0.8b file against the references (tie-following included)
#   STAGE=8: the 9b file against the references
#   STAGE=9: the tie-following comparison alone (tiny test, 0.8b, 9b)
# Usage: STAGE=n OUT=dir NINFER_GIT_COMMIT=sha [PACK=file.tgz] bash benchmarks/e2e/h200_acceptance.sh
# PACK: also write everything under OUT into one archive (for transports that return only a few files).
source "$(dirname "$0")/h200_setup.sh"
case "${STAGE:-1}" in
1)
  python3 -m benchmarks.llamacpp build > "$OUT/llamacpp_build.log" 2>&1 &
  build=$!
  [ -f models/q35-9b.gguf ] || python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf \
    > "$OUT/make_9b.log" 2>&1 &
  gen=$!
  [ -f models/q35-9b-chat.gguf ] || python3 -m ninfer_numba make-model --shape 9b --out models/q35-9b-chat.gguf \
    > "$OUT/make_9b_chat.log" 2>&1 &
  timeout 240 python3 -m pytest -q -n 4 -m gpu tests/model -p no:cacheprovider > "$OUT/test_gpu_model.log" 2>&1
  say "whole-model GPU tests: $(tail -1 "$OUT/test_gpu_model.log")"; grep -E "^(FAILED|E  )" "$OUT/test_gpu_model.log" | cut -c1-300 | head -20
  timeout 150 python3 -m benchmarks.kernels.bench_attn --mma --only prefill --prefill-lengths 8192,32768 \
    > "$OUT/bench_attn_prefill_32k.log" 2>&1
  say "attention prefill:"; tail -8 "$OUT/bench_attn_prefill_32k.log"
  wait $gen; say "9b file: $(ls -la models/q35-9b.gguf)"
  timeout 330 python3 -m benchmarks.e2e.gpu_vs_reference --model models/q35-9b.gguf --out "$OUT/e2e_9b.json" \
    > "$OUT/e2e_9b.log" 2>&1
  say "9b vs reference:"; tail -3 "$OUT/e2e_9b.log" | cut -c1-2500
  wait $build; say "llama.cpp build: $(tail -1 "$OUT/llamacpp_build.log")"
  ;;
2)
  timeout 240 python3 -m benchmarks.e2e.server_stream --model models/q35-9b-chat.gguf --out "$OUT/server_stream_9b.json" \
    > "$OUT/server_stream.log" 2>&1
  say "server:"; tail -1 "$OUT/server_stream.log"
  rm -f models/q35-9b-chat.gguf
  timeout 420 make bench PYTHON=python3 OFFLINE=1 BENCH_ARGS="--out $OUT/bench" > "$OUT/make_bench.log" 2>&1
  say "make bench exit $?"; grep -v "^WARNING" "$OUT/make_bench.log" | tail -30
  ;;
3)
  rm -f models/q35-9b-chat.gguf
  timeout 330 python3 -m ninfer_numba bench --models 27b --tests pp512,pp2048,tg128 --reps 3 --skip-llamacpp \
    --out "$OUT/bench27" > "$OUT/bench_27b.log" 2>&1
  say "27b exit $?"; grep -v "^WARNING" "$OUT/bench_27b.log" | tail -15
  timeout 200 python3 -m pytest -q -n 8 -m gpu tests -p no:cacheprovider > "$OUT/test_gpu_all.log" 2>&1
  say "GPU suite: $(tail -1 "$OUT/test_gpu_all.log")"; grep "^FAILED" "$OUT/test_gpu_all.log" | cut -c1-200 | head
  ;;
4)
  python3 -m benchmarks.llamacpp build > "$OUT/llamacpp_build.log" 2>&1 &
  build=$!
  rm -f /tmp/ninfer_chat_ready
  ( python3 -m ninfer_numba make-model --shape 9b --out models/q35-9b-chat.gguf > "$OUT/make_9b_chat.log" 2>&1
    touch /tmp/ninfer_chat_ready
    python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/make_9b.log" 2>&1 ) &
  gen=$!
  python3 -m ninfer_numba make-model --shape 0.8b --no-vocab --out models/q35-0.8b.gguf > "$OUT/make_08b.log" 2>&1
  timeout 150 python3 -m pytest -q -n 4 -m gpu tests/model -p no:cacheprovider > "$OUT/test_gpu_model.log" 2>&1
  say "whole-model GPU tests: $(tail -1 "$OUT/test_gpu_model.log")"; grep -E "^(FAILED|E  )" "$OUT/test_gpu_model.log" | cut -c1-300 | head -20
  while [ ! -f /tmp/ninfer_chat_ready ]; do sleep 2; done
  timeout 150 python3 -m benchmarks.e2e.server_stream --model models/q35-9b-chat.gguf --out "$OUT/server_stream_9b.json" \
    > "$OUT/server_stream.log" 2>&1
  say "server:"; tail -1 "$OUT/server_stream.log"
  wait $build; say "llama.cpp build: $(tail -1 "$OUT/llamacpp_build.log")"
  wait $gen
  timeout 150 python3 -m benchmarks.llamacpp_logits --model models/q35-9b.gguf --out "$OUT/llamacpp_logits_9b.json" \
    > "$OUT/llamacpp_logits_9b.log" 2>&1
  say "9b vs llama.cpp: $(tail -1 "$OUT/llamacpp_logits_9b.log")"
  timeout 60 python3 -m benchmarks.llamacpp_logits --model models/q35-0.8b.gguf --out "$OUT/llamacpp_logits_08b.json" \
    > "$OUT/llamacpp_logits_08b.log" 2>&1
  say "0.8b vs llama.cpp: $(tail -1 "$OUT/llamacpp_logits_08b.log")"
  timeout 100 python3 -m benchmarks.e2e.gpu_vs_reference --model models/q35-0.8b.gguf --out "$OUT/e2e_08b.json" \
    > "$OUT/e2e_08b.log" 2>&1
  say "0.8b vs reference:"; tail -1 "$OUT/e2e_08b.log" | cut -c1-2500
  ;;
5)
  # the whole GPU suite, GDN stage timings, the GEMM before/after (ab/gemm_q8_mma_main.py, if present)
  [ -f models/q35-9b.gguf ] || python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf \
    > "$OUT/make_9b.log" 2>&1 &
  timeout 230 python3 -m pytest -q -n 8 -m gpu tests -p no:cacheprovider > "$OUT/test_gpu_all.log" 2>&1
  say "GPU suite: $(tail -1 "$OUT/test_gpu_all.log")"; grep "^FAILED" "$OUT/test_gpu_all.log" | cut -c1-200 | head
  timeout 120 python3 -m benchmarks.kernels.bench_gdn --model 9b --only prefill,stages --prefill-lengths 8192 \
    > "$OUT/bench_gdn.log" 2>&1
  say "GDN stages:"; tail -14 "$OUT/bench_gdn.log"
  gemm() { timeout 70 python3 -m benchmarks.kernels.bench_gemm --only gemm --paths mma --m 512,2048,8192 > "$1" 2>&1
           say "GEMM ($1):"; grep -v "^WARNING" "$1" | tail -4; }
  gemm "$OUT/bench_gemm.log"
  if [ -f ab/gemm_q8_mma_main.py ]; then
    cp ninfer_numba/kernels/q8/gemm_mma.py /tmp/gemm_q8_mma_branch.py && cp ab/gemm_q8_mma_main.py ninfer_numba/kernels/
    gemm "$OUT/bench_gemm_main.log"; cp /tmp/gemm_q8_mma_branch.py ninfer_numba/kernels/q8/gemm_mma.py
  fi
  wait
  ;;
6)
  # cold and warm start (fresh cache folder), then our prefill and decode on the 9b file
  timeout 200 python3 -m benchmarks.e2e.cold_warm_start --model models/q35-9b.gguf --warm-runs 2 \
    --out "$OUT/cold_warm_9b.json" > "$OUT/cold_warm.log" 2>&1
  say "cold/warm start:"; grep -E "^(cold|warm)" "$OUT/cold_warm.log"
  timeout 240 python3 -m ninfer_numba bench --models 9b --tests pp512,pp2048,pp8192,tg128 --reps 3 --skip-llamacpp \
    --out "$OUT/bench_ours" > "$OUT/bench_ours.log" 2>&1
  say "ours:"; grep -v "^WARNING" "$OUT/bench_ours.log" | tail -8
  ;;
7)
  # whole-model GPU tests, then the 0.8b file against the references (the 9b file is made meanwhile)
  [ -f models/q35-9b.gguf ] || python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf \
    > "$OUT/make_9b.log" 2>&1 &
  [ -f models/q35-0.8b.gguf ] || python3 -m ninfer_numba make-model --shape 0.8b --no-vocab \
    --out models/q35-0.8b.gguf > "$OUT/make_08b.log" 2>&1
  timeout 150 python3 -m pytest -q -n 4 -m gpu tests/model -p no:cacheprovider > "$OUT/test_gpu_model.log" 2>&1
  say "whole-model GPU tests: $(tail -1 "$OUT/test_gpu_model.log")"; grep -E "^(FAILED|E  )" "$OUT/test_gpu_model.log" | cut -c1-300 | head -20
  timeout 200 python3 -m benchmarks.e2e.gpu_vs_reference --model models/q35-0.8b.gguf --out "$OUT/e2e_08b.json" \
    > "$OUT/e2e_08b.log" 2>&1
  say "0.8b vs reference:"; tail -1 "$OUT/e2e_08b.log" | cut -c1-3000
  wait
  ;;
8)
  # the 9b file against the references (about 8 minutes: three NumPy forwards over 576 positions)
  timeout 570 python3 -m benchmarks.e2e.gpu_vs_reference --model models/q35-9b.gguf --out "$OUT/e2e_9b.json" \
    > "$OUT/e2e_9b.log" 2>&1
  say "9b vs reference:"; tail -1 "$OUT/e2e_9b.log" | cut -c1-3000
  ;;
9)
  # the tie-following comparison alone, 0.8b then 9b (the float and layer-by-layer parts: STAGE=7 and 8)
  [ -f models/q35-9b.gguf ] || python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf \
    > "$OUT/make_9b.log" 2>&1 &
  [ -f models/q35-0.8b.gguf ] || python3 -m ninfer_numba make-model --shape 0.8b --no-vocab \
    --out models/q35-0.8b.gguf > "$OUT/make_08b.log" 2>&1
  timeout 60 python3 -m pytest -q -m gpu tests/model/test_gpu_model.py -k following -p no:cacheprovider \
    > "$OUT/test_gpu_following.log" 2>&1
  say "tiny model, tie-following: $(tail -1 "$OUT/test_gpu_following.log")"
  for m in 0.8b 9b; do
    [ $m = 9b ] && wait
    timeout 240 python3 -m benchmarks.e2e.gpu_vs_reference --model models/q35-$m.gguf --skip-float --skip-layers \
      --out "$OUT/e2e_following_$m.json" > "$OUT/e2e_following_$m.log" 2>&1
    say "$m tie-following:"; grep "^int8_following" "$OUT/e2e_following_$m.log" | cut -c1-1500
  done
  ;;
esac
if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$OUT" . && say "packed $OUT into $PACK"; fi
