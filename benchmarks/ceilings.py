"""Hardware ceilings and the roofline fraction of each result.

Ceilings are measured, not taken from data sheets: the device-to-device copy bandwidth (read + write bytes)
and the int8 GEMM rate of cuBLAS at 9B-like shapes. They are measured with torch (both) or cupy (copy only)
when either is installed on the GPU machine; otherwise they are recorded as null, and so are the fractions.

Rooflines (reference/anchors.md §3-4):
- decode: bytes read per token = every weight except the embedding table (one row of it is gathered) plus
  the KV cache read at the mean context of the test; achieved GB/s = bytes/token × t/s, against the copy rate.
- prefill: int8 ops per token = 2 × the parameters of the Q8_0 matrices other than token_embd and output
  (llama-bench computes logits for the last token only); achieved TOPS = ops/token × t/s, against the GEMM rate.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.records import BenchTest
from ninfer_numba.kernels.kvq.ref import KV_TYPES, vector_bytes

# Bytes per cached K or V value for each KV type (Q8_0: fp16 scale + 32 int8 per 32 values).
KV_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8": 34 / 32, "q8_0": 34 / 32, "q4_0": 18 / 32,
                      # our coded caches at head size 256 (the models' attention heads): key and value averaged
                      **{t: sum(vector_bytes(t, 256)) / 512 for t in KV_TYPES}}
COPY_BYTES = 1 << 30                                   # 1 GiB: far beyond the 60 MB L2
GEMM_SHAPES = ((512, 4096, 12288), (2048, 4096, 12288), (8192, 4096, 12288))  # (M, K, N) of the 9B FFN


def null_ceilings(reason: str) -> dict:
    return {"copy_gbps": None, "int8_tops": None, "method": None, "note": reason}


def measure_ceilings(reps: int = 10) -> dict:
    """{'copy_gbps', 'int8_tops', 'method', 'note'}: torch first, then cupy, else nulls (with the reason)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        result = {"copy_gbps": _torch_copy_gbps(torch, reps), "int8_tops": _torch_int8_tops(torch, reps),
                  "method": f"torch {torch.__version__}", "note": "copy: read+write of 1 GiB; int8: torch._int_mm"}
        torch.cuda.empty_cache()  # hand the cached blocks back before the engines load their models
        return result
    try:
        import cupy
    except ImportError:
        return null_ceilings("neither torch nor cupy with CUDA is installed")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        return null_ceilings("cupy sees no GPU")
    result = {"copy_gbps": _cupy_copy_gbps(cupy, reps), "int8_tops": None, "method": f"cupy {cupy.__version__}",
              "note": "copy: read+write of 1 GiB; int8 GEMM needs torch"}
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def _torch_copy_gbps(torch, reps: int) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = _torch_time(torch, lambda: dst.copy_(src), reps)
    return 2 * COPY_BYTES / statistics.median(times) / 1e9


def _torch_int8_tops(torch, reps: int) -> float:
    best = 0.0
    for m, k, n in GEMM_SHAPES:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t()  # column-major B for cuBLASLt
        torch._int_mm(a, b)
        seconds = statistics.median(_torch_time(torch, lambda: torch._int_mm(a, b), reps))
        best = max(best, 2 * m * k * n / seconds / 1e12)
    return best


def _torch_time(torch, fn, reps: int) -> list[float]:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return times


def _cupy_copy_gbps(cupy, reps: int) -> float:
    src = cupy.empty(COPY_BYTES, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    dst[...] = src
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * COPY_BYTES / statistics.median(times) / 1e9


@dataclass(frozen=True)
class ModelCost:
    """Per-token work of one model file, from its tensor table and metadata."""
    model_size_bytes: int          # all tensor data (llama-bench's model_size)
    weight_bytes_per_token: int    # decode: everything but the embedding table, plus one row of it
    gemm_params: int               # prefill: parameters of the Q8_0 matrices except token_embd and output
    kv_values_per_token: int       # K and V values cached per context token over all attention layers

    @classmethod
    def from_gguf(cls, path: Path) -> "ModelCost":
        from gguf import GGMLQuantizationType, GGUFReader
        from ninfer_numba.config import ModelConfig

        reader = GGUFReader(str(path))
        kv = {name: field.contents() for name, field in reader.fields.items()
              if not name.startswith("tokenizer.ggml.")}
        names = {t.name for t in reader.tensors}
        cfg = ModelConfig.from_gguf(kv, names)
        total = sum(int(t.n_bytes) for t in reader.tensors)
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        embd_row = int(embd.n_bytes) // cfg.n_vocab
        # A tied model reads the whole table again for the logits, so only the untied case saves it.
        weight_bytes = total if cfg.tied_embeddings else total - int(embd.n_bytes) + embd_row
        gemm = sum(int(t.n_elements) for t in reader.tensors
                   if t.tensor_type == GGMLQuantizationType.Q8_0
                   and t.name not in ("token_embd.weight", "output.weight"))
        kv_values = len(cfg.attention_layers) * 2 * cfg.n_head_kv * cfg.head_dim
        return cls(total, weight_bytes, gemm, kv_values)

    def decode_bytes_per_token(self, test: BenchTest, kv_type: str) -> float | None:
        """Weights + KV read per generated token, averaged over the test (token i sees n_depth + i positions)."""
        per_value = KV_BYTES_PER_VALUE.get(kv_type)
        if per_value is None:
            return None
        mean_context = test.n_depth + (test.n_gen + 1) / 2
        return self.weight_bytes_per_token + self.kv_values_per_token * per_value * mean_context

    def prefill_ops_per_token(self) -> float:
        return 2.0 * self.gemm_params

    def as_dict(self) -> dict:
        return asdict(self)


def roofline(test: BenchTest, tps: float, cost: ModelCost, ceilings: dict, kv_type: str) -> dict:
    """{'metric', 'achieved', 'ceiling', 'fraction'} of one result; achieved is GB/s (decode) or int8 TOPS
    (prefill); ceiling and fraction are None when the ceiling was not measured."""
    if test.kind == "tg":
        per_token = cost.decode_bytes_per_token(test, kv_type)
        achieved = None if per_token is None else per_token * tps / 1e9
        metric, ceiling = "GB/s", ceilings.get("copy_gbps")
    else:
        achieved = cost.prefill_ops_per_token() * tps / 1e12
        metric, ceiling = "int8 TOPS", ceilings.get("int8_tops")
    fraction = achieved / ceiling if achieved is not None and ceiling else None
    return {"metric": metric, "achieved": achieved, "ceiling": ceiling, "fraction": fraction}


def kernel_throughput(seconds: float, ceilings: dict, *, bytes_moved: float | None = None,
                      int8_ops: float | None = None) -> dict:
    """GB/s and int8 TOPS of one kernel call taking ``seconds``, each with its fraction of the measured
    ceiling (None when that quantity or ceiling is absent). Used by the kernel microbenchmarks."""
    if seconds <= 0:
        raise ValueError(f"a kernel time must be positive, got {seconds}")
    out = {"gbps": None, "copy_fraction": None, "tops": None, "int8_fraction": None}
    if bytes_moved is not None:
        out["gbps"] = bytes_moved / seconds / 1e9
        if ceilings.get("copy_gbps"):
            out["copy_fraction"] = out["gbps"] / ceilings["copy_gbps"]
    if int8_ops is not None:
        out["tops"] = int8_ops / seconds / 1e12
        if ceilings.get("int8_tops"):
            out["int8_fraction"] = out["tops"] / ceilings["int8_tops"]
    return out


if __name__ == "__main__":
    import json
    print(json.dumps(measure_ceilings(), indent=1))
