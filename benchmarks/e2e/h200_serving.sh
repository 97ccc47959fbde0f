#!/usr/bin/env bash
# Serving on one H200 (the batched scheduler, the server, the prefix cache), one stage per device call (each
# under 10 minutes):
#   STAGE=serving_check: the engine's, server's and GPU model's tests (SERVING_TESTS=0 skips them; DEADLINE=s bounds
#               the call) (device logprobs, masked draws with the mask computed during the forward, prefix
#               snapshots), then on a 9B file with the vocabulary:
#               structured_output (grammar cost per token), prefix_gate (second-turn TTFT, shared system
#               prompt) and server_stream (TTFT and t/s as a client sees them)
#   STAGE=concurrency: 1 to 32 streams (STREAMS) at once through the server on a 9B file with the vocabulary,
#               beside llama-batched-bench on the same file (benchmarks/e2e/concurrency.py: table, plot, the
#               server's phases; issue 17's gate); KV_LOGITS=1: the 9b coded-cache logits test during the build
#   STAGE=packed: the batched decoder's GPU tests (packed prompts among them) and the engine's, then the server's
#               concurrency (STREAMS, default 1,16) with --no-pack-prompts and without, and prefix_gate (9B with
#               the vocabulary; DEADLINE=s bounds the call), then admission_cost with packs of 3, 9 and 15 prompts
#   STAGE=logits_batched: the 9b coded-cache logits test alone (issue 14; no build beside it), the batched
#               decoder's and the engine's GPU tests (chunked admissions among them), then prefix_gate and
#               concurrency (1 and 16 streams, no llama.cpp) on the 9b file with the vocabulary, in what is
#               left of DEADLINE (570) s
# Usage: STAGE=name OUT=dir bash benchmarks/e2e/h200_serving.sh   (carry wheelhouse/ for the offline install;
#        .cache/llama.cpp/src too for the stages that build llama.cpp)
source "$(dirname "$0")/h200_setup.sh"
left() { echo $(( ${DEADLINE:-570} - SECONDS > 10 ? ${DEADLINE:-570} - SECONDS : 10 )); }
# the 9b file made, the one with the vocabulary started in the background ($genv), and the coded caches' 9b
# logits test (issue 14) on the first, within $1 seconds
kv_logits_test() {
  python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/logs/make_9b.log" 2>&1
  python3 -m ninfer_numba make-model --shape 9b --out models/q35-9b-vocab.gguf > "$OUT/logs/make_9bv.log" 2>&1 &
  genv=$!
  NINFER_TEST_9B=models/q35-9b.gguf timeout $1 python3 -m pytest -q -m gpu -s -p no:cacheprovider \
    tests/bench/test_kv_logits.py -k 9b > "$OUT/logs/kv_logits.log" 2>&1
  say "9b logits test of the coded caches (exit $?): $(tail -1 "$OUT/logs/kv_logits.log")"
  grep -E "rel|top-1|greedy" "$OUT/logs/kv_logits.log" | head -8
}
case "${STAGE:-packed}" in
serving_check)
  python3 -m ninfer_numba make-model --shape 9b --out models/q35-9b-vocab.gguf > "$OUT/logs/make_9bv.log" 2>&1 &
  gen=$!
  if [ "${SERVING_TESTS:-1}" = 1 ]; then
    timeout 240 python3 -m pytest -q -n 4 -m gpu tests/engine tests/server tests/model/test_gpu_model.py \
      -p no:cacheprovider \
      > "$OUT/logs/test_serving_gpu.log" 2>&1
    say "engine and server GPU tests (exit $?): $(tail -1 "$OUT/logs/test_serving_gpu.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/logs/test_serving_gpu.log" | cut -c1-300 | head -10
  fi
  wait $gen
  timeout $(left) python3 -m benchmarks.e2e.structured_output --model models/q35-9b-vocab.gguf --backend cuda -n 20 \
    > "$OUT/logs/structured_9b.log" 2>&1
  say "structured output (exit $?):"; tail -4 "$OUT/logs/structured_9b.log"
  timeout $(left) python3 -m benchmarks.e2e.prefix_gate --model models/q35-9b-vocab.gguf --backend cuda \
    > "$OUT/logs/prefix_gate.log" 2>&1
  say "prefix gate (exit $?):"; grep -v "^WARNING" "$OUT/logs/prefix_gate.log" | tail -3
  timeout $(left) python3 -m benchmarks.e2e.server_stream --model models/q35-9b-vocab.gguf --backend cuda \
    --out "$OUT/server_stream.json" > "$OUT/logs/server_stream.log" 2>&1
  say "server stream (exit $?):"; grep -v "^WARNING" "$OUT/logs/server_stream.log" | tail -6
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
concurrency)
  # issue 17's benchmark: 1 to 32 streams through the server beside llama-batched-bench; with KV_LOGITS=1 the
  # 9b logits test of the coded caches (issue 14) runs while llama.cpp builds (the GPU is idle meanwhile)
  python3 -m benchmarks.llamacpp build > "$OUT/logs/llamacpp_build.log" 2>&1 &
  build=$!
  if [ -n "${KV_LOGITS:-}" ]; then
    kv_logits_test 240
    if kill -0 $build 2>/dev/null && [ $SECONDS -lt 220 ]; then   # the GPU idle while the build runs: the
      timeout 90 python3 -m benchmarks.e2e.batched_decode --model models/q35-9b.gguf --batches 1,16 --profile 16 \
        --out "$OUT/batched_decode.json" > "$OUT/logs/batched_decode.log" 2>&1
      say "batched_decode --profile 16 (the 16-row step's kernels), llama.cpp building beside it (exit $?):"
      grep -v "^WARNING" "$OUT/logs/batched_decode.log" | tail -22
    fi
    wait $genv
  else
    python3 -m ninfer_numba make-model --shape 9b --out models/q35-9b-vocab.gguf > "$OUT/logs/make_9bv.log" 2>&1
  fi
  wait $build; say "llama.cpp build: $(tail -1 "$OUT/logs/llamacpp_build.log")"
  timeout $(left) python3 -m benchmarks.e2e.concurrency --model models/q35-9b-vocab.gguf --backend cuda \
    ${STREAMS:+--streams $STREAMS} --out "$OUT/concurrency.json" > "$OUT/logs/concurrency.log" 2>&1
  say "concurrency (exit $?):"; grep -E "^(ours|  server|\||ninfer serve)" "$OUT/logs/concurrency.log" | tail -24
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
packed)
  [ -f models/q35-9b-vocab.gguf ] || python3 -m ninfer_numba make-model --shape 9b --out models/q35-9b-vocab.gguf \
    > "$OUT/logs/make_9bv.log" 2>&1 &
  genv=$!
  gpu_tests 200 4 test_packed "batched decoder (packed prompts), engine" tests/model/test_batched_decode.py tests/engine
  wait $genv
  for pack in --no-pack-prompts ""; do
    timeout $(( $(left) < 130 ? $(left) : 130 )) python3 -m benchmarks.e2e.concurrency --model models/q35-9b-vocab.gguf \
      --backend cuda --batch-slots 16 --streams ${STREAMS:-1,16} --no-llamacpp $pack \
      --out "$OUT/concurrency${pack:+_unpacked}.json" > "$OUT/logs/concurrency${pack:+_unpacked}.log" 2>&1
    say "concurrency ${pack:-packed} (exit $?):"; grep -E "^(ours|\||ninfer serve)" "$OUT/logs/concurrency${pack:+_unpacked}.log" | tail -12
  done
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m benchmarks.e2e.prefix_gate --model models/q35-9b-vocab.gguf \
    --backend cuda > "$OUT/logs/prefix_gate.log" 2>&1
  say "prefix_gate (exit $?):"; grep -E "^(turn|16 clients)" "$OUT/logs/prefix_gate.log"
  timeout $(( $(left) < 90 ? $(left) : 90 )) python3 -m benchmarks.e2e.admission_cost --model models/q35-9b-vocab.gguf \
    --warm --packs 3,9,15 > "$OUT/logs/admission.log" 2>&1
  say "admission cost, singles and packs (exit $?):"; grep -v "^WARNING" "$OUT/logs/admission.log" | tail -14
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
logits_batched)
  kv_logits_test 220
  gpu_tests 160 4 test_batched "batched decoder and engine" tests/model/test_batched_decode.py tests/engine
  wait $genv
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m benchmarks.e2e.prefix_gate --model models/q35-9b-vocab.gguf \
    --backend cuda > "$OUT/logs/prefix_gate.log" 2>&1
  say "prefix_gate (exit $?):"; grep -E "^(turn|16 clients)" "$OUT/logs/prefix_gate.log"
  timeout $(( $(left) < 130 ? $(left) : 130 )) python3 -m benchmarks.e2e.concurrency --model models/q35-9b-vocab.gguf \
    --backend cuda --streams 1,16 --no-llamacpp --out "$OUT/concurrency.json" > "$OUT/logs/concurrency.log" 2>&1
  say "concurrency (exit $?):"; grep -E "^(ours|  server|\||ninfer serve)" "$OUT/logs/concurrency.log" | tail -12
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
*)
  echo "unknown STAGE ${STAGE}: serving_check, concurrency, packed, logits_batched"; exit 2
  ;;
esac
