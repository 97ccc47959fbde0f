"""What one prefill forward costs at each short length, run eagerly and replayed from its captured graph.

    python -m benchmarks.e2e.prefill_lengths --model M.gguf [--lengths 1,2,3,8,15,16,17,32,64,128,256]
        [--profile 2,128] [--out F]

The CUDA runner (engine/cuda_runner.py) cuts a short prompt rest into pieces (chunk_lengths) whose graphs it
captures (warm_prefill); an admission into a batched-decode slot adds two state copies (copy_rows). Per
length: wall ms of one eager forward (~400 numba launches) and of one replay (the GPU's time plus one graph
launch), each with the stream synchronized, median of --repeats; then one copy_rows of 128 rows.
Where a replay costs more than its weight read (~2 ms on the 9B), the GPU work of that length is what to fix:
--profile T times every kernel of one forward of T tokens alone (benchmarks.e2e.decode_profile's table).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _median_ms(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="1,2,3,8,15,16,17,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", default="", help="lengths whose forward is timed kernel by kernel")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    import numpy as np

    from benchmarks.e2e.decode_profile import copy_gbps, kernel_rows, print_kernel_rows, record_launches
    from benchmarks.timing import gpu_name
    from ninfer_numba import LLM
    from ninfer_numba.engine.snapshot import copy_rows
    lengths = [int(x) for x in a.lengths.split(",")]
    profiled = [int(x) for x in a.profile.split(",") if x]
    # a profile replays each kernel ~150 times alone, the position's advance among them: room for that
    llm = LLM(a.model, backend="cuda", max_seq=2 * max(lengths) + 64 + 160 * max(profiled, default=0),
              prefix_cache_mb=0)
    run, model = llm.runner, llm.runner.model
    st, sync = run.state, run.stream.synchronize
    zeros = np.zeros(max(lengths + profiled), np.int32)
    print(f"{gpu_name()}; {a.model}; median of {a.repeats}")
    print(f"{'tokens':>6} {'eager ms':>9} {'replay ms':>10}")
    def put(n):
        """An empty state and n tokens (0s: what runs does not matter) for a forward of n."""
        st.reset(run.stream)
        model.buf.tokens[:n].copy_to_device(zeros[:n], stream=run.stream)
        model.tokens_owner = run

    rows = []
    for n in lengths:
        def eager(n=n):
            put(n)
            model.forward(n, st)

        def replay(n=n):
            put(n)
            run._forward_chunk(n, st, 1, {})

        eager_ms = _median_ms(eager, a.repeats, sync)
        replay(), replay()                                      # seen, then captured
        replay_ms = _median_ms(replay, a.repeats, sync)
        rows.append({"tokens": n, "eager_ms": eager_ms, "replay_ms": replay_ms})
        print(f"{n:6d} {eager_ms:9.2f} {replay_ms:10.2f}", flush=True)
    other = model.new_state(st.max_seq)                     # what is copied does not matter, only how much
    copy_ms = _median_ms(lambda: copy_rows(other, st, 128, run.stream), a.repeats, sync)
    print(f"copy_rows of 128 rows: {copy_ms:.2f} ms")
    profiles, copy = {}, copy_gbps() if a.profile else None
    for n in profiled:
        put(n)
        launches = record_launches(lambda: model.forward(n, st), run.stream)
        profiles[n] = kernel_rows(launches)
        total = sum(r["us"] for r in profiles[n])
        print(f"forward of {n} tokens: {len(launches)} kernels, {total / 1e3:.2f} ms summed alone")
        print_kernel_rows(profiles[n], copy, limit=20)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": gpu_name(), "model": a.model, "rows": rows, "copy_rows_ms": copy_ms,
                       "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
