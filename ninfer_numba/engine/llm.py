"""The public LLM API shared by notebooks, the CLI, the server and the benchmark harness.

``LLM(path, backend=...)`` opens and validates the GGUF file, builds the tokenizer from its metadata and a
runner for the chosen backend: ``cpu`` runs the NumPy reference model, ``cuda`` the numba-kernel model.
Both runners implement the same small protocol (``reset``, ``prefill``, ``decode``, ``all_logits``,
``position``), and every token is picked through one route (engine/token_route.py): the device sampler where
the runner has one that can draw the request, the same arithmetic on the host otherwise.

Prefix reuse: the runner's state after a generation holds exactly the tokens it consumed (the prompt and the
generated tokens fed back). When the next prompt extends that sequence, as the next turn of a chat does, the
state is kept and only the new tokens are prefilled (``last_cached_tokens`` says how many were reused). A
Gated DeltaNet state exists only at the position it has reached, so a prompt that departs from the previous
sequence anywhere starts over, unless a snapshot of the state at one of its prefixes is in the prefix cache
(engine/prefix_cache.py: taken at fixed multiples inside every prompt and after the whole prompt).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ninfer_numba.config import EngineConfig, SamplingParams
from ninfer_numba.engine.prefix_cache import PrefixCache
from ninfer_numba.engine.sampling import Sampler
from ninfer_numba.engine.token_route import token_steps
from ninfer_numba.model.weights import open_model


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]        # generated ids (a final end-of-turn token included when it stopped on one)
    text: str                   # decoded generated text, end-of-turn token excluded
    finish_reason: str          # "stop" (end-of-turn / stop token) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0      # prompt tokens whose state was reused from the previous sequence
    logprobs: tuple = ()        # TokenLogprob per generated token when params.logprobs is set (sampling.py)


def _resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    from ninfer_numba.kernels.numba_env import gpu_available
    return "cuda" if gpu_available() else "cpu"


class LLM:
    def __init__(self, path: str | Path, backend: str = "auto", max_seq: int = 4096, *,
                 emulate_int8: bool = False, **engine_kwargs) -> None:
        self.path = str(path)
        self.engine_config = EngineConfig(backend=backend, max_seq=max_seq, **engine_kwargs)
        self.weights = open_model(self.path)
        self.config = self.weights.config
        if max_seq > self.config.context_length:
            raise ValueError(f"max_seq {max_seq} exceeds the model's context length {self.config.context_length}")
        kv = self.weights.file.kv
        from ninfer_numba.formats.tokenizer import Tokenizer
        self.tokenizer = Tokenizer.from_gguf_kv(kv)
        self.chat_template = kv.get("tokenizer.chat_template")
        self.model_id = Path(self.path).stem
        self.max_seq = max_seq
        self.backend = _resolve_backend(backend)
        t0 = time.perf_counter()
        if self.backend == "cpu":
            from ninfer_numba.engine.cpu_runner import CpuRunner
            self.runner = CpuRunner(self.weights, max_seq, emulate_int8=emulate_int8,
                                    kv_type=self.engine_config.kv_type,
                                    weight_cache_bytes=self.engine_config.cpu_weight_cache_mb << 20)
        elif self.backend == "cuda" and self.engine_config.gpus:
            from ninfer_numba.engine.shard_plan import parse_gpus
            from ninfer_numba.engine.sharded_runner import ShardedCudaRunner
            self.runner = ShardedCudaRunner(self.weights, self.engine_config, parse_gpus(self.engine_config.gpus))
        elif self.backend == "cuda":
            from ninfer_numba.engine.cuda_runner import CudaRunner
            self.runner = CudaRunner(self.weights, self.engine_config)
        else:
            raise ValueError(f"unknown backend {backend!r}")
        self.load_seconds = time.perf_counter() - t0
        self._fed: list[int] = []          # the tokens whose effect the runner's state holds, in order
        e = self.engine_config
        self.prefix_cache = PrefixCache(e.prefix_cache_mb << 20, e.snapshot_every) \
            if e.prefix_cache_mb and hasattr(self.runner, "snapshot") else None
        self.last_cached_tokens = 0        # prompt tokens the last stream() reused instead of prefilling
        self.last_logprobs: list = []      # the last stream()'s TokenLogprob entries (params.logprobs set)

    @property
    def compile_seconds(self) -> float:
        return getattr(self.runner, "compile_seconds", 0.0)

    def describe(self) -> dict:
        e = self.engine_config
        gemm = self.runner.gemm_path if self.backend == "cuda" else e.gemm   # what "auto" resolved to
        out = {"backend": self.backend, "kv_type": e.kv_type, "gemm": gemm, "max_seq": self.max_seq,
               "prefill_chunk": e.prefill_chunk, "prefill_graphs": e.prefill_graphs,
               "pdl": e.pdl, "pack_prompts": e.pack_prompts, "kvq_partial": e.kvq_partial}
        state = getattr(self.runner, "state", None)
        if state is not None and hasattr(state, "kv_bytes"):     # the GPU runner's sequence, as allocated
            out["kv_cache_bytes"] = state.kv_bytes()
        plan = getattr(self.runner, "plan", None)
        if plan is not None:
            out["shards"] = [f"GPU {s.device}: layers {s.first_layer}-{s.end_layer - 1}" for s in plan]
        return out

    def batch_refusal(self) -> str | None:
        """Why this engine cannot decode sequences together (scheduler()), or None when it can."""
        e = self.engine_config
        if self.backend == "cpu":
            return None
        if e.gpus:
            return f"batched decode runs on one GPU, not split over gpus {e.gpus!r}"
        if e.kv_type != "f16":
            return f"batched decode runs on the f16 KV cache, not {e.kv_type!r}"
        return None

    def scheduler(self, n_slots: int):
        """A scheduler of n_slots greedy sequences on this engine's model (engine/scheduler.py), sharing its
        prefix cache. On the GPU the slots' memory is allocated beside the runner's sequence and both run on
        the model's buffers: the runner and the scheduler must never run at once."""
        from ninfer_numba.engine.scheduler import Scheduler
        e = self.engine_config
        if self.backend == "cpu":
            from ninfer_numba.engine.cpu_runner import CpuSlots
            return Scheduler(CpuSlots(self.runner.model, n_slots, self.max_seq), self.prefix_cache,
                             admit_chunk=e.admit_chunk)
        refusal = self.batch_refusal()
        if refusal:
            raise ValueError(f"{refusal}: use one slot (--batch-slots 1)")
        from ninfer_numba.engine.batched import BatchedDecoder
        return Scheduler(BatchedDecoder(self.runner.model, n_slots, self.max_seq, pdl=e.pdl, runner=self.runner),
                         self.prefix_cache, pack=e.pack_prompts, admit_chunk=e.admit_chunk)

    # -- tokens in, tokens out -------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model file has no vocabulary (tokenizer.ggml.model = none): "
                                 "pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.n_vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.n_vocab}): {bad[:5]}")
        return ids

    def _check_fits(self, n_prompt: int, n_new: int) -> None:
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        if n_prompt + n_new > self.max_seq:
            raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({n_new}) exceeds the context of "
                             f"{self.max_seq} tokens (raise max_seq)")

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return params.stop_ids(self.tokenizer.eos_ids if self.tokenizer is not None else ())

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, constraint=None,
               snapshot_at: Sequence[int] = ()) -> Iterator[int]:
        """Yield generated ids one at a time; stops after max_tokens or after yielding a stop token.

        constraint: a grammar over the generated tokens (engine/constraint.py), or None. With
        params.logprobs set, ``last_logprobs[i]`` describes the i-th yielded token once it is yielded.
        snapshot_at: prompt lengths where the prefix cache should also keep the state (a chat's system turn
        and its history before the generation prompt, where the next turn departs: server/chat.py)."""
        ids = self.encode(prompt_ids)
        self._check_fits(len(ids), params.max_tokens)
        sampler = Sampler(params, self.config.n_vocab, prompt_ids=ids, constraint=constraint)
        self.last_logprobs = sampler.logprob_log
        if params.max_tokens == 0:
            return
        stops = self.stop_ids(params)
        rest = self._resume_from_snapshots(ids, self._continue_or_reset(ids), snapshot_at)
        generated: list[int] = []
        try:
            steps = token_steps(self.runner, sampler, rest, self.config.n_vocab, lambda: self._snapshot(ids))
            for n, tok in enumerate(steps):
                generated.append(tok)
                yield tok
                if tok in stops or n + 1 == params.max_tokens:
                    return
        finally:                           # the state holds the first `position` tokens of this sequence
            seq = self._fed + rest + generated
            self._fed = seq[:self.runner.position] if self.runner.position <= len(seq) else []

    def _continue_or_reset(self, ids: list[int]) -> list[int]:
        """The prompt tokens still to run: those past the previous sequence when ids extends it (its state is
        kept), else all of them after a reset."""
        n = len(self._fed)
        if self.engine_config.prefix_reuse and 0 < n < len(ids) and ids[:n] == self._fed \
                and self.runner.position == n:
            self.last_cached_tokens = n
            return ids[n:]
        self._reset()
        return ids

    def _resume_from_snapshots(self, ids: list[int], rest: list[int], extra: Sequence[int] = ()) -> list[int]:
        """With a prefix cache: restore its longest snapshot of ids if that beats the live state's reuse, then
        prefill up to each snapshot boundary of the prompt and keep a snapshot there. Returns the tokens still
        to run (at least the last one, whose logits the first pick needs)."""
        cache = self.prefix_cache
        if cache is None:
            return rest
        start = len(ids) - len(rest)
        hit = cache.longest(ids)
        if hit is not None and hit[0] > start:
            start, snap = hit
            self.runner.restore(snap)
            self._fed = ids[:start]
            self.last_cached_tokens = start
        for b in cache.boundaries(start, len(ids), extra):
            self.runner.prefill(ids[start:b])
            start = b
            self._fed = ids[:b]
            self._snapshot(ids[:b])
        return ids[start:]

    def _snapshot(self, ids: list[int]) -> None:
        """Keep the state after ids (their prefill has run, nothing after them yet), unless already kept."""
        if self.prefix_cache is not None:
            self.prefix_cache.keep(ids, self.runner.snapshot)

    def _reset(self) -> None:
        self.runner.reset()
        self._fed = []
        self.last_cached_tokens = 0

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 constraint=None) -> GenerationResult:
        params = params or SamplingParams()
        ids = self.encode(prompt)
        out = list(self.stream(ids, params, constraint))
        stops = self.stop_ids(params)
        stopped = bool(out) and out[-1] in stops
        body = out[:-1] if stopped else out
        text = self.tokenizer.decode(body) if self.tokenizer is not None else ""
        return GenerationResult(out, text, "stop" if stopped else "length", len(ids), len(out),
                                self.last_cached_tokens, tuple(self.last_logprobs))

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [T, n_vocab]: the logits after every position of one fresh sequence."""
        ids = self.encode(token_ids)
        self._check_fits(len(ids), 0)
        self._reset()
        return self.runner.all_logits(ids)

    # -- timing for the benchmark harness (llama-bench semantics) --------------------------------------
    def bench_prefill(self, n_tokens: int, *, seed: int = 0) -> float:
        ids = np.random.default_rng(seed).integers(0, self.config.n_vocab, n_tokens).tolist()
        self._check_fits(n_tokens, 0)
        self._reset()
        return self.runner.timed_prefill(ids)

    def bench_decode(self, n_gen: int, depth: int = 0, *, seed: int = 0) -> float:
        rng = np.random.default_rng(seed)
        if n_gen < 1 or depth + n_gen > self.max_seq:     # n_gen steps fill positions depth .. depth + n_gen - 1
            raise ValueError(f"{n_gen} decode steps after {depth} tokens need {depth + n_gen} positions; the "
                             f"context holds {self.max_seq} (raise max_seq)")
        self._reset()
        if depth:
            self.runner.prefill(rng.integers(0, self.config.n_vocab, depth).tolist())
        first = int(rng.integers(0, self.config.n_vocab))
        return self.runner.timed_decode(first, n_gen)
