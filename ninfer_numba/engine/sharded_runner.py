"""CUDA runner over a model split by layers (engine/shard_plan.py): one worker per shard, hidden states
handed from shard to shard through pinned host memory.

Each worker owns its part of the weights (model/gpu_weights.py with a layer range), its caches, its stream
and its buffers, on the device the plan names; shards may share a device (then they still cross through host
memory, as between devices without peer access). The bridge buffers are portable pinned memory (every
context may copy to and from them); an event lives on the device of the stream that records it. For every
chunk of tokens:

  shard 0      tokens -> embedding, its layers -> buf.x [t, n_embd] -> pinned bridge (D2H), event
  shard k      waits on the event, bridge -> buf.x (H2D), its layers -> the next bridge, event
  last shard   ... its layers, the output norm and head -> logits

The host only enqueues: shard 0 may start chunk i + 1 while shard 1 still runs chunk i. Each boundary has
two bridge buffers (chunk parity) and a "consumed" event per buffer, so a chunk never overwrites a buffer
the next shard has not copied in yet. A decode step replays one captured graph per shard (copy in, forward,
copy out; the events stay outside the graphs), two per shard for the two bridge parities (one with a single
shard, which has no bridge), captured with programmatic launches as the plain runner's step. A greedy step
(decode_greedy) ends the last shard's graph with the device argmax and brings back 4 bytes; decode() brings
back the logits row into pinned memory.

Host work per greedy step is the plain runner's: with one shard the argmax writes the shard's own token
buffer, where the next step's embedding reads it, so a step fed its last pick uploads nothing (launch, 4
bytes back, synchronize); with several the pick reaches shard 0 through the host. _on(device) pushes a
device's context (cuda.gpus[d]: a lock, four driver calls in and two out) only when it is not current:
never in a step when all shards share a device, which __init__ makes current (as the plain runner does).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from ninfer_numba.config import EngineConfig
from ninfer_numba.engine.cuda_runner import chunk_lengths
from ninfer_numba.engine.graphs import CudaGraph
from ninfer_numba.engine.shard_plan import Shard, layer_costs, plan_shards
from ninfer_numba.kernels.numba_env import SIMULATOR, check_numba_cuda, cuda
from ninfer_numba.kernels.pdl import programmatic_launches
from ninfer_numba.kernels.sample.device import SampleWorkspace, argmax
from ninfer_numba.model.gpu_weights import GpuWeights
from ninfer_numba.model.qwen35 import Qwen35Gpu
from ninfer_numba.model.weights import ModelWeights

_SAME_DEVICE = nullcontext()       # _on's answer when the device's context is current already (reusable)


def _event():
    return cuda.event() if SIMULATOR else cuda.event(timing=False)     # the simulator takes no keywords


def _portable_pinned(n: int) -> np.ndarray:
    """float32 [n] in page-locked host memory that every device's context may copy to and from (a bridge
    buffer is written by one GPU and read by the next; plain pinned memory is pinned for one context only)."""
    if SIMULATOR:
        return cuda.pinned_array(n, np.float32)
    mem = cuda.current_context().memhostalloc(4 * n, portable=True)
    return np.ndarray((n,), dtype=np.float32, buffer=mem)


def _timing_event(stream):
    ev = cuda.event()
    ev.record(stream)
    return ev


@dataclass
class _Worker:
    shard: Shard
    stream: object
    model: Qwen35Gpu
    state: object
    bridge_in: list | None = None          # the two pinned buffers it copies from (None on shard 0)
    ready_in: list | None = None           # events: the previous shard filled bridge_in[p]
    consumed_in: list | None = None        # events: this shard has copied bridge_in[p] in


class ShardedCudaRunner:
    """The runner protocol of engine/llm.py (prefill, decode, all_logits, reset, position, timed_*)."""
    supports_device_sampling = False

    def __init__(self, weights: ModelWeights, engine: EngineConfig, devices: list[int], *, log=None) -> None:
        check_numba_cuda()
        c = self.config = weights.config
        self.engine, self.max_seq = engine, engine.max_seq
        sizes = {n: t.nbytes for n, t in weights.file.tensors.items()}
        self.plan = plan_shards(*layer_costs(sizes, c), devices=devices, tied=c.tied_embeddings)
        t0 = time.perf_counter()
        # each device's primary context, which _on compares with the current one (the simulator has none)
        self._ctx, self._current_ctx = None, None
        if not SIMULATOR:
            self._current_ctx = cuda.cudadrv.driver.driver.cuCtxGetCurrent
            self._ctx = {d: int(cuda.gpus[d].get_primary_context().handle) for d in {s.device for s in self.plan}}
            cuda.select_device(self.plan[0].device)
        self.workers: list[_Worker] = []
        for sh in self.plan:
            with self._on(sh.device):
                stream = cuda.stream()
                gw = GpuWeights(weights, layers=sh.layers, embedding=sh.embedding, head=sh.head, log=log)
                model = Qwen35Gpu(gw, engine, stream)
                w = _Worker(sh, stream, model, model.new_state(self.max_seq))
                if self.workers:
                    n = model.buf.t_max * c.n_embd
                    w.bridge_in = [_portable_pinned(n) for _ in range(2)]      # [t_max·E] float32 each
                    w.consumed_in = [_event() for _ in range(2)]              # recorded here, waited on there
            if self.workers:
                with self._on(self.workers[-1].shard.device):                # recorded by the previous shard
                    w.ready_in = [_event() for _ in range(2)]
            self.workers.append(w)
        first, last = self.workers[0], self.workers[-1]
        self._parities = 2 if len(self.workers) > 1 else 1       # one shard has no bridge: one graph is enough
        with self._on(first.shard.device):
            self._host_tok = cuda.pinned_array(first.model.buf.t_max, np.int32)   # ids of a chunk
            self._tok_copied = _event()
            # a decode step's token: views made once (a numba device-array slice costs tens of µs)
            self._host_tok1, self._dev_tok1 = self._host_tok[:1], first.model.buf.tokens[:1]
        with self._on(last.shard.device):                   # a greedy step's choice, on the last shard
            vocab = last.model.logits.shape[1]              # the head's rows (the vocabulary)
            self._sample_ws = SampleWorkspace(vocab, stream=last.stream)
            # [1] argmax; one shard: tokens[0] itself, read by the next step's embedding (module docstring)
            self._dev_tok = self._dev_tok1 if first is last else cuda.device_array(1, np.int32, stream=last.stream)
            self._pick = cuda.pinned_array(1, np.int32)                                  # its host copy
            self._host_logits = cuda.pinned_array(vocab, np.float32)                 # decode()'s row
        self._chunks = 0                    # chunks enqueued: their parity picks the bridge buffers
        self._tok_on_device: int | None = None   # the pick that _dev_tok1 holds (one shard), else None
        self.trace: list | None = None      # a list: (shard, chunk, start, end event) of every eager body
        self._step_graphs: dict[tuple, CudaGraph] | None = None   # (shard, parity, pick) -> decode graph
        self.reset()
        self._forward(np.array([1, 2], np.int32), 1)          # compile every kernel once (prefill, decode)
        self._forward(np.array([3], np.int32), 1, greedy=True)
        self._sync()
        self.reset()
        # the simulator has no graphs: there every step runs eagerly
        self._step_graphs = None if SIMULATOR else {}      # graphs only once every kernel has run
        self.compile_seconds = time.perf_counter() - t0

    def _on(self, device: int):
        """Context manager: device's context current inside. numba's cuda.gpus[device] pushes it and pops it
        again each time; that is skipped (one driver query instead) when it already is the current one."""
        if self._ctx is None or int(self._current_ctx()) == self._ctx[device]:
            return _SAME_DEVICE
        return cuda.gpus[device]

    # -- the chain of shards -----------------------------------------------------------------------------
    def _forward(self, ids, logits_rows: int, greedy: bool = False) -> None:
        """Enqueue one chunk (ids: t <= prefill_chunk tokens) through every shard; nothing waits on the host.
        A single token (a decode step) replays each shard's captured graph for the bridge parity in use;
        greedy: the last shard also writes the argmax of its logits row into _dev_tok and copies it to _pick.
        The ids go up to shard 0 unless they are the one token its buffer already holds (_tok_on_device)."""
        t = len(ids)
        p = self._chunks % self._parities
        self._chunks += 1
        upload = t > 1 or ids[0] != self._tok_on_device
        self._tok_on_device = None          # decode_greedy sets it again once this step's pick is back
        last = len(self.workers) - 1
        for k, w in enumerate(self.workers):
            with self._on(w.shard.device):
                if k == 0 and upload:
                    self._upload(ids)
                if k:
                    w.ready_in[p].wait(w.stream)
                if k < last:
                    self.workers[k + 1].consumed_in[p].wait(w.stream)    # its previous chunk was copied in
                rows = logits_rows if k == last else 1
                pick = greedy and k == last
                if t == 1 and self._step_graphs is not None:
                    self._replay_step(k, p, pick)
                    if k:
                        w.consumed_in[p].record(w.stream)
                else:
                    marks = (_timing_event(w.stream), None) if self.trace is not None else None
                    self._shard_body(k, t, p, rows, record_consumed=True, pick=pick)
                    if marks is not None:
                        self.trace.append((k, self._chunks - 1, marks[0], _timing_event(w.stream)))
                if k < last:
                    self.workers[k + 1].ready_in[p].record(w.stream)
                if pick:
                    self._dev_tok.copy_to_host(self._pick, stream=w.stream)

    def _upload(self, ids) -> None:
        """ids -> shard 0's token buffer through the pinned staging, on its stream (its device current)."""
        t, s = len(ids), self.workers[0].stream
        self._tok_copied.synchronize()                  # the previous chunk's ids have left the staging
        if t == 1:
            self._host_tok1[0] = ids[0]
            self._dev_tok1.copy_to_device(self._host_tok1, stream=s)
        else:
            self._host_tok[:t] = ids
            self.workers[0].model.buf.tokens[:t].copy_to_device(self._host_tok[:t], stream=s)
        self._tok_copied.record(s)

    def _shard_body(self, k: int, t: int, p: int, logits_rows: int, record_consumed: bool = False,
                    pick: bool = False) -> None:
        """Shard k's part of a chunk on its stream: the hidden state in from bridge p (after shard 0), its
        forward, the hidden state out to the next shard's bridge p (before the last); pick (the last shard):
        the argmax of the last logits row into _dev_tok."""
        w, n = self.workers[k], t * self.config.n_embd
        if k:
            w.model.buf.x[:n].copy_to_device(w.bridge_in[p][:n], stream=w.stream)
            if record_consumed:
                w.consumed_in[p].record(w.stream)
        w.model.forward(t, w.state, logits_rows=logits_rows)
        if k + 1 < len(self.workers):
            w.model.buf.x[:n].copy_to_host(self.workers[k + 1].bridge_in[p][:n], stream=w.stream)
        if pick:
            argmax(w.model.logits[logits_rows - 1], self._dev_tok, self._sample_ws, stream=w.stream)

    def _replay_step(self, k: int, p: int, pick: bool = False) -> None:
        """Shard k's decode step from its graph for bridge parity p, with the argmax when pick (captured on
        first use; a captured forward counted the position once, at capture, so the count is put back and
        each replay counts one)."""
        w = self.workers[k]
        graph = self._step_graphs.get((k, p, pick))
        if graph is None:
            pos = w.state.host_pos
            graph = self._step_graphs[k, p, pick] = CudaGraph(w.stream)
            # records only; programmatic launches as the plain runner's step (the bridge copies are memcpys,
            # which keep full stream order)
            with graph.capture(), programmatic_launches(self.engine.pdl):
                self._shard_body(k, 1, p, 1, pick=pick)
            w.state.host_pos = pos
        graph.launch()
        w.state.host_pos += 1

    def _run(self, ids: list[int], on_chunk=None) -> None:
        self._check_room(len(ids))
        arr = np.asarray(ids, np.int32)
        chunk = self.workers[0].model.buf.t_max
        if on_chunk is not None:
            chunk = min(chunk, self._last.model.logits.shape[0])
        s = 0
        for n in chunk_lengths(len(arr), chunk, split=self.engine.prefill_graphs):  # the plain runner's chunks
            part = arr[s:s + n]
            s += n
            self._forward(part, n if on_chunk else 1)
            if on_chunk is not None:
                on_chunk(n)

    @property
    def _last(self) -> _Worker:
        return self.workers[-1]

    def _logits(self, n: int) -> np.ndarray:
        w = self._last
        with self._on(w.shard.device):
            out = w.model.logits[:n].copy_to_host(stream=w.stream)
            w.stream.synchronize()
        return out

    def _sync(self) -> None:
        for w in self.workers:
            with self._on(w.shard.device):
                w.stream.synchronize()

    def _check_room(self, n: int) -> None:
        if self.position + n > self.max_seq:
            raise ValueError(f"context overflow: {self.position} + {n} tokens > max_seq {self.max_seq}")

    # -- runner protocol (engine/llm.py) -----------------------------------------------------------------
    @property
    def gemm_path(self) -> str:
        return self.workers[0].model.gemm_path

    @property
    def position(self) -> int:
        return self._last.state.host_pos

    def reset(self) -> None:
        self._tok_on_device = None
        for w in self.workers:
            with self._on(w.shard.device):
                w.state.reset(w.stream)

    def prefill(self, ids: list[int]) -> np.ndarray:
        self._run(ids)
        return self._logits(1)[0]

    def decode(self, token: int) -> np.ndarray:
        self._run([token])
        w = self._last
        with self._on(w.shard.device):
            w.model.logits[0].copy_to_host(self._host_logits, stream=w.stream)    # pinned: no staging
            w.stream.synchronize()
        return self._host_logits.copy()

    def decode_greedy(self, token: int) -> int:
        """One step whose choice is made on the last shard's device: 4 bytes cross to the host (and 4 go up
        first unless the token is the pick shard 0's buffer holds already)."""
        self._check_room(1)
        self._forward((token,), 1, greedy=True)        # enqueues the pick's copy into _pick too
        w = self._last
        with self._on(w.shard.device):
            w.stream.synchronize()
        pick = int(self._pick[0])
        self._tok_on_device = pick if self._dev_tok is self._dev_tok1 else None    # one shard: in its buffer
        return pick

    def all_logits(self, ids: list[int]) -> np.ndarray:
        rows = []
        self._run(ids, on_chunk=lambda n: rows.append(self._logits(n)))
        return np.concatenate(rows)

    def timed_prefill(self, ids: list[int]) -> float:
        self._sync()
        t0 = time.perf_counter()
        self._run(ids)
        self._sync()
        return time.perf_counter() - t0

    def timed_decode(self, first: int, n_gen: int) -> float:
        """n_gen steps, each token the argmax of the last, read back before the next (as llama-bench)."""
        self._sync()
        t0 = time.perf_counter()
        tok = first
        for _ in range(n_gen):
            tok = self.decode_greedy(tok)
        return time.perf_counter() - t0
