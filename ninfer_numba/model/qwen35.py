"""The qwen35 forward pass on the GPU, from numba kernels.

One layer, in launches (decode, T = 1; prefill runs the same sequence with GEMMs and the chunked kernels):
  rmsnorm_quant(x, attn_norm) → int8 act → GEMV fused input projection → proj
  GDN:  gdn_decode_step(proj) → raw o → gated_rmsnorm_quant(o, z) → int8 act (prefill: gdn_prefill's raw o →
        gated_rmsnorm_f16, or _quant without the W8A16 GEMM)
  attention: qk_norm_rope_store → attention_decode(+gate) → y → quantize_rows(y) → int8 act
  GEMV out-projection of the act accumulated into x (the residual add is the GEMV's epilogue)
  rmsnorm_quant(x, post_norm) → GEMV gate|up → silu_mul_quant → GEMV down accumulated into x
Prefill on sm_90 (the W8A16 GEMM, ``gemm="w8a16"``, the default there) makes float16 activations instead of
int8 (rmsnorm_f16, to_f16, silu_mul_f16, in the GEMM's fragment order) and multiplies them with the Q8_0
weights dequantized to float16 inside the GEMM; elsewhere prefill quantizes to int8 like decode.
Every per-step scalar (position, KV length, the token) lives in a device buffer, so the decode step is
captured once as a CUDA graph and replayed (engine/cuda_runner.py). The token count decides the path:
``uses_f16_activations(t)`` (which activations a matmul of t rows takes) and the t == 1 branches of the
mixers. ``forward_packed`` runs several sequences' prompts in one pass of the same layer loop: the matmuls
over all their rows, the mixers per sequence on its rows and state (``forward`` is the one-sequence case).
"""
from __future__ import annotations

import numpy as np

from ninfer_numba.config import EngineConfig, ModelConfig
from ninfer_numba.engine.cache import SequenceState, SlotRows, SlotStates
from ninfer_numba.kernels import position
from ninfer_numba.kernels.q8.act_f16 import gated_rmsnorm_f16, rmsnorm_f16, silu_mul_f16, to_f16
from ninfer_numba.kernels.embed import embed_gather_q8
from ninfer_numba.kernels.flash_attn.decode import alloc_decode_workspace, attention_decode
from ninfer_numba.kernels.flash_attn.prefill import attention_prefill
from ninfer_numba.kernels.flash_attn.prefill_mma import attention_prefill_mma, supports_shape
from ninfer_numba.kernels.flash_attn.rope import NORM_TPB, qk_norm_rope_store
from ninfer_numba.kernels.gdn.chunk import gdn_prefill, shared_workspace
from ninfer_numba.kernels.gdn.recurrent import gdn_decode_step, make_decode_sync
from ninfer_numba.kernels.q8.gemm import gemm_q8
from ninfer_numba.kernels.q8.gemm_plan import split_ws_floats
from ninfer_numba.kernels.q8.gemm_w8a16 import gemm_w8a16
from ninfer_numba.kernels.q8.gemv import gemv_q8
from ninfer_numba.kernels.q8.gemv_rows import MAX_ROWS, gemv_rows_q8
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.kvq.decode import KvqDecodeWorkspace, kvq_attention_decode, pick_partial
from ninfer_numba.kernels.kvq.prefill import kvq_attention_prefill
from ninfer_numba.kernels.kvq.ref import KV_TYPES, role_seeds
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, sm_count
from ninfer_numba.kernels.q8.quant_act import gated_rmsnorm_quant, quantize_rows, rmsnorm_quant, silu_mul_quant
from ninfer_numba.model.gpu_weights import GpuWeights, Q8Matrix


KVQ_SPLITS = 128                  # split-K blocks per KV head of the coded-cache decode attention
# threads of the QK-norm + RoPE blocks of a one-token forward (a block per head, d = 256): at 9B shapes on
# the H200 256 took 3.7 µs a launch with a coded cache against 5.2 at 64, and 2.9 against 3.5 with f16
# (bench_attn --only rope); prefills keep the kernel's default
ROPE_STEP_THREADS = 256


class _Views:
    """Views of long-lived device arrays, each made once: a DeviceNDArray slice or reshape costs ~10-30 µs of
    Python, and an eager forward takes a dozen per layer (per part too in a packed forward). Keyed by the
    base's id and the view's extent; an entry is used only while its base is that very object (an id may be
    reused once a short-lived base is gone); cleared when it holds ``limit`` views (eager forwards of ever
    new lengths)."""

    def __init__(self, limit: int = 4096) -> None:
        self._views: dict = {}
        self.limit = limit

    def get(self, base, extent: tuple, make):
        key = (id(base),) + extent
        hit = self._views.get(key)
        if hit is not None and hit[0] is base:
            return hit[1]
        if len(self._views) >= self.limit:
            self._views.clear()
        view = make()
        self._views[key] = (base, view)
        return view


class Buffers:
    """Activations for up to ``t_max`` tokens per forward, allocated once (nothing allocates per step)."""

    def __init__(self, c: ModelConfig, t_max: int, stream) -> None:
        e, f = c.n_embd, c.n_ff
        p_gdn = c.conv_dim + c.ssm_inner + 2 * c.ssm_heads
        p_attn = 2 * c.head_dim * c.n_head + 2 * c.head_dim * c.n_head_kv
        k_max = max(e, f, c.ssm_inner, c.head_dim * c.n_head)
        dev = lambda shape, dt: cuda.device_array(shape, dt, stream=stream)   # noqa: E731
        self.t_max = t_max
        self.tokens = dev(t_max, np.int32)                      # [T] token ids of this forward
        self.x = dev((t_max * e,), np.float32)                  # [T, E] residual stream (viewed per use)
        self.xq = dev((t_max * k_max,), np.int8)                # [T, K] int8 activations (viewed per use)
        self.xs = dev((t_max * k_max // 32,), np.float32)       # [T, K/32] their block scales
        self.xh = dev((t_max * k_max,), np.float16)             # [T, K] f16 activations, fragment order
        self.proj = dev((t_max * max(p_gdn, p_attn, 2 * f),), np.float32)   # [T, P] projection outputs
        self.y = dev((t_max * max(c.ssm_inner, c.head_dim * c.n_head),), np.float32)  # [T, mixer width]
        self.q = dev((t_max, c.n_head, c.head_dim), np.float16)             # [T, H, d] rotated queries
        self.p_gdn, self.p_attn = p_gdn, p_attn
        self._views = _Views()

    def act(self, t: int, k: int):
        """int8 activations [t, k] and scales [t, k/32] as views of the shared buffers."""
        return self.mat(self.xq, t, k), self.mat(self.xs, t, k // 32)

    def act_f16(self, t: int, k: int):
        """float16 activations [t, k] (fragment order) as a view of the shared buffer."""
        return self.mat(self.xh, t, k)

    def mat(self, buf, t: int, n: int):
        """A flat buffer's first t·n elements as [t, n]."""
        return self._views.get(buf, (t, n), lambda: buf[: t * n].reshape(t, n))

    def queries(self, t: int):
        """The rotated queries of t tokens, [t, H, d]."""
        return self._views.get(self.q, (t,), lambda: self.q[:t])

    def part(self, a, r0: int, n: int, t: int):
        """Rows [r0, r0 + n) of a [t, ...] view (the view itself when that is all of it): one part of a packed
        forward."""
        return a if r0 == 0 and n == t else self._views.get(a, ("rows", r0, n), lambda: a[r0:r0 + n])


class Qwen35Gpu:
    def __init__(self, weights: GpuWeights, engine: EngineConfig, stream) -> None:
        self.w = weights
        self.c = c = weights.config
        self.engine = engine
        self._rows_step = False            # the forward running is a batched decode step (SlotStates)
        # who wrote buf.tokens last: the batched decoder feeds its picks back without an upload only while it
        # is still itself (engine/batched.py); any eager forward or runner graph replay takes it away
        self.tokens_owner = None
        self.stream = stream
        self.buf = Buffers(c, engine.prefill_chunk, stream)
        self.layer_range = range(weights.layers[0].index, weights.layers[-1].index + 1)
        rows = engine.prefill_chunk if engine.prefill_chunk * c.n_vocab * 4 <= 2 << 30 else 1
        self.logits = cuda.device_array((rows if weights.output is not None else 1, c.n_vocab), np.float32,
                                        stream=stream)
        self.next_token = cuda.device_array(1, np.int32, stream=stream)
        self.attn_ws = alloc_decode_workspace(c.n_head, c.head_dim)
        self.gdn_sync = make_decode_sync(c.ssm_groups, stream=stream)
        self.gdn_ws = shared_workspace(engine.prefill_chunk, c.ssm_groups, c.ssm_heads, c.ssm_state, stream)
        # fp16 tensor-core prefill attention on sm_80+ (20-30x the float32 kernel); float32 kernel elsewhere
        cc = (0, 0) if SIMULATOR else cuda.get_current_device().compute_capability
        # prefill GEMM: W8A16 on sm_90 (wgmma), else int8 (gemm_q8 picks mma on sm_80+, dp4a below)
        self.gemm_path = ("w8a16" if cc >= (9, 0) else "auto") if engine.gemm == "auto" else engine.gemm
        if self.gemm_path == "w8a16" and not SIMULATOR and cc < (9, 0):
            raise ValueError(f"gemm='w8a16' needs an sm_90 GPU (wgmma); this one is sm_{cc[0]}{cc[1]}")
        # the W8A16 GEMM's split-K parts (short prompts: K split where one CTA per tile leaves SMs idle)
        self.split_ws = (cuda.device_array(split_ws_floats(sm_count()), np.float32, stream=stream)
                         if self.gemm_path == "w8a16" else None)
        self.prefill_attention = attention_prefill_mma if cc >= (8, 0) and supports_shape(
            c.n_head, c.n_head_kv, c.head_dim) else attention_prefill
        self.kv_type = engine.kv_type
        self.kvq_tables = {}               # layer -> (key tables, value tables) of a coded cache
        if self.kv_type in KV_TYPES:
            k_bits, v_bits = KV_TYPES[self.kv_type]
            for i in c.attention_layers:
                k_seed, v_seed = role_seeds(i)
                self.kvq_tables[i] = (KvqTables(c.head_dim, k_bits, k_seed, stream),
                                      KvqTables(c.head_dim, v_bits, v_seed, stream))
            self.kvq_ws = KvqDecodeWorkspace(c.n_head, c.head_dim, KVQ_SPLITS, stream)

    def new_state(self, max_seq: int) -> SequenceState:
        """A sequence's device memory in this model's KV format."""
        return SequenceState(self.c, max_seq, self.stream, self.kv_type, self.layer_range)

    def new_slots(self, n_slots: int, max_seq: int) -> SlotStates:
        """n_slots sequences' device memory for batched decode steps (f16 KV cache): forward(B, rows) with
        rows = slots.rows(B), B <= min(16, prefill_chunk), steps the slots set by rows.set_rows."""
        if self.kv_type != "f16":
            raise ValueError(f"batched decode runs on the f16 KV cache, not {self.kv_type!r}")
        return SlotStates(self.c, n_slots, max_seq, self.stream, self.layer_range)

    # -- activations and matmuls --------------------------------------------------------------------
    def uses_f16_activations(self, t: int) -> bool:
        """Whether the matmuls of a t-row forward take float16 activations (the W8A16 prefill GEMM); a batched
        decode step's rows stay int8 (gemv_rows_q8 reads each weight once for all of them)."""
        return t > 1 and self.gemm_path == "w8a16" and not self._rows_step

    def _norm_act(self, x, w, t: int):
        """RMSNorm of x [t, E] into the activation the next matmul takes: (xh, None) or (xq, xs)."""
        if self.uses_f16_activations(t):
            xh = self.buf.act_f16(t, x.shape[1])
            rmsnorm_f16(x, w, self.c.rms_eps, xh, stream=self.stream)
            return xh, None
        xq, xs = self.buf.act(t, x.shape[1])
        rmsnorm_quant(x, w, self.c.rms_eps, xq, xs, stream=self.stream)
        return xq, xs

    def _plain_act(self, y, t: int):
        """y [t, K] float32 (a mixer's output) as the activation of the next matmul."""
        if self.uses_f16_activations(t):
            yh = self.buf.act_f16(t, y.shape[1])
            to_f16(y, yh, stream=self.stream)
            return yh, None
        yq, ys = self.buf.act(t, y.shape[1])
        quantize_rows(y, yq, ys, stream=self.stream)
        return yq, ys

    def _silu_act(self, gu, t: int):
        """silu(gate) * up of gu [t, 2F] as the activation of the down projection."""
        f = gu.shape[1] // 2
        if self.uses_f16_activations(t):
            hh = self.buf.act_f16(t, f)
            silu_mul_f16(gu, hh, stream=self.stream)
            return hh, None
        hq, hs = self.buf.act(t, f)
        silu_mul_quant(gu, hq, hs, stream=self.stream)
        return hq, hs

    def _matmul(self, m: Q8Matrix, act, out, accumulate: bool = False) -> None:
        xq, xs = act
        if xs is None:
            gemm_w8a16(m.wq, m.ws, xq, out, accumulate=accumulate, split_ws=self.split_ws, stream=self.stream)
        elif xq.shape[0] == 1:
            gemv_q8(m.wq, m.ws, xq, xs, out.reshape(-1), accumulate=accumulate, stream=self.stream)
        elif self._rows_step:                       # one token of each of B sequences
            gemv_rows_q8(m.wq, m.ws, xq, xs, out, accumulate=accumulate, stream=self.stream)
        else:
            # int8 rows > 1 only when gemm_path is not w8a16 (then every such forward makes float16)
            gemm_q8(m.wq, m.ws, xq, xs, out, accumulate=accumulate, path=self.gemm_path, stream=self.stream)

    # -- one forward over the tokens already in buf.tokens[:t] ----------------------------------------
    def forward(self, t: int, st: SequenceState, *, logits_rows: int = 1, tap=None, act_tap=None) -> None:
        """Run t tokens (buf.tokens[:t]) at st.pos; the last ``logits_rows`` rows' logits land in self.logits.
        A shard's part (GpuWeights without the embedding) starts from the hidden state its caller put in buf.x
        [t, n_embd]; one without the head leaves its layers' output there.

        tap(i, x): called with the residual stream x [t, n_embd] (device) after the embedding (i = -1) and
        after each layer i, for layer-by-layer checks; act_tap(i, point, q, d): called with each activation a
        matmul consumes (device [rows, K] int8 and [rows, K/32] scales, or [rows, K] float16 in fragment
        order and None on the W8A16 path; points "mixer_in", "mixer_out", "ffn_in", "down_in", then
        i = n_layer, "head"). Eager forwards only (never under graph capture)."""
        b = self.buf
        # st a SlotRows: a batched decode step, row r one token of the sequence in slot st.slots[r]
        self._rows_step = isinstance(st, SlotRows)
        if self._rows_step and not (t == st.batch <= min(MAX_ROWS, b.t_max)):
            raise ValueError(f"a batched step of {t} rows over a {st.batch}-row batch (at most "
                             f"{min(MAX_ROWS, b.t_max)})")
        x = self._layers(t, [(st, 0, t)], tap, act_tap)
        if self.w.output is not None:
            self._head(x[t - logits_rows:], logits_rows, act_tap)
        self._advance([(st, 0, t)])

    def forward_packed(self, parts: list[tuple[SequenceState, int]]) -> None:
        """Several sequences' prompts in one forward: parts [(state, n)], their tokens one after another in
        buf.tokens[:sum n], each run at its state's position. Every matmul reads its weights once for all of
        them (a short prompt's forward is bound by that read: benchmarks/NOTES.md, Session 18); attention and
        the Gated DeltaNet mixer run per part on its rows and its state. Part j's last row's logits land in
        self.logits[j]."""
        self._rows_step = False
        rows, r0 = [], 0
        for st, n in parts:
            rows.append((st, r0, n))
            r0 += n
        t = r0
        if not (parts and all(n >= 1 for _, n in parts) and t <= self.buf.t_max
                and len(parts) <= self.logits.shape[0] and self.w.output is not None):
            raise ValueError(f"packed parts of {[n for _, n in parts]} tokens: each at least 1, at most "
                             f"{self.buf.t_max} in all, at most {self.logits.shape[0]} parts, a model with its head")
        x = self._layers(t, rows, None, None)
        last = self.buf.mat(self.buf.proj, len(parts), self.c.n_embd)       # [parts, E] each part's last row
        for j, (_, r, n) in enumerate(rows):
            last[j:j + 1].copy_to_device(x[r + n - 1:r + n], stream=self.stream)
        self._head(last, len(parts), None)
        self._advance(rows)

    def _layers(self, t: int, parts: list, tap, act_tap):
        """Embedding and every layer over buf.tokens[:t]; parts [(state, first row, rows)] (one, unless
        packed). Returns the residual stream x [t, E]."""
        self.tokens_owner = None
        seen = act_tap or (lambda i, point, q, d: None)
        c, b, s = self.c, self.buf, self.stream
        for st, _, n in parts:
            position.set_kv_len(st.pos, st.kv_len, 1 if self._rows_step else n, stream=s)
        x = b.mat(b.x, t, c.n_embd)
        if self.w.token_embd is not None:
            embed_gather_q8(self.w.token_embd.wq, self.w.token_embd.ws, b.tokens[:t], x, stream=s)
            if tap is not None:
                tap(-1, x)
        for L in self.w.layers:
            i = L.index
            act = self._norm_act(x, L.attn_norm, t)
            seen(i, "mixer_in", *act)
            if L.is_attention:
                act = self._plain_act(self._attention(L, t, parts, act), t)
            else:
                act = self._gdn(L, t, parts, act)
            seen(i, "mixer_out", *act)
            self._matmul(L.w_out, act, x, accumulate=True)
            act = self._norm_act(x, L.post_norm, t)
            seen(i, "ffn_in", *act)
            gu = b.mat(b.proj, t, 2 * c.n_ff)
            self._matmul(L.w_gate_up, act, gu)
            act = self._silu_act(gu, t)
            seen(i, "down_in", *act)
            self._matmul(L.w_down, act, x, accumulate=True)
            if tap is not None:
                tap(i, x)
        return x

    def _head(self, x, r: int, act_tap) -> None:
        """Logits of the r rows x [r, E] into self.logits[:r]."""
        act = self._norm_act(x, self.w.output_norm, r)
        if act_tap is not None:
            act_tap(self.c.n_layer, "head", *act)
        self._matmul(self.w.output, act, self.logits[:r])

    def _advance(self, parts: list) -> None:
        """Each part's position past the tokens it ran (a batched step's rows: one token each)."""
        for st, _, n in parts:
            position.advance(st.pos, 1 if self._rows_step else n, stream=self.stream)
            if self._rows_step:
                st.stepped()
            else:
                st.host_pos += n

    def _attention(self, L, t, parts, act):
        c, b, s = self.c, self.buf, self.stream
        proj = b.mat(b.proj, t, b.p_attn)
        self._matmul(L.w_in, act, proj)
        y = b.mat(b.y, t, c.n_head * c.head_dim)
        rows, q_all = self._rows_step, b.queries(t)
        for st, r0, n in parts:
            q, pj, yj = (b.part(a, r0, n, t) for a in (q_all, proj, y))
            qk_norm_rope_store(pj, L.small["q_norm"], L.small["k_norm"], st.pos, q, *self._kv_targets(L.index, st),
                               H=c.n_head, Hkv=c.n_head_kv, n_rot=c.n_rot, base=c.rope_base, eps=c.rms_eps,
                               slots=st.slots if rows else None, threads=ROPE_STEP_THREADS if t == 1 else NORM_TPB,
                               stream=s)
            if rows:
                attention_decode(q, st.k_cache[L.index], st.v_cache[L.index], st.kv_len, pj, yj, st.attn_ws,
                                 kv_heads=c.n_head_kv, stream=s)
            elif L.index in st.kvq:
                self._coded_attention(L.index, n, st, q, pj, yj)
            elif n == 1:
                attention_decode(q, st.k_cache[L.index], st.v_cache[L.index], st.kv_len, pj, yj.reshape(-1),
                                 self.attn_ws, stream=s)
            else:
                self.prefill_attention(q, st.k_cache[L.index], st.v_cache[L.index], st.pos, pj, yj, stream=s)
        return y

    def _kv_targets(self, i: int, st) -> tuple:
        """Where QK-norm + RoPE put layer i's new keys and values: its float16 caches, or a coded cache's
        roles (the rope kernel then codes them itself)."""
        if i not in st.kvq:
            return st.k_cache[i], st.v_cache[i]
        k_codes, k_norms, v_codes, v_norms = st.kvq[i]
        k_tab, v_tab = self.kvq_tables[i]
        return k_tab.role(k_codes, k_norms), v_tab.role(v_codes, v_norms)

    def _coded_attention(self, i, t, st, q, proj, y):
        """Attention over a coded cache (kernels/kvq), its t new rows coded already (_kv_targets): decode in
        the rotated domain, a prefill with the tensor-core kernel that decodes the codes tile by tile (both
        read codes only)."""
        s = self.stream
        k_codes, k_norms, v_codes, v_norms = st.kvq[i]
        k_tab, v_tab = self.kvq_tables[i]
        if t == 1:
            variant = pick_partial(self.engine.kvq_partial, k_tab.bits, v_tab.bits, k_codes.shape[1],
                                   self.c.n_head // self.c.n_head_kv)
            kvq_attention_decode(q[0], k_codes, k_norms, v_codes, v_norms, st.kv_len, k_tab, v_tab,
                                 y.reshape(-1), self.kvq_ws, stream=s, proj=proj, variant=variant)
        else:
            kvq_attention_prefill(q, k_codes, k_norms, v_codes, v_norms, st.pos, k_tab, v_tab, proj, y,
                                  stream=s)

    def _gdn(self, L, t, parts, act):
        c, b, s = self.c, self.buf, self.stream
        proj = b.mat(b.proj, t, b.p_gdn)
        self._matmul(L.w_in, act, proj)
        y = b.mat(b.y, t, c.ssm_inner)
        # raw o, then the gated norm fused into the kernel that makes the out-projection's activation
        for st, r0, n in parts:
            pj, yj = b.part(proj, r0, n, t), b.part(y, r0, n, t)
            args = (L.small["conv_w"], st.conv[L.index], L.small["ssm_a"], L.small["dt_bias"],
                    L.small["ssm_norm"], st.ssm[L.index])
            if self._rows_step:
                gdn_decode_step(pj, *args, yj, st.gdn_sync, c.ssm_groups, c.rms_eps, stream=s, normalize=False)
            elif n == 1:
                gdn_decode_step(pj.reshape(-1), *args, yj.reshape(-1), self.gdn_sync, c.ssm_groups, c.rms_eps,
                                stream=s, normalize=False)
            else:
                gdn_prefill(pj, *args, yj, c.ssm_groups, c.rms_eps, stream=s, ws=self.gdn_ws, normalize=False)
        if self.uses_f16_activations(t):
            yh = b.act_f16(t, y.shape[1])
            gated_rmsnorm_f16(y, proj, c.conv_dim, L.small["ssm_norm"], c.rms_eps, yh, stream=s)
            return yh, None
        yq, ys = b.act(t, y.shape[1])
        gated_rmsnorm_quant(y, proj, c.conv_dim, L.small["ssm_norm"], c.rms_eps, yq, ys, stream=s)
        return yq, ys
