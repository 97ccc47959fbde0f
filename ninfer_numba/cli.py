"""Command line: ``ninfer`` / ``python -m ninfer_numba`` with generate | logits | make-model | info | serve | bench.

A thin layer over the Python API (``LLM``, ``SamplingParams``, ``write_synthetic_gguf``). Expected failures
(bad files, bad arguments, context overflow) print one line ``error: ...`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from ninfer_numba.config import KV_CACHE_TYPES, KVQ_PARTIALS, BackendUnavailableError, ModelFormatError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="path to a qwen35 GGUF file")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto picks cuda when a GPU is present")
    p.add_argument("--max-seq", type=int, default=4096, help="context capacity in tokens")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="tokens per prefill forward on the GPU (activation buffers are sized by it)")
    p.add_argument("--gemm", default="auto", choices=["auto", "w8a16", "mma", "dp4a"],
                   help="prefill GEMM on the GPU: auto is w8a16 on sm_90, else int8 mma (sm_80+) or dp4a")
    p.add_argument("--kv-type", default="f16", choices=KV_CACHE_TYPES,
                   help="KV cache format: f16, or keys/values in 3 or 4 bits after a Hadamard rotation "
                        "(kernels/kvq)")
    p.add_argument("--kvq-partial", default="auto", choices=KVQ_PARTIALS,
                   help="a coded cache's decode partial: lanes owning code groups, a lane per key token, "
                        "tensor cores (mma), or auto (mma for k3v3; tokens for other 3/4-bit caches from "
                        "16,384 tokens of capacity; else lanes)")
    p.add_argument("--prefix-cache-mb", type=_non_negative, default=1024,
                   help="memory for state snapshots at prompt prefixes, reused across requests (0: off)")
    p.add_argument("--cpu-weight-cache-mb", type=_non_negative, default=1024,
                   help="cpu backend: memory for weight matrices kept dequantized between forwards (0: "
                        "dequantize each on every use)")
    p.add_argument("--no-prefill-graphs", action="store_true",
                   help="run every prefill chunk eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch each decode-step kernel only when the one before it has drained (default on "
                        "Hopper: scheduled while it drains, programmatic dependent launch)")
    p.add_argument("--no-pack-prompts", action="store_true",
                   help="with --batch-slots > 1: admit one waiting prompt per step instead of prefilling three or "
                        "more in one forward (each weight read once for all of them; the default)")
    p.add_argument("--admit-chunk", type=_non_negative, default=512,
                   help="with --batch-slots > 1: a prompt longer than this is prefilled this many tokens per step, "
                        "between the other sequences' decode steps (0: the whole prompt in the step that admits it)")
    p.add_argument("--gpus", default="",
                   help="split the model by layers over these GPUs (cuda backend): a count or a list of ids, "
                        "0,0 for two shards on one GPU; `ninfer info --gpus` prints the split")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags of _add_engine_args (max_seq aside: callers may raise it)."""
    return dict(prefill_chunk=a.prefill_chunk, gemm=a.gemm, kv_type=a.kv_type,
                prefill_graphs=not a.no_prefill_graphs, prefix_cache_mb=a.prefix_cache_mb, gpus=a.gpus,
                pdl=not a.no_pdl, pack_prompts=not a.no_pack_prompts, kvq_partial=a.kvq_partial,
                cpu_weight_cache_mb=a.cpu_weight_cache_mb, admit_chunk=a.admit_chunk)


def _cmd_generate(a: argparse.Namespace) -> int:
    from ninfer_numba import LLM, SamplingParams
    llm = LLM(a.model, backend=a.backend, max_seq=a.max_seq, **_engine_kwargs(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed)
    prompt = a.prompt
    if a.chat:
        from ninfer_numba.formats.chat_template import render_chat
        prompt = render_chat([{"role": "user", "content": prompt}], template=llm.chat_template,
                             enable_thinking=not a.no_think)
    ids = llm.encode(prompt)
    print(f"[{llm.backend}] {len(ids)} prompt tokens", file=sys.stderr)
    from ninfer_numba.formats.tokenizer import IncrementalDecoder
    dec = IncrementalDecoder(llm.tokenizer) if llm.tokenizer is not None else None
    stops = llm.stop_ids(params)
    t0, n = time.perf_counter(), 0
    for tok in llm.stream(ids, params):
        n += 1
        if tok in stops:
            break
        sys.stdout.write(dec.push(tok) if dec else f"{tok} ")
        sys.stdout.flush()
    if dec:
        sys.stdout.write(dec.flush())
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f} s]", file=sys.stderr)
    return 0


def _parse_tokens(s: str) -> list[int]:
    parts = s.replace(" ", "").split(",")
    try:
        if not all(parts):
            raise ValueError
        return [int(t) for t in parts]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers (no empty entries), got {s!r}") from None


def _output_file(path: str) -> Path:
    """A file path to write: its folder is created when missing (as make-model does); a folder is refused."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path} is a folder; give a file name")
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _int_in(lo: int, hi: int | None = None, what: str = "must be"):
    """An argparse type: an integer in lo..hi (no upper bound when hi is None), else a one-line error."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"{what} an integer {bound}, not {text!r}")
        return n
    return parse


_port = _int_in(1, 65535, "port must be")
_non_negative = _int_in(0)


def _cmd_logits(a: argparse.Namespace) -> int:
    from ninfer_numba import LLM
    ids = _parse_tokens(a.tokens)
    llm = LLM(a.model, backend=a.backend, max_seq=max(a.max_seq, len(ids)), **_engine_kwargs(a))
    out = llm.logits(ids).astype(np.float32)
    target = _output_file(a.out)
    with open(target, "wb") as f:              # exactly this name (np.save would append .npy)
        np.save(f, out)
    print(f"wrote {target}: float32 {list(out.shape)}", file=sys.stderr)
    return 0


def _cmd_make_model(a: argparse.Namespace) -> int:
    from ninfer_numba.synth import stderr_progress, write_synthetic_gguf
    tied = None if a.tied is None else a.tied == "tied"
    path = write_synthetic_gguf(_output_file(a.out), a.shape, seed=a.seed, vocab=not a.no_vocab, tied=tied,
                                block_scales=a.block_scales, matrix_type=a.matrix_type, progress=stderr_progress)
    print(path)
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    from collections import Counter
    from ninfer_numba.model.weights import open_model
    w = open_model(a.model)
    c = w.config
    types = Counter(t.type_name for t in w.file.tensors.values())
    total = sum(t.nbytes for t in w.file.tensors.values())
    kv_per_tok = len(c.attention_layers) * 2 * c.n_head_kv * c.head_dim * 2
    state = len(c.gdn_layers) * (c.ssm_heads * c.ssm_state ** 2 + (c.conv_kernel - 1) * c.conv_dim) * 4
    print(f"file           {a.model} ({w.file.file_size / 1e9:.3f} GB, {len(w.file.tensors)} tensors)")
    print(f"architecture   qwen35 {c.name}".rstrip())
    print(f"layers         {c.n_layer} ({len(c.gdn_layers)} Gated DeltaNet, {len(c.attention_layers)} attention)")
    print(f"embedding      {c.n_embd}, ffn {c.n_ff}, vocab {c.n_vocab}, "
          f"{'tied' if c.tied_embeddings else 'untied'} output")
    print(f"attention      {c.n_head} heads / {c.n_head_kv} KV heads, head_dim {c.head_dim}, rope {c.n_rot} dims "
          f"base {c.rope_base:g}")
    print(f"gated deltanet {c.ssm_groups} key heads, {c.ssm_heads} value heads, state {c.ssm_state}, "
          f"conv {c.conv_kernel}")
    print(f"tensor types   {', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}")
    print(f"memory         weights {total / 1e9:.3f} GB; KV cache f16 {kv_per_tok / 1024:.0f} KiB/token; "
          f"recurrent state {state / 2**20:.1f} MiB/sequence")
    from ninfer_numba.engine.cache import kv_memory_bytes
    print(f"KV cache at    {c.context_length:,} tokens: " + ", ".join(
        f"{t} {kv_memory_bytes(c, t, c.context_length) / 1e9:.2f} GB" for t in KV_CACHE_TYPES))
    tok = w.file.kv.get("tokenizer.ggml.model")
    print(f"tokenizer      {tok}, chat template {'yes' if 'tokenizer.chat_template' in w.file.kv else 'no'}")
    if a.gpus:
        from ninfer_numba.engine.shard_plan import describe, layer_costs, parse_gpus, plan_shards
        costs = layer_costs({n: t.nbytes for n, t in w.file.tensors.items()}, c)
        plan = plan_shards(*costs, devices=parse_gpus(a.gpus), tied=c.tied_embeddings)
        print(f"split by layers over {len(plan)} shards (engine/shard_plan.py):")
        for line in describe(plan, c):
            print(f"  {line}")
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    from ninfer_numba import LLM
    from ninfer_numba.server.api import BATCH_SLOTS, serve
    llm = LLM(a.model, backend=a.backend, max_seq=a.max_seq, **_engine_kwargs(a))
    slots = a.batch_slots
    if slots is None:                       # the default: batch where the engine can
        refusal = llm.batch_refusal()
        slots = 1 if refusal else BATCH_SLOTS
        if refusal:
            print(f"ninfer serve: one request at a time ({refusal})", file=sys.stderr)
    serve(llm, host=a.host, port=a.port, api_key=a.api_key or os.environ.get("NINFER_API_KEY") or None,
          max_queue=a.max_queue, default_max_tokens=a.default_max_tokens or None, batch_slots=slots)
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from benchmarks.harness import run
    return run(a)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ninfer", description="Qwen3.5/3.6 GGUF inference with numba-cuda kernels")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    g.add_argument("--no-think", action="store_true", help="with --chat: render with thinking disabled")
    g.set_defaults(fn=_cmd_generate)

    lg = sub.add_parser("logits", help="write the logits after every position to a .npy file")
    _add_engine_args(lg)
    lg.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 5,17,200")
    lg.add_argument("--out", required=True, help="output file, NumPy .npy format (float32 [n_tokens, vocab])")
    lg.set_defaults(fn=_cmd_logits)

    m = sub.add_parser("make-model", help="write a synthetic random-weight qwen35 GGUF")
    m.add_argument("--shape", default="tiny", choices=["tiny", "0.8b", "2b", "4b", "9b", "27b"])
    m.add_argument("--out", required=True)
    m.add_argument("--no-vocab", action="store_true", help="vocab-less file (tokenizer.ggml.model = none)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tied", choices=["tied", "untied"], default=None,
                   help="output embedding (default: as the published model)")
    m.add_argument("--block-scales", choices=["varied", "one"], default="varied",
                   help="Q8_0 block scales: drawn per block (default) or one per matrix")
    m.add_argument("--matrix-type", choices=["q8_0", "f16", "f32"], default="q8_0",
                   help="how matrices are stored: Q8_0 (default), or the same values dequantized as floats")
    m.set_defaults(fn=_cmd_make_model)

    i = sub.add_parser("info", help="describe a model file")
    i.add_argument("--model", required=True)
    i.add_argument("--gpus", default=None,
                   help="also print the split by layers over these GPUs: a count or a list of ids (0,0: two on one)")
    i.set_defaults(fn=_cmd_info)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require this bearer token (or set NINFER_API_KEY, which keeps it out of `ps`)")
    s.add_argument("--max-queue", type=_non_negative, default=64,
                   help="requests that may wait behind the running ones; more are answered 429 with Retry-After")
    s.add_argument("--batch-slots", type=_int_in(1, 16, "--batch-slots must be"), default=None,
                   help="greedy requests (temperature 0, no penalty, grammar or logprobs) decoded together, each "
                        "slot a whole --max-seq context; 1: every request alone, one after another. The cuda "
                        "backend batches on one GPU with the f16 KV cache only (default: 4 where it can, else 1)")
    s.add_argument("--default-max-tokens", type=_non_negative, default=16384,
                   help="completion limit of a request that sets none (0: the rest of the context)")
    s.set_defaults(fn=_cmd_serve)

    b = sub.add_parser("bench", help="benchmark against llama.cpp on the same GGUF")
    from benchmarks.harness import add_arguments
    add_arguments(b)
    b.set_defaults(fn=_cmd_bench)
    return ap


def _one_line(e: BaseException) -> str:
    """An error message on one printable line: names read from a corrupted file can hold newlines and
    control bytes, which are shown escaped; long messages are cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(str(e).split()))
    return text if len(text) <= 400 else text[:397] + "..."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ModelFormatError, ValueError, FileNotFoundError, BackendUnavailableError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
