"""CUDA runner: one sequence on the numba-kernel model, decode replayed from a CUDA graph.

At load the weights are repacked and uploaded, every kernel is compiled by a short warm-up forward on a
scratch sequence (reported as ``compile_seconds``), and the decode step — forward of one token, greedy
argmax written straight into the token buffer the next step's embedding gather reads — is captured once as
a CUDA graph. A replay then costs ~1 µs per kernel instead of a 20-35 µs numba launch each.

Prefill chunks (``prefill_graphs``, on by default): a chunk length runs eagerly the first time it is seen
(its kernels compile then), is captured as a CUDA graph the second time and replayed from then on
(PREFILL_GRAPHS lengths are kept, the least recently used dropped). At a 512-token prompt the ~500 Python
launches of one forward take longer than the GPU's work; replayed, the GPU sets the pace. Long prompts go
in chunks of prefill_chunk tokens, so every full chunk after the second is a replay; a rest of at most
SPLIT_MAX tokens goes in at most two pieces (chunk_lengths), lengths that recur from prompt to prompt. A
capture that fails (the driver refuses an operation inside it) leaves that length eager, with a notice on
stderr.
"""
from __future__ import annotations

import sys
import time
from typing import Iterator

import numpy as np

from ninfer_numba.config import EngineConfig
from ninfer_numba.kernels.numba_env import SIMULATOR, check_numba_cuda, cuda
from ninfer_numba.kernels.sample.device import N_PARAMS, SampleWorkspace, argmax, pack_sample_params, sample, update_counts
from ninfer_numba.kernels.sample.logprobs import REC_LEN, LogprobWorkspace, record_to_host, token_logprobs
from ninfer_numba.model.gpu_weights import GpuWeights
from ninfer_numba.engine.cache import SequenceState
from ninfer_numba.engine.snapshot import CudaSnapshot
from ninfer_numba.model.qwen35 import Qwen35Gpu
from ninfer_numba.model.weights import ModelWeights
from ninfer_numba.engine.graphs import CudaGraph
from ninfer_numba.kernels.pdl import programmatic_launches

PREFILL_GRAPHS = 64                # prefill chunk lengths (per state) kept as captured graphs
SPLIT_MAX = 256                    # a prompt's rest up to this many tokens goes in recurring pieces
SPLIT_STEP = 16                    # pieces: a multiple of this, then what is left below it


def chunk_lengths(n: int, chunk: int, split: bool = True) -> list[int]:
    """The forwards an n-token prefill runs: whole chunks, then the rest. With split, a rest of at most
    SPLIT_MAX tokens goes in two pieces, the largest multiple of SPLIT_STEP and what is left below it, lengths
    that recur from prompt to prompt and so replay from captured graphs: a short forward run eagerly is bound
    by its ~400 numba launches (~55-65 ms on the 9B, H200), a replay by the GPU, whose floor is the weight
    read (9B, 2026-12-03: 9.3 ms for 2 tokens, 14.1 for 128, 16.0 for 256; benchmarks/NOTES.md, Session 18),
    so fewer pieces beat shorter ones (power-of-two pieces, 128 + 16 + 6 for a rest of 150, cost ~33 ms where
    144 + 6 costs ~24). A longer rest runs as one forward, its GPU work hiding the launches."""
    out = [chunk] * (n // chunk)
    rest = n - chunk * len(out)
    if not split or rest > SPLIT_MAX:
        return out + ([rest] if rest else [])
    whole = rest - rest % SPLIT_STEP
    return out + [p for p in (whole, rest - whole) if p]


def piece_lengths() -> list[int]:
    """Every length chunk_lengths cuts a short rest into: the multiples of SPLIT_STEP up to SPLIT_MAX, and 1
    to SPLIT_STEP - 1 (warm_prefill captures them all)."""
    return list(range(SPLIT_STEP, SPLIT_MAX + 1, SPLIT_STEP)) + list(range(1, SPLIT_STEP))


class CudaRunner:
    supports_device_sampling = True
    supports_device_logprobs = True        # logprobs records computed after each device pick (run_ahead etc.)

    def __init__(self, weights: ModelWeights, engine: EngineConfig, *, log=None) -> None:
        check_numba_cuda()
        cuda.select_device(engine.device)
        self.engine = engine
        self.stream = cuda.stream()
        self.gw = GpuWeights(weights, log=log)
        self.model = Qwen35Gpu(self.gw, engine, self.stream)
        self.config = weights.config
        self.max_seq = engine.max_seq
        self._host_tok = cuda.pinned_array(1, np.int32)
        # run_ahead: two pinned words and events, the token of step n lands in slot n % 2
        self._ahead_tok = [cuda.pinned_array(1, np.int32) for _ in range(2)]
        self._ahead_done = [cuda.event() if SIMULATOR else cuda.event(timing=False) for _ in range(2)]  # sim: no kwargs
        self.sample_ws = SampleWorkspace(self.config.n_vocab, stream=self.stream)
        self._host_mask = cuda.pinned_array(self.sample_ws.mask.shape[0], np.int32)   # staging of a grammar mask
        self.lp_ws = LogprobWorkspace(self.config.n_vocab, stream=self.stream)
        self._ahead_rec = [cuda.pinned_array(REC_LEN, np.float64) for _ in range(2)]   # run_ahead's records
        self._lp_n = 0                          # alternatives per token of the current logprobs request
        self._last_rec = self._ahead_rec[0]     # the record of the last pick made with logprobs
        self.sample_params = cuda.to_device(np.zeros(N_PARAMS, np.float64), stream=self.stream)  # [N_PARAMS]
        self.penalty_counts = cuda.to_device(np.zeros(self.config.n_vocab, np.int32), stream=self.stream)  # [V]
        self._prefill_graphs: dict[tuple, CudaGraph] = {}       # (state, t, logits rows) -> graph, LRU order
        self._prefill_seen: set[tuple] = set()
        self._no_graph: set[tuple] = set()                     # lengths whose capture failed: always eager
        t0 = time.perf_counter()
        scratch = self.model.new_state(8)
        scratch.reset(self.stream)
        self._run_tokens(np.array([1, 2], np.int32), scratch)       # prefill path (t > 1)
        self._run_tokens(np.array([3], np.int32), scratch)          # decode path (t == 1)
        self._pick_kernels(sampled=False)
        # every sampler kernel compiles here: a draw with all truncations on runs each select level
        self.sample_params.copy_to_device(pack_sample_params(1.0, 40, 0.9, 0.01, seed=0), stream=self.stream)
        self._pick_kernels(sampled=True, logprobs=True)
        self.stream.synchronize()
        del scratch
        self.state = self.model.new_state(self.max_seq)
        self.state.reset(self.stream)
        # the CUDA simulator has no graphs: there the "replay" runs the same launches eagerly
        self._graphs = {}                     # (sampled, logprobs) -> the decode step's graph
        for sampled in ((False, True) if not SIMULATOR else ()):
            self._graphs[sampled, False] = CudaGraph(self.stream)
            with self._graphs[sampled, False].capture(), programmatic_launches(self.engine.pdl):
                self._decode_step_kernels(sampled)
        self.stream.synchronize()
        self._prefill_seen.clear()                             # the scratch state's lengths are not the real one's
        self.compile_seconds = time.perf_counter() - t0

    # -- building blocks -------------------------------------------------------------------------------
    def _pick_kernels(self, sampled: bool, logprobs: bool = False) -> None:
        """logits[0] -> tokens[0], where the next step's embedding gather reads it; with logprobs, the chosen
        token's record into lp_ws.rec (kernels/sample/logprobs.py)."""
        logits, tok = self.model.logits[0], self.model.buf.tokens[:1]
        if sampled:
            sample(logits, self.penalty_counts, self.sample_params, tok, self.sample_ws, stream=self.stream)
            update_counts(self.penalty_counts, tok, stream=self.stream)
        else:
            argmax(logits, tok, self.sample_ws, stream=self.stream)
        if logprobs:
            token_logprobs(logits, tok, self.lp_ws, stream=self.stream)

    def _decode_step_kernels(self, sampled: bool, logprobs: bool = False) -> None:
        """One token: forward, then the choice written into tokens[0] so the next replay embeds it."""
        self.model.forward(1, self.state)
        self._pick_kernels(sampled, logprobs)

    def _replay(self, sampled: bool = False, logprobs: bool = False) -> None:
        """One decode step, its position counted: a graph replay (the captured forward's own count ran once,
        at capture), or under the CUDA simulator, which has no graphs, the same launches eagerly (forward
        counts the position itself). The logprobs variants are captured the first time they are asked for."""
        self._launch_captured((sampled, logprobs), lambda: self._decode_step_kernels(sampled, logprobs))
        if not SIMULATOR:
            self.state.host_pos += 1

    def _launch_captured(self, key, enqueue) -> None:
        """enqueue()'s launches replayed from the graph kept under key (captured the first time); under the
        simulator, which has no graphs, run eagerly. A captured forward counted the position once, at capture:
        the host count is put back, and the caller counts each replay."""
        self.model.tokens_owner = self
        if SIMULATOR:
            enqueue()
            return
        graph = self._graphs.get(key)
        if graph is None:
            pos = self.state.host_pos
            graph = self._graphs[key] = CudaGraph(self.stream)
            with graph.capture(), programmatic_launches(self.engine.pdl):    # records only; nothing runs yet
                enqueue()
            self.state.host_pos = pos
        graph.launch()

    def _run_tokens(self, ids: np.ndarray, st: SequenceState, on_chunk=None, **taps) -> list[int]:
        """Eager forward of ids in chunks of at most prefill_chunk tokens; last row's logits in logits[0].
        taps (tap, act_tap): passed to each chunk's forward (model/qwen35.py), for the checks against the
        reference; on_chunk(n): called after each chunk with its logits in logits[:n] (all its rows).
        Returns the chunk lengths."""
        chunk = min(self.model.buf.t_max, self.model.logits.shape[0]) if on_chunk else self.model.buf.t_max
        lengths = chunk_lengths(len(ids), chunk, split=self.engine.prefill_graphs)   # taps or not: the same sums
        s = 0
        for n in lengths:
            part = np.ascontiguousarray(ids[s:s + n], dtype=np.int32)
            s += n
            self.model.buf.tokens[:n].copy_to_device(part, stream=self.stream)
            self.model.tokens_owner = self
            self._forward_chunk(n, st, n if on_chunk else 1, taps)
            if on_chunk:
                on_chunk(n)
        return lengths

    def _forward_chunk(self, t: int, st: SequenceState, logits_rows: int, taps: dict) -> None:
        """forward(t) of the tokens in buf.tokens[:t]: eagerly, or from a captured graph when this length
        was seen before (module docstring). Tapped forwards always run eagerly."""
        key = (id(st), t, logits_rows)
        if taps or SIMULATOR or not self.engine.prefill_graphs or key in self._no_graph:
            self.model.forward(t, st, logits_rows=logits_rows, **taps)
            return
        graph = self._prefill_graphs.pop(key, None)
        if graph is None and key not in self._prefill_seen:
            self._prefill_seen.add(key)
            self.model.forward(t, st, logits_rows=logits_rows)
            return
        if graph is None:
            pos = st.host_pos
            graph = CudaGraph(self.stream)
            try:
                with graph.capture():                          # records only; nothing runs yet
                    self.model.forward(t, st, logits_rows=logits_rows)
            except Exception as e:                             # this length stays eager from now on
                st.host_pos = pos
                self._no_graph.add(key)
                print(f"ninfer: prefill of {t} tokens could not be captured as a CUDA graph ({e}); "
                      "it runs eagerly", file=sys.stderr, flush=True)
                self.model.forward(t, st, logits_rows=logits_rows)
                return
            st.host_pos = pos
            if len(self._prefill_graphs) >= PREFILL_GRAPHS:
                self._prefill_graphs.pop(next(iter(self._prefill_graphs))).close()
        self._prefill_graphs[key] = graph
        graph.launch()
        st.host_pos += t

    def _set_token(self, token: int) -> None:
        """The token the next replay embeds, through the pinned staging word."""
        self._check_room(1)
        self._host_tok[0] = token
        self.model.buf.tokens[:1].copy_to_device(self._host_tok, stream=self.stream)
        self.model.tokens_owner = self

    def _read_token(self, with_record: bool = False) -> int:
        """The picked token (and, with_record, its logprobs record into _last_rec), after a sync."""
        self.model.buf.tokens[:1].copy_to_host(self._host_tok, stream=self.stream)
        if with_record:
            self.lp_ws.rec.copy_to_host(self._ahead_rec[0], stream=self.stream)
            self._last_rec = self._ahead_rec[0]
        self.stream.synchronize()
        return int(self._host_tok[0])

    def _step(self) -> int:
        """One greedy replay; the token it wrote into tokens[0] is read back (4 bytes) and returned."""
        self._replay()
        return self._read_token()

    def _check_room(self, n: int, st: SequenceState | None = None) -> None:
        st = st or self.state
        if st.host_pos + n > st.max_seq:
            raise ValueError(f"context overflow: {st.host_pos} + {n} tokens > max_seq {st.max_seq}")

    # -- runner protocol (engine/llm.py) ---------------------------------------------------------------
    @property
    def gemm_path(self) -> str:
        return self.model.gemm_path

    def reset(self) -> None:
        self.state.reset(self.stream)

    def fill_random(self, n: int, seed: int = 0) -> None:
        """The sequence at depth n without a prefill (SequenceState.fill_random): for timing at depth."""
        self.state.fill_random(n, self.stream, seed)

    def snapshot(self) -> CudaSnapshot:
        """The state as it stands once the enqueued work is done (copies ordered on the runner's stream)."""
        return CudaSnapshot(self.state, self.stream)

    def restore(self, snap: CudaSnapshot) -> None:
        snap.restore_into(self.state, self.stream)

    @property
    def position(self) -> int:
        """Tokens the state holds once the enqueued work is done (run_ahead's step in flight included)."""
        return self.state.host_pos

    def run_on(self, ids: list[int], st: SequenceState) -> None:
        """ids run after what st holds, in the chunks and pieces of chunk_lengths, replayed from graphs kept
        for st (the batched decoder's staging state); the last row's logits in model.logits[0]."""
        self._check_room(len(ids), st)
        self._run_tokens(np.asarray(ids, np.int32), st)

    def warm_prefill(self, st: SequenceState | None = None) -> float:
        """Every piece length of chunk_lengths (piece_lengths) run twice on st (default: the runner's own
        state), eagerly and then captured, so a short prompt or a chat turn's rest replays from its first
        time; st is empty afterwards. A server calls this once at start (server/worker.py): 31 lengths, ~3 s.
        Returns the wall seconds."""
        st = st or self.state
        if SIMULATOR or not self.engine.prefill_graphs:
            return 0.0
        t0 = time.perf_counter()
        lengths = [n for n in piece_lengths() if n <= min(self.model.buf.t_max, st.max_seq)]
        zeros = np.zeros(max(lengths), np.int32)                 # token 0: what runs does not matter
        for n in lengths:
            for _ in range(2):
                st.reset(self.stream)
                self.model.buf.tokens[:n].copy_to_device(zeros[:n], stream=self.stream)
                self.model.tokens_owner = self
                self._forward_chunk(n, st, 1, {})
        st.reset(self.stream)
        self.stream.synchronize()
        return time.perf_counter() - t0

    def prefill(self, ids: list[int]) -> np.ndarray:
        self._check_room(len(ids))
        self._run_tokens(np.asarray(ids, np.int32), self.state)
        return self.model.logits[0].copy_to_host(stream=self.stream)

    def decode(self, token: int) -> np.ndarray:
        self._set_token(token)
        self._replay()
        return self.model.logits[0].copy_to_host(stream=self.stream)

    def decode_greedy(self, token: int) -> int:
        """One graph replay; only the 4-byte token crosses to the host."""
        self._set_token(token)
        return self._step()

    def start_logprobs(self, n_top: int) -> None:
        """Records of the next picks list n_top alternatives (a request's logprobs setting)."""
        self._lp_n = n_top
        self.lp_ws.n_top.copy_to_device(np.array([n_top], np.int32), stream=self.stream)

    def last_logprob(self, token: int):
        """engine.sampling.TokenLogprob of the token just returned by a pick with logprobs."""
        return record_to_host(self._last_rec, token, self._lp_n)

    def run_ahead(self, first: int, sampled: bool = False, logprobs: bool = False) -> Iterator[int]:
        """Decode from ``first``, each step's input being the previous step's device choice, with one step
        always in flight: step n + 1 is enqueued before the token of step n is waited for and yielded, so the
        caller's per-token host work (detokenizing, streaming) overlaps the GPU instead of adding to it.
        Closing the generator leaves at most one extra step to finish, which the next reset orders after.
        Ends only when the context is full."""
        self._set_token(first)

        def enqueue(n: int) -> None:
            self._replay(sampled, logprobs)
            self.model.buf.tokens[:1].copy_to_host(self._ahead_tok[n % 2], stream=self.stream)
            if logprobs:
                self.lp_ws.rec.copy_to_host(self._ahead_rec[n % 2], stream=self.stream)
            self._ahead_done[n % 2].record(self.stream)

        enqueue(0)
        n = 0
        while True:
            more = self.state.host_pos < self.max_seq
            if more:
                enqueue(n + 1)
            self._ahead_done[n % 2].synchronize()
            self._last_rec = self._ahead_rec[n % 2]    # read by last_logprob before the slot is reused
            yield int(self._ahead_tok[n % 2][0])
            if not more:
                return
            n += 1

    def start_sampling(self, window: np.ndarray, params: dict) -> None:
        """Load one request's penalty window ([V] int32 counts) and sampler settings (pack_sample_params
        keywords, draw counter included) for prefill_sampled and run_ahead(sampled=True)."""
        self.penalty_counts.copy_to_device(np.ascontiguousarray(window, np.int32), stream=self.stream)
        self.sample_params.copy_to_device(pack_sample_params(**params), stream=self.stream)

    def prefill_sampled(self, ids: list[int], mask=None, logprobs: bool = False, sampled: bool = True) -> int:
        """Run the prompt and draw the first token on the device (under ``mask``, see decode_sampled), or with
        sampled=False take the device argmax; with logprobs its record is then read by last_logprob."""
        self._check_room(len(ids))
        self._run_tokens(np.asarray(ids, np.int32), self.state)
        self._load_mask(mask() if callable(mask) else mask)      # a function runs while the prompt does
        self._pick_kernels(sampled=sampled, logprobs=logprobs)
        return self._read_token(logprobs)

    def decode_sampled(self, token: int, mask=None, logprobs: bool = False) -> int:
        """One sampled step from ``token``; the drawn token is read back. mask: a grammar's allowed set as
        TokenConstraint.bitmask packs it (int32 [ceil(V/32)]), drawn under when the sampler settings were
        loaded with masked=True; or a function returning it, called while the step's forward runs (two
        replays, forward then pick: the grammar's host work overlaps the GPU instead of adding to each
        token). One step at a time: the next mask needs this token."""
        self._set_token(token)
        if not callable(mask):
            self._load_mask(mask)
            self._replay(sampled=True, logprobs=logprobs)
            return self._read_token(logprobs)
        self._launch_captured("forward", lambda: self.model.forward(1, self.state))
        if not SIMULATOR:
            self.state.host_pos += 1
        self._load_mask(mask())
        self._launch_captured(("pick", logprobs), lambda: self._pick_kernels(sampled=True, logprobs=logprobs))
        return self._read_token(logprobs)

    def _load_mask(self, mask: np.ndarray | None) -> None:
        if mask is not None:
            self._host_mask[:] = mask                  # the previous copy is done: its token was read back
            self.sample_ws.mask.copy_to_device(self._host_mask, stream=self.stream)

    def run_tapped(self, ids: list[int], *, on_chunk=None, tap=None, act_tap=None) -> list[int]:
        """Eager forward of ids on the sequence's state with model/qwen35.py forward's taps (tap(i, x),
        act_tap(i, point, q, d)), for the checks against the reference (benchmarks/e2e/layer_check.py);
        on_chunk(n) after each chunk, its logits in model.logits[:n]. Returns the chunk lengths."""
        self._check_room(len(ids))
        taps = {k: v for k, v in (("tap", tap), ("act_tap", act_tap)) if v is not None}
        return self._run_tokens(np.asarray(ids, np.int32), self.state, on_chunk, **taps)

    def all_logits(self, ids: list[int]) -> np.ndarray:
        """Logits after every position, computed chunk by chunk (all rows of each chunk)."""
        self._check_room(len(ids))
        rows = []
        self._run_tokens(np.asarray(ids, np.int32), self.state,
                         on_chunk=lambda n: rows.append(self.model.logits[:n].copy_to_host(stream=self.stream)))
        return np.concatenate(rows)

    def timed_prefill(self, ids: list[int]) -> float:
        self._check_room(len(ids))
        arr = np.asarray(ids, np.int32)
        start, stop = cuda.event(), cuda.event()
        start.record(self.stream)
        self._run_tokens(arr, self.state)
        stop.record(self.stream)
        stop.synchronize()
        return cuda.event_elapsed_time(start, stop) / 1e3

    def timed_decode(self, first: int, n_gen: int) -> float:
        """n_gen graph replays; the host reads each sampled token before the next, as llama-bench does."""
        self._check_room(n_gen)
        self._set_token(first)
        start, stop = cuda.event(), cuda.event()
        start.record(self.stream)
        for _ in range(n_gen):
            self._step()
        stop.record(self.stream)
        stop.synchronize()
        return cuda.event_elapsed_time(start, stop) / 1e3
