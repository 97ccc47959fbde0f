"""Batched greedy decode on the CUDA backend: up to 16 sequences, each in a slot of engine/cache.SlotStates,
advance one token per step in one forward that reads every weight once (kernels/q8/gemv_rows.py).

A step with n active sequences runs the smallest batch-size bucket B >= n (1, 2, 4, 8, 16, and n_slots);
each bucket is one captured graph: forward(B, rows), then each row's greedy pick (the device argmax of its
logits row into buf.tokens[b]). Graphs bake in their buffers, not the slot table or the positions, so one
graph serves any set of active slots. The rows past n step a spare slot (``pad``): they race on its state,
which no sequence owns, and its position is put back every step, so it never runs out of room. Every matmul
row and every per-row kernel is independent of the others, so what the spare rows compute reaches nobody.

A sequence enters with ``reset(s)`` (or ``restore(s, snapshot)``) and ``prefill(s, ids)``. Given the CUDA
runner, a prefill runs on a staging state through the runner's chunks and captured prefill graphs
(cuda_runner.chunk_lengths: a short prompt in at most two pieces, lengths that recur), between two copies
of the slot's rows and GDN states (engine/snapshot.copy_rows, replayed from a graph per slot and size): a
128-token prompt run eagerly is ~400 numba launches, ~50 ms on the 9B. Without it, the model's chunked
prefill on the slot's view, eagerly. ``step(slots, tokens)`` feeds each active sequence its input token and
returns each one's next. Sampling other than greedy, logprobs and grammars are
the single-sequence runner's (engine/cuda_runner.py); this is the slot decoder of the scheduler of many clients
(engine/scheduler.py). Snapshots are the runner's CudaSnapshot (f16 KV rows and GDN states), so the prefix
cache serves both.
"""
from __future__ import annotations

import time

import numpy as np

from ninfer_numba.engine.cache import SequenceState
from ninfer_numba.engine.snapshot import CudaSnapshot, copy_rows
from ninfer_numba.engine.graphs import CudaGraph
from ninfer_numba.kernels import position
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
from ninfer_numba.kernels.pdl import programmatic_launches
from ninfer_numba.kernels.q8.gemv_rows import MAX_ROWS
from ninfer_numba.kernels.sample.device import SampleWorkspace, argmax

BUCKETS = (1, 2, 4, 8, 16)
COPY_ROWS_MIN = 256               # the fewest cache rows a slot <-> staging copy moves (a graph per power of two)


class BatchedDecoder:
    """n_slots sequences of at most max_seq tokens on the model of a CUDA runner (model/qwen35.Qwen35Gpu, f16
    KV cache); the model's buffers are shared with that runner, which must not run meanwhile."""

    def __init__(self, model, n_slots: int, max_seq: int, *, pdl: bool = True, runner=None) -> None:
        t_max = model.buf.t_max
        if not 1 <= n_slots <= min(MAX_ROWS, t_max):
            raise ValueError(f"a batched decoder holds 1 to {min(MAX_ROWS, t_max)} sequences, not {n_slots}")
        self.model, self.stream, self.max_seq, self.pdl = model, model.stream, max_seq, pdl
        self.n_slots = n_slots
        self.runner = runner                                        # its prefill graphs serve the staging
        self._staging = model.new_state(max_seq) if runner is not None else None
        self.buckets = sorted({b for b in BUCKETS if b < n_slots} | {n_slots})
        self.states = model.new_slots(n_slots + 1, max_seq)        # slot n_slots: the spare rows step
        self.pad = n_slots
        vocab = model.logits.shape[1]
        self._ws = [SampleWorkspace(vocab, stream=self.stream) for _ in range(n_slots)]   # one per row
        self._picks = cuda.device_array(n_slots, np.int32, stream=self.stream)            # [n_slots] prefills' picks
        self._host_in = cuda.pinned_array(n_slots, np.int32)        # [n_slots] the rows' input tokens
        self._host_out = cuda.pinned_array(n_slots, np.int32)       # [n_slots] their picks
        self._graphs: dict[int, CudaGraph] = {}
        self._copy_graphs: dict[tuple, CudaGraph] = {}              # (slot, into staging, rows) -> copy_rows
        self._tokens_dev = {b: model.buf.tokens[:b] for b in self.buckets}   # [b] views, made once
        self._rows_key = self._fed_key = None    # (bucket, slots) whose rows are set / whose picks are fed
        self._fed_picks: list[int] = []
        self._pending = None                     # ((bucket, slots), n) of the launched step
        for b in self.buckets:                                      # every kernel once, on the spare slot
            self._enqueue(b, [], set_rows=True)
        self.stream.synchronize()
        self.states.reset(self.pad)

    @property
    def host_pos(self) -> list[int]:
        """Tokens each slot holds."""
        return self.states.host_pos[:self.n_slots]

    def bucket(self, n: int) -> int:
        """The rows a step of n active sequences runs."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences in one step; this decoder holds {self.n_slots}")

    def warm(self) -> float:
        """The runner's prefill pieces captured for the staging state (CudaRunner.warm_prefill), so admissions
        replay from the first; 0 without a runner. Returns the wall seconds."""
        return 0.0 if self.runner is None else self.runner.warm_prefill(self._staging)

    def reset(self, s: int) -> None:
        """Empty slot s for a new sequence."""
        self._check_slot(s)
        self.states.reset(s)
        self._forget_rows()

    def release(self, s: int) -> None:
        """Slot s's sequence is done. Its memory is the decoder's for good and reset() empties it for the next
        one, so nothing is freed here."""
        self._check_slot(s)

    def snapshot(self, s: int) -> CudaSnapshot:
        """Slot s's state as it stands once the enqueued work is done (copies ordered on the stream)."""
        self._check_slot(s)
        return CudaSnapshot(self.states.view(s), self.stream)

    def _copy(self, s: int, src: SequenceState, dst: SequenceState, p: int) -> None:
        """dst holds src's first p tokens, one of them slot s's view and the other the staging state: a replay
        of the graph of copy_rows kept for (slot, direction, rows), rows the power of two >= p (at least
        COPY_ROWS_MIN, at most max_seq; rows past p are never read). Its ~110 driver copies cost ~5 ms of
        Python each time; the slots' and the staging state's memory never moves, so a graph stays valid."""
        rows = min(self.max_seq, max(COPY_ROWS_MIN, 1 << max(p - 1, 0).bit_length()))
        if SIMULATOR:                                   # no graphs: the copies themselves
            copy_rows(dst, src, rows, self.stream)
        else:
            key = (s, dst is self._staging, rows)
            graph = self._copy_graphs.get(key)
            if graph is None:
                graph = self._copy_graphs[key] = CudaGraph(self.stream)
                with graph.capture():
                    copy_rows(dst, src, rows, self.stream)
            graph.launch()
        position.set_position(dst.pos, p, stream=self.stream)
        dst.host_pos = p

    def restore(self, s: int, snap: CudaSnapshot) -> None:
        """Slot s holds the state a snapshot kept (of this decoder or of the model's runner)."""
        self._check_slot(s)
        view = self.states.view(s)
        snap.restore_into(view, self.stream)
        self.states.adopt(s, view)
        self._forget_rows()

    def prefill(self, s: int, ids: list[int]) -> int:
        """ids run on slot s after what it holds, in chunks; returns the greedy next token."""
        self._start_prefill([(s, ids)])
        m = self.model
        view = self.states.view(s)
        if self.runner is not None:
            st = self._staging
            self._copy(s, view, st, view.host_pos)           # what the slot holds: a restored prefix, or none
            self.runner.run_on(ids, st)
            self._copy(s, st, view, st.host_pos)
        else:
            arr = np.asarray(ids, np.int32)
            for i in range(0, len(arr), m.buf.t_max):
                part = np.ascontiguousarray(arr[i:i + m.buf.t_max])
                m.buf.tokens[:len(part)].copy_to_device(part, stream=self.stream)
                m.forward(len(part), view)
        self.states.adopt(s, view)
        return self._read_picks(1)[0]

    @property
    def pack_room(self) -> tuple[int, int]:
        """(sequences, tokens) one prefill_many takes at most."""
        m = self.model
        return min(self.n_slots, m.logits.shape[0]), m.buf.t_max

    def prefill_many(self, items: list[tuple[int, list[int]]]) -> list[int]:
        """Several slots' prompts (items [(slot, ids)], distinct slots) run in one forward on the slots
        themselves (model.forward_packed: each matmul reads its weights once for all of them), eagerly: one
        forward's ~400 launches plus a few per prompt, where prefill() replays a captured forward per prompt
        and piece. Returns each one's greedy next token."""
        t0 = time.perf_counter()
        slots = [s for s, _ in items]
        n_seqs, n_tokens = self.pack_room
        total = sum(len(ids) for _, ids in items)
        if not 1 <= len(items) <= n_seqs or len(set(slots)) != len(slots) or total > n_tokens:
            raise ValueError(f"{len(items)} prompts of {total} tokens in slots {slots}: at most {n_seqs} distinct"
                             f" slots and {n_tokens} tokens")
        self._start_prefill(items)
        m = self.model
        views = [self.states.view(s) for s in slots]
        ids = np.concatenate([np.asarray(x, np.int32) for _, x in items])
        m.buf.tokens[:total].copy_to_device(ids, stream=self.stream)
        m.forward_packed([(v, len(x)) for v, (_, x) in zip(views, items)])
        for s, v in zip(slots, views):
            self.states.adopt(s, v)
        t1 = time.perf_counter()
        picks = self._read_picks(len(items))
        # host seconds enqueueing the forward, then its picks and the wait for the GPU (Scheduler.summary)
        self.last_pack_seconds = (t1 - t0, time.perf_counter() - t1)
        return picks

    def _start_prefill(self, items: list[tuple[int, list[int]]]) -> None:
        """Check each (slot, ids) fits its slot and no step is in flight; then buf.tokens is the prompts'."""
        for s, ids in items:
            self._check_slot(s)
            if not 1 <= len(ids) <= self.max_seq - 1 - self.states.host_pos[s]:
                raise ValueError(f"{len(ids)} tokens after {self.states.host_pos[s]} in a slot of {self.max_seq}")
        if self._pending is not None:
            raise RuntimeError("prefill between launch() and collect(): collect the step first")
        self._forget_rows()
        self.model.tokens_owner = None          # buf.tokens now holds the prompts' tokens

    def _read_picks(self, n: int) -> list[int]:
        """The greedy picks of logits rows 0..n-1 (a prefill's or a packed prefill's), read back."""
        for j in range(n):
            argmax(self.model.logits[j], self._picks[j:j + 1], self._ws[j], stream=self.stream)
        self._picks[:n].copy_to_host(self._host_out[:n], stream=self.stream)
        self.stream.synchronize()
        return self._host_out[:n].tolist()

    def _check_slot(self, s: int) -> None:
        if not 0 <= s < self.n_slots:
            raise ValueError(f"slot {s} outside [0, {self.n_slots})")

    def step(self, slots: list[int], tokens: list[int]) -> list[int]:
        """One token for each sequence in slots (distinct), tokens[i] the input of slots[i]; returns each one's
        greedy next token."""
        self.launch(slots, tokens)
        return self.collect()

    def launch(self, slots: list[int], tokens: list[int]) -> None:
        """step()'s first half: the step enqueued, its picks on their way to pinned memory; collect() waits.
        Host work per step is what makes a batched step slower than the runner's one-sequence graph, so a step
        fed the picks of the step before, over the same slots, uploads nothing: its rows' positions were
        advanced on the device and the picks are where the embedding reads them (buf.tokens, unless another
        user of the model's buffers wrote them since: model.tokens_owner)."""
        n = len(slots)
        if n != len(tokens) or n == 0:
            raise ValueError(f"{n} slots and {len(tokens)} tokens")
        full = [s for s in slots if not 0 <= s < self.n_slots or self.states.host_pos[s] + 1 > self.max_seq]
        if full:
            raise ValueError(f"slots {full}: outside [0, {self.n_slots}) or at their {self.max_seq} tokens")
        b = self.bucket(n)
        key = (b, tuple(slots))
        if not (key == self._fed_key and self.model.tokens_owner is self and list(tokens) == self._fed_picks):
            self._host_in[:n] = tokens
            self._host_in[n:b] = 0
            self._tokens_dev[b].copy_to_device(self._host_in[:b], stream=self.stream)
        self._enqueue(b, slots, set_rows=key != self._rows_key)
        self._rows_key = key if n == b else None            # pad rows: their positions are put back each step
        self.model.tokens_owner = self
        self._tokens_dev[b].copy_to_host(self._host_out[:b], stream=self.stream)
        self._pending = (key, n)

    def collect(self) -> list[int]:
        """The picks of the step launch() enqueued, once it is done."""
        self.stream.synchronize()
        (key, n), self._pending = self._pending, None
        picks = self._host_out[:n].tolist()
        self._fed_key, self._fed_picks = key, picks
        return picks

    def _forget_rows(self) -> None:
        """A slot's state or buf.tokens changed outside a step: the next step sets its rows and tokens."""
        self._rows_key = self._fed_key = None

    def timed_steps(self, slots: list[int], first: list[int], n_steps: int) -> float:
        """Seconds of n_steps steps fed with their own picks (each read back before the next, as a server
        would), between events on the stream."""
        start, stop = cuda.event(), cuda.event()
        start.record(self.stream)
        toks = list(first)
        for _ in range(n_steps):
            toks = self.step(slots, toks)
        stop.record(self.stream)
        stop.synchronize()
        return cuda.event_elapsed_time(start, stop) / 1e3

    # -- the step's launches ---------------------------------------------------------------------------
    def _kernels(self, b: int) -> None:
        m, rows = self.model, self.states.rows(b)
        m.forward(b, rows, logits_rows=b)
        for r in range(b):                              # each row's pick, where the next step embeds it
            argmax(m.logits[r], m.buf.tokens[r:r + 1], self._ws[r], stream=self.stream)

    def _enqueue(self, b: int, slots: list[int], set_rows: bool) -> None:
        """Bucket b's step over slots (the rest of its rows on the spare slot): the graph replayed, captured
        the first time after one eager run (the simulator has no graphs: there it runs eagerly). set_rows:
        the slot table and positions uploaded (else they are the last step's, advanced on the device)."""
        rows = self.states.rows(b)
        if set_rows:
            rows.set_rows(slots, pad=self.pad)
        pos = list(self.states.host_pos)
        if SIMULATOR or b not in self._graphs and not getattr(rows, "warm", False):
            self._kernels(b)                             # forward counts the active slots itself
            rows.warm = True
        else:
            graph = self._graphs.get(b)
            if graph is None:
                graph = self._graphs[b] = CudaGraph(self.stream)
                with graph.capture(), programmatic_launches(self.pdl):    # records only: nothing runs
                    self._kernels(b)
                self.states.host_pos[:] = pos            # the capture's forward counted; the replay below counts
            graph.launch()
            for s in slots:
                self.states.host_pos[s] += 1
        self.states.host_pos[self.pad] = 0
