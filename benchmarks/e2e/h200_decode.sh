#!/usr/bin/env bash
# Decode, coded KV caches, serving and shards on one H200, one stage per device call (each under 10 minutes):
#   STAGE=decode_accept: the decode issue's acceptance in one call (~8 minutes): llama.cpp build (carry
#               .cache/llama.cpp/src) and the 9b and 27b files in the background; the GPU tests of the decode
#               kernels; bench_gemm's GEMV rows (9b, 27b) of .cache/ab_base
#               when carried and of this tree; decode_profile (9b and 27b, depth 0; 9b with --no-pdl where the
#               tree has it);
#               both engines on the 9b file (tg128 at depths 0, 8192, 32768), then on the 27b (tg128)
#   STAGE=kvq_check: the coded caches' and the f16 decode attention's GPU tests, bench_attn's f16 and kvq decode rows (9B), our decode at depth
#               32K with f16 and k3v3 (records in $OUT/kv.tgz)
#   STAGE=kvq_ncu: ncu of the coded-cache decode kernels (partial and combine, k3v3 at 8K, 9B shape): speed of
#               light, warp states, stall reasons, and the partial's SASS page summed by sass_stalls
#   STAGE=shard_check: the split by layers on one GPU: its GPU test (2 and 4 shards against the plain runner),
#               then benchmarks.e2e.shard_bridge on the 9b file (bridge cost per token and per 8K prefill)
#   STAGE=decode_profile: every kernel of a 9B decode step timed alone against its bytes, next to the step
#               (benchmarks.e2e.decode_profile at depth 0 and 8192; JSON under $OUT)
#   STAGE=shards_32k: the shard GPU test, then shard_bridge on the 9b file (2 and 4 shards against the plain
#               runner bit for bit, the bridge's cost, the traced overlap), beside the two 32K GDN GPU tests
#               (CPU-bound float64 references, 6 BLAS threads each)
#   STAGE=kvq_variants: the coded-cache GPU tests (append, rope coding, the three decode partials, the model),
#               bench_attn's rope rows (the step's launch at 64/128/256 threads) and f16 and coded-cache
#               decode rows (lanes, tokens, mma), our decode at depth 32K with f16, k3v3 (auto) and k3v3
#               with the tokens partial, then decode_profile of k3v3 at 32K, and of f16 and k3v3 with every
#               kernel after an L2 flush (--cold), in what is left of DEADLINE (570) s
#   STAGE=kv_llamacpp: llama.cpp built and the 9b file (meanwhile the coded-cache GPU tests and bench_attn's
#               k3v3 mma partial at 16 / 8K / 32K cached tokens), then the decode
#               at depth 32K of ours with k3v3 beside llama.cpp's q8_0 cache, and ours with f16 beside its q4_0
#               (issue 14's speed gate; records in $OUT/kv_llamacpp.tgz), then decode_profile of k3v3 at 32K
#               and our k4v4 decode with the token-lane and mma partials, in what is left of DEADLINE (570) s
#   STAGE=long_context: the 27b file, then benchmarks.e2e.long_context on it at its whole context (262,144
#               tokens, depth 261,760) with KV (k3v3): the first FILL (default depth - 8,192) tokens of the
#               cache filled at random (a full prefill is ~1.35e17 FLOPs of attention, past one call), the
#               last 8,192 prefilled at that depth (the coded prefill timed), 3 decodes of 128 tokens, the
#               KV memory as allocated and in ninfer info's formula (issue 14), in what is left of DEADLINE
# Usage: STAGE=name OUT=dir bash benchmarks/e2e/h200_decode.sh   (carry wheelhouse/ for the offline install)
source "$(dirname "$0")/h200_setup.sh"
# decode_profile of one file at one depth within $1 seconds: the table on stdout, JSON under $OUT
profile() {   # seconds, model, depth [extra decode_profile flags, e.g. --no-pdl]
  local tag=$2_d$3${4:+_${4#--}}
  timeout $1 python3 -m benchmarks.e2e.decode_profile --model models/q35-$2.gguf --depth $3 ${4:-} \
    --out "$OUT/profile_$tag.json" > "$OUT/logs/decode_profile_$tag.log" 2>&1
  say "decode profile $2, depth $3 ${4:-} (exit $?):"; grep -v "^WARNING" "$OUT/logs/decode_profile_$tag.log" | head -16
}
# the coded caches' GPU tests (append, rope coding, the three decode partials, the model): seconds, workers
coded_gpu_tests() {
  gpu_tests $1 $2 test_kvq "coded-cache" tests/kernels/test_kvq_decode.py tests/kernels/test_kvq_append.py \
    tests/kernels/test_rope_kernel.py tests/model/test_kv_types.py
}
# decode_profile of the 9b file at depth 32K with a KV type and partial (DEADLINE-bounded, at most 80 s)
kvq_profile() {   # kv type, partial [--cold: every kernel after an L2 flush]
  local secs=$(( ${DEADLINE:-570} - SECONDS > 10 ? ${DEADLINE:-570} - SECONDS : 10 )) tag=$1_$2${3:+_cold}
  timeout $(( secs < 80 ? secs : 80 )) python3 -m benchmarks.e2e.decode_profile --model models/q35-9b.gguf \
    --depth 32768 --kv-type $1 --kvq-partial $2 ${3:-} --out "$OUT/profile_$tag.json" > "$OUT/logs/profile_$tag.log" 2>&1
  say "decode profile $1 ($2 partial${3:+, cold L2}) at 32K (exit $?):"; grep -v "^WARNING" "$OUT/logs/profile_$tag.log" | head -12
}
case "${STAGE:-decode_accept}" in
decode_accept)
  start_builds "$OUT/logs"
  # the decode kernels' GPU tests only (the whole model's and the engine's take minutes: gpu_suite, branches);
  # with the GDN prefill, model and engine tests this ran 99 tests in its 230 s and stopped at 65 %
  timeout 150 python3 -m pytest -q -n 12 -m gpu tests/kernels/test_quant_act.py tests/kernels/test_act_f16.py \
    tests/kernels/test_gemv_q8.py $(ls tests/kernels/test_pdl.py 2>/dev/null) \
    tests/kernels/test_flash_attn_decode.py tests/kernels/test_gdn_decode.py -p no:cacheprovider --durations=8 \
    > "$OUT/logs/test_decode_gpu.log" 2>&1
  say "decode GPU tests (exit $?): $(tail -1 "$OUT/logs/test_decode_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/logs/test_decode_gpu.log" | cut -c1-300 | head -20
  for tree in .cache/ab_base .; do                # the GEMVs of both models, base tree first (when carried)
    [ -d "$tree/ninfer_numba" ] || continue
    ( cd "$tree" && timeout 60 python3 -m benchmarks.kernels.bench_gemm --model 9b --only gemv
      timeout 60 python3 -m benchmarks.kernels.bench_gemm --model 27b --only gemv ) > "$OUT/logs/gemv_$(basename "$tree").log" 2>&1
    say "GEMVs, tree $tree:"; grep -E "gemv_q8" "$OUT/logs/gemv_$(basename "$tree").log" | cut -c1-110
  done
  while [ ! -f /tmp/ninfer_9b_ready ]; do sleep 2; done
  profile 60 9b 0                                 # the profiles while llama.cpp still builds
  if grep -q -- "--no-pdl" benchmarks/e2e/decode_profile.py; then profile 45 9b 0 --no-pdl; fi
  wait $gen
  profile 60 27b 0
  wait $build; say "llama.cpp build: $(tail -1 "$OUT/logs/llamacpp_build.log")"
  timeout 170 make bench PYTHON=python3 OFFLINE=1 BENCH_ARGS="--models 9b --tests tg128,tg128@d8192,tg128@d32768 \
    --out $OUT/bench9" > "$OUT/logs/bench9.log" 2>&1
  say "9b decode, both engines (exit $?)"; grep -E "^\| 9b" "$OUT/logs/bench9.log"
  timeout $(( 575 - SECONDS > 30 ? 575 - SECONDS : 30 )) make bench PYTHON=python3 OFFLINE=1 \
    BENCH_ARGS="--models 27b --tests tg128 --out $OUT/bench27" > "$OUT/logs/bench27.log" 2>&1
  say "27b decode, both engines (exit $?)"; grep -E "^\| 27b" "$OUT/logs/bench27.log"
  tar czf "$OUT/bench.tgz" -C "$OUT" bench9 bench27 2>/dev/null; rm -rf "$OUT/bench9" "$OUT/bench27"
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
kvq_check)
  python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/logs/make_9b.log" 2>&1 &
  gen=$!
  timeout 240 python3 -m pytest -q -n 6 -m gpu tests/kernels/test_kvq_decode.py tests/kernels/test_kvq_append.py \
    tests/kernels/test_flash_attn_decode.py tests/model/test_kv_types.py -p no:cacheprovider \
    > "$OUT/logs/test_kvq_gpu.log" 2>&1
  say "coded-cache GPU tests (exit $?): $(tail -1 "$OUT/logs/test_kvq_gpu.log")"
  grep -E "^(FAILED|ERROR|E  )" "$OUT/logs/test_kvq_gpu.log" | cut -c1-300 | head -10
  timeout 90 python3 -m benchmarks.kernels.bench_attn --model 9b --only decode,kvq --out "$OUT/logs/bench_attn.jsonl" \
    > "$OUT/logs/bench_attn.log" 2>&1
  say "bench_attn decode (exit $?):"; grep -E "decode" "$OUT/logs/bench_attn.log"
  wait $gen
  kv_decode_bench f16 k3v3
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
shard_check)
  python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/logs/make_9b.log" 2>&1 &
  gen=$!
  timeout 200 python3 -m pytest -q -m gpu tests/engine/test_sharded_runner.py tests/engine/test_shard_plan.py \
    -p no:cacheprovider > "$OUT/logs/test_shards_gpu.log" 2>&1
  say "sharded GPU tests (exit $?): $(tail -1 "$OUT/logs/test_shards_gpu.log")"
  grep -E "^(FAILED|ERROR|E  )" "$OUT/logs/test_shards_gpu.log" | cut -c1-300 | head -10
  wait $gen
  timeout 300 python3 -m benchmarks.e2e.shard_bridge --model models/q35-9b.gguf > "$OUT/logs/shard_bridge.log" 2>&1
  say "shard_bridge (exit $?):"; grep -v "^WARNING" "$OUT/logs/shard_bridge.log" | tail -14
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
decode_profile)
  python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/logs/make_9b.log" 2>&1
  profile 200 9b 0; profile 200 9b 8192
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
kvq_ncu)
  for k in partial combine; do
    timeout 200 ncu --clock-control none -k "regex:$k" -c 1 --set full --import-source yes -o "$OUT/logs/kvq_$k" \
      python3 -m benchmarks.kernels.bench_attn --model 9b --only kvq > "$OUT/logs/ncu_kvq_$k.log" 2>&1
    say "ncu kvq $k (exit $?)"
    ncu --import "$OUT/logs/kvq_$k.ncu-rep" --print-summary none --page details > "$OUT/logs/kvq_${k}_details.txt" 2>&1
    grep -E "Duration|Memory Throughput|Issued Ipc|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" \
      "$OUT/logs/kvq_${k}_details.txt" | head -12
    ncu --import "$OUT/logs/kvq_$k.ncu-rep" --page source --csv --print-source sass > "$OUT/logs/kvq_${k}_sass.csv" 2>&1
    python3 -m benchmarks.kernels.sass_stalls "$OUT/logs/kvq_${k}_sass.csv" --top 25 | cut -c1-200
  done
  rm -f "$OUT"/logs/*.ncu-rep
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
shards_32k)
  python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/logs/make_9b.log" 2>&1 &
  gen=$!
  OPENBLAS_NUM_THREADS=6 OMP_NUM_THREADS=6 MKL_NUM_THREADS=6 timeout 540 python3 -m pytest -q -n 2 -m gpu \
    tests/kernels/test_gdn_prefill.py -k T32768 -p no:cacheprovider --durations=2 > "$OUT/logs/test_gdn_32k.log" 2>&1 &
  gdn_pid=$!
  timeout 120 python3 -m pytest -q -m gpu tests/engine/test_sharded_runner.py -p no:cacheprovider \
    > "$OUT/logs/test_shards_gpu.log" 2>&1
  say "sharded GPU tests (exit $?): $(tail -1 "$OUT/logs/test_shards_gpu.log")"
  grep -E "^(FAILED|ERROR|E  )" "$OUT/logs/test_shards_gpu.log" | cut -c1-300 | head -10
  wait $gen
  timeout $(( 560 - SECONDS > 30 ? 560 - SECONDS : 30 )) python3 -m benchmarks.e2e.shard_bridge \
    --model models/q35-9b.gguf > "$OUT/logs/shard_bridge.log" 2>&1
  say "shard_bridge (exit $?):"; grep -v "^WARNING" "$OUT/logs/shard_bridge.log" | tail -16
  wait $gdn_pid
  say "GDN GPU tests at 32K (exit $?): $(tail -1 "$OUT/logs/test_gdn_32k.log")"
  grep -E "^(FAILED|E  )|s call" "$OUT/logs/test_gdn_32k.log" | cut -c1-300 | head
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
kvq_variants)
  left() { echo $(( ${DEADLINE:-570} - SECONDS > 10 ? ${DEADLINE:-570} - SECONDS : 10 )); }
  python3 -m ninfer_numba make-model --shape 9b --no-vocab --out models/q35-9b.gguf > "$OUT/logs/make_9b.log" 2>&1 &
  gen=$!
  coded_gpu_tests 150 6
  timeout 120 python3 -m benchmarks.kernels.bench_attn --model 9b --only rope,decode,kvq \
    --out "$OUT/bench_attn.jsonl" > "$OUT/logs/bench_attn.log" 2>&1
  say "bench_attn rope and decode (exit $?):"; grep -E "decode|rope_step" "$OUT/logs/bench_attn.log"
  wait $gen
  kv_decode_bench f16 k3v3 k3v3:tokens
  kvq_profile k3v3 auto
  kvq_profile f16 auto --cold
  kvq_profile k3v3 auto --cold
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
kv_llamacpp)
  # issue 14's speed gate in one call: our decode at depth 32K with f16 and k3v3 beside llama.cpp's q8_0 and
  # q4_0 caches (two make bench runs: ours k3v3 / theirs q8_0, ours f16 / theirs q4_0) on one 9b file
  left() { echo $(( ${DEADLINE:-570} - SECONDS > 10 ? ${DEADLINE:-570} - SECONDS : 10 )); }
  start_builds "$OUT/logs"
  coded_gpu_tests 150 6                                    # the GPU is idle while llama.cpp builds
  timeout 60 python3 -m benchmarks.kernels.bench_attn --model 9b --only kvq --kvq-types k3v3 --kvq-variants mma \
    --kvq-lengths 16,8192,32768 --out "$OUT/bench_attn.jsonl" > "$OUT/logs/bench_attn.log" 2>&1
  say "bench_attn, the k3v3 mma partial (exit $?):"; grep kvq_decode "$OUT/logs/bench_attn.log"
  wait $build; say "llama.cpp build: $(tail -1 "$OUT/logs/llamacpp_build.log")"
  while [ ! -f /tmp/ninfer_9b_ready ]; do sleep 2; done
  kill $gen 2>/dev/null; pkill -f "make-model --shape 27b"     # the 27b file is not needed here
  for pair in k3v3:q8_0 f16:q4_0; do
    ours=${pair%%:*}; theirs=${pair##*:}
    timeout $(( $(left) < 200 ? $(left) : 200 )) make bench PYTHON=python3 OFFLINE=1 BENCH_ARGS="--models 9b \
      --tests tg128@d32768 --kv-type $ours --llamacpp-kv-type $theirs --out $OUT/kv_${ours}_lc_${theirs}" \
      > "$OUT/logs/bench_kv_${ours}_lc_${theirs}.log" 2>&1
    say "decode at 32K, ours $ours, llama.cpp $theirs (exit $?)"; grep -E "^\| 9b" "$OUT/logs/bench_kv_${ours}_lc_${theirs}.log"
  done
  ( cd "$OUT" && tar czf kv_llamacpp.tgz kv_*_lc_* && rm -rf kv_*_lc_*/ )
  kvq_profile k3v3 auto
  [ "$(left)" -gt 90 ] && kv_decode_bench k4v4:tokens k4v4:mma
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
long_context)
  left() { echo $(( ${DEADLINE:-570} - SECONDS > 10 ? ${DEADLINE:-570} - SECONDS : 10 )); }
  [ -f models/q35-27b.gguf ] || python3 -m ninfer_numba make-model --shape 27b --no-vocab --out models/q35-27b.gguf \
    > "$OUT/logs/make_27b.log" 2>&1
  python3 -m ninfer_numba info --model models/q35-27b.gguf | grep "KV cache at"
  timeout $(left) python3 -m benchmarks.e2e.long_context --model models/q35-27b.gguf --kv-type ${KV:-k3v3} \
    ${DEPTH:+--depth $DEPTH} --fill ${FILL:-$(( ${DEPTH:-261760} - 8192 ))} --out "$OUT/long_context.json" > "$OUT/logs/long_context.log" 2>&1
  say "long_context (exit $?):"; grep -v "^WARNING" "$OUT/logs/long_context.log" | tail -8
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  ;;
esac
