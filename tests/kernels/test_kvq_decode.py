"""Decode attention over the 3/4-bit cache (kernels/kvq/decode.py) against kvq/ref.py's
attention_rotated_ref on the same codes: the kernel sums in float32 what the reference sums in float64, so
outputs agree to float32 rounding of O(L) terms (2e-5 of the output's scale here)."""
import os

import numpy as np
import pytest

from ninfer_numba.kernels.kvq import ref
from ninfer_numba.kernels.kvq.append import KvqTables
from ninfer_numba.kernels.kvq.decode import MMA_TILE, KvqDecodeWorkspace, chunk_tokens, kvq_attention_decode, mma_rows
from ninfer_numba.kernels.numba_env import SIMULATOR, cuda, gpu_available

needs_sim_or_gpu = pytest.mark.skipif(not (SIMULATOR or gpu_available()),
                                      reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
K_SEED, V_SEED = 11, 12
# the partial kernels: lanes own coordinates (decode.py), a lane per key token (decode_tokens.py), tensor
# cores (decode_mma.py)
VARIANTS = pytest.mark.parametrize("variant", ["lanes", "tokens", "mma"])
# the mma partial's operands are float16 (queries, levels, weights: 2^-11 relative each), the others' float32
ATOL = {"lanes": 2e-5, "tokens": 2e-5, "mma": 2e-3}


def check_decode(H, Hkv, d, L, max_seq, k_bits, v_bits, n_splits, rng, variant="lanes"):
    if variant == "mma":                  # it copies whole tiles of rows: engine/cache.py allocates multiples
        max_seq = mma_rows(max_seq)
    q = rng.standard_normal((H, d)).astype(np.float32) * 2
    k = rng.standard_normal((L, Hkv, d)).astype(np.float32) * rng.uniform(0.5, 3, (L, Hkv, 1))
    v = rng.standard_normal((L, Hkv, d)).astype(np.float32)
    kc, kn = ref.quantize(k, k_bits, K_SEED)
    vc, vn = ref.quantize(v, v_bits, V_SEED)

    def cache(codes, norms, bits):
        c = np.zeros((Hkv, max_seq, d * bits // 8), np.uint8)
        n = np.zeros((Hkv, max_seq), np.uint16)
        c[:, :L] = ref.pack(codes, bits).transpose(1, 0, 2)
        n[:, :L] = norms.view(np.uint16).T
        return cuda.to_device(c), cuda.to_device(n)
    k_codes, k_norms = cache(kc, kn, k_bits)
    v_codes, v_norms = cache(vc, vn, v_bits)
    out = cuda.to_device(np.zeros((H, d), np.float32))
    kvq_attention_decode(cuda.to_device(q), k_codes, k_norms, v_codes, v_norms,
                         cuda.to_device(np.array([L], np.int32)), KvqTables(d, k_bits, K_SEED),
                         KvqTables(d, v_bits, V_SEED), out, KvqDecodeWorkspace(H, d, n_splits), variant=variant)
    want = ref.attention_rotated_ref(q[None], kc, kn, vc, vn, np.array([L - 1]), k_bits, v_bits, K_SEED,
                                     V_SEED)[0]
    got = out.copy_to_host()
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL[variant] * np.abs(want).max())
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.cudasim
@needs_sim_or_gpu
@VARIANTS
@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (4, 3), (4, 4)], ids=["k3v3", "k4v3", "k4v4"])
def test_decode_tiny(k_bits, v_bits, variant):
    """GQA 2 query heads per KV head (chunks of 8 tokens), 13 cached tokens: of 3 splits one runs (splits
    are whole steps of the block's warps' chunks), two of its four warps without keys and one with a chunk
    cut at kv_len."""
    check_decode(H=4, Hkv=2, d=32, L=13, max_seq=20, k_bits=k_bits, v_bits=v_bits, n_splits=3,
                 rng=np.random.default_rng(k_bits * 10 + v_bits), variant=variant)


@pytest.mark.cudasim
@needs_sim_or_gpu
@VARIANTS
@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (4, 4)], ids=["k3v3", "k4v4"])
def test_decode_many_tiles(k_bits, v_bits, variant):
    """3 query heads per KV head (as the 27B's 6), 300 tokens in 2 splits: a warp's softmax runs over
    several 32-token tiles, the last ones partial; then 1,400 tokens in 11 splits of 128."""
    check_decode(H=6, Hkv=2, d=32, L=300, max_seq=320, k_bits=k_bits, v_bits=v_bits, n_splits=2,
                 rng=np.random.default_rng(k_bits * 10 + v_bits + 1), variant=variant)
    # 11 splits: the combine's split groups take 3 or 2 splits each (its two-load steps and its tail)
    check_decode(H=4, Hkv=2, d=32, L=1400, max_seq=1408, k_bits=k_bits, v_bits=v_bits, n_splits=11,
                 rng=np.random.default_rng(k_bits * 10 + v_bits + 2), variant=variant)


@pytest.mark.cudasim
@needs_sim_or_gpu
@VARIANTS
@pytest.mark.parametrize("d", [64, 256])
def test_decode_wide_heads(d, variant):
    """Heads of 64 and 256 dims: the warp-held rotations run butterflies inside a lane (2 and 8 coordinates
    each) as well as across lanes; 150 tokens in 2 splits."""
    check_decode(H=4, Hkv=2, d=d, L=150, max_seq=160, k_bits=3, v_bits=3, n_splits=2,
                 rng=np.random.default_rng(d), variant=variant)


@pytest.mark.cudasim
@needs_sim_or_gpu
@VARIANTS
@pytest.mark.parametrize("H,Hkv,L", [(2, 2, 45), (12, 2, 29), (16, 1, 11)], ids=["G1", "G6", "G16"])
def test_decode_chunk_sizes(H, Hkv, L, variant):
    """The lanes' score butterfly at every chunk size: 8 tokens (G = 1: three scattering steps, the last
    chunk 5 tokens), 2 (G = 6, as the 27B: one step, then four plain ones), 1 (G = 16: plain sums only)."""
    assert [chunk_tokens(H // Hkv) for H, Hkv, _ in [(2, 2, 0), (12, 2, 0), (16, 1, 0)]] == [8, 2, 1]
    if variant == "mma" and H // Hkv > 8:                 # the heads are the rows of one mma
        with pytest.raises(ValueError, match="at most 8 query heads"):
            check_decode(H=H, Hkv=Hkv, d=32, L=L, max_seq=L + 3, k_bits=3, v_bits=4, n_splits=2,
                         rng=np.random.default_rng(0), variant=variant)
        return
    check_decode(H=H, Hkv=Hkv, d=32, L=L, max_seq=L + 3, k_bits=3, v_bits=4, n_splits=2,
                 rng=np.random.default_rng(H * 100 + L), variant=variant)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_decode_q8_lanes():
    """8-bit codes (the q8 type): a lane's code group is two words, its table 256 levels a role; 2 query
    heads per KV head, 40 tokens in 2 splits, then k4 keys beside 8-bit values. The token-lane partial
    refuses 8 bits."""
    check_decode(H=4, Hkv=2, d=32, L=40, max_seq=44, k_bits=8, v_bits=8, n_splits=2,
                 rng=np.random.default_rng(88), variant="lanes")
    check_decode(H=4, Hkv=2, d=64, L=21, max_seq=24, k_bits=4, v_bits=8, n_splits=2,
                 rng=np.random.default_rng(48), variant="lanes")
    with pytest.raises(ValueError, match="token-lane partial"):
        check_decode(H=4, Hkv=2, d=32, L=5, max_seq=8, k_bits=8, v_bits=8, n_splits=2,
                     rng=np.random.default_rng(0), variant="tokens")



@pytest.mark.cudasim
@needs_sim_or_gpu
def test_decode_mma_refuses_a_cache_of_partial_tiles():
    """The mma partial copies 16 rows at a time: a cache whose rows are not whole tiles is refused before
    any launch (the copies of its last head's last tile would run past the buffer)."""
    H, Hkv, d, rows = 4, 2, 32, MMA_TILE + 4
    codes = cuda.to_device(np.zeros((Hkv, rows, d * 3 // 8), np.uint8))
    norms = cuda.to_device(np.zeros((Hkv, rows), np.uint16))
    with pytest.raises(ValueError, match="whole tiles of 16 cache rows"):
        kvq_attention_decode(cuda.to_device(np.zeros((H, d), np.float32)), codes, norms, codes, norms,
                             cuda.to_device(np.array([3], np.int32)), KvqTables(d, 3, K_SEED), KvqTables(d, 3, V_SEED),
                             cuda.to_device(np.zeros((H, d), np.float32)), KvqDecodeWorkspace(H, d, 2), variant="mma")


LIBDEVICE = "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"


@pytest.mark.skipif(SIMULATOR or gpu_available() or not os.path.exists(LIBDEVICE),
                    reason="offline PTX check: needs NVVM + libdevice and no GPU (a GPU runs the real tests)")
@pytest.mark.parametrize("k_bits,v_bits,variant", [(3, 3, "lanes"), (4, 4, "lanes"), (8, 8, "lanes"),
                                                    (3, 3, "tokens"), (4, 4, "tokens"), (3, 3, "mma"),
                                                    (4, 3, "mma"), (4, 4, "mma")])
def test_partial_ptx_offline_keeps_registers(monkeypatch, k_bits, v_bits, variant):
    """The 9B's partial compiles to sm_90a PTX without a device (reference/numba-cuda.md §7, test-only
    patches of numba internals) with no local memory: queries, scores and accumulators stay in registers
    and the codebook lookups are shared loads (tokens: the key rows' words too, and the queries come as
    16-byte shared loads, one per key code; mma: every product of a warp's tile unrolled, the codes
    copied into a shared ring and read as 8-byte shared loads)."""
    import types as pytypes

    import numba.cuda.cudadrv.nvrtc as nvrtc_mod
    import numba.cuda.cudadrv.nvvm as nvvm_mod
    import numba.cuda.dispatcher as dispatcher_mod
    from numba import types

    from ninfer_numba.kernels.kvq import decode, decode_mma, decode_tokens
    sm90 = pytypes.SimpleNamespace(compute_capability=(9, 0))
    monkeypatch.setattr(dispatcher_mod, "get_current_device", lambda: sm90)
    monkeypatch.setattr(cuda, "get_current_device", lambda: sm90)     # the PDL instructions ask it (ptx.py)
    monkeypatch.setattr(nvrtc_mod.config, "FORCE_CUDA_CC", (9, 0, "a"))
    monkeypatch.setattr(nvvm_mod, "get_libdevice", lambda: LIBDEVICE)
    monkeypatch.setattr(nvvm_mod, "open_libdevice", lambda: open(LIBDEVICE, "rb").read())
    module = {"lanes": decode, "tokens": decode_tokens, "mma": decode_mma}[variant]
    partial, _ = module._kernels(16, 4, 256, k_bits, v_bits, 128, True)

    def arr(dt, n):
        return types.Array(dt, n, "C")
    f32 = types.float32
    sig = (arr(types.float16, 2), arr(types.uint32, 1), arr(types.uint16, 2), arr(types.uint32, 1),
           arr(types.uint16, 2), arr(types.int32, 1), arr(f32, 1), arr(f32, 1), arr(f32, 1), arr(f32, 1),
           arr(f32, 3), arr(f32, 3), arr(types.uint16, 1), arr(types.uint16, 1))
    ptx, _ = cuda.compile_ptx(partial.py_func, sig, cc=(9, 0, "a"), launch_bounds=(decode.TPB, 4))
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx   # programmatic launch
    if variant == "mma":                # per tile, 4 key products (16 tokens) and 4 value ones (16 coordinates)
        assert ptx.count("mma.sync.aligned.m16n8k16") == 8
        # the tiles come through the cp.async ring (before the loop and in it); a warp's 64 codes of a row
        # are `bits` 8-byte shared loads: two key rows and four value rows a tile
        assert ptx.count("cp.async.cg.shared.global") >= 8 and ptx.count("cp.async.wait_group") >= 2
        assert ptx.count("ld.shared.v2.u32") == 2 * k_bits + 4 * v_bits
        return
    if variant == "tokens":
        assert ptx.count("ld.shared.v4.f32") >= 32                    # a block of 128 (3 bits) or 32 codes
        assert ptx.count("fma.rn.f32") >= 4 * 32 + 8 * 4 * 4          # and the values of a 4-token batch
        return
    assert ptx.count("ld.shared.f32") >= 2 * 8 * chunk_tokens(4)      # a table load per code of a chunk
    assert ptx.count("fma.rn.f32") >= 2 * 8 * 4 * chunk_tokens(4)     # G FMAs per key and value code


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k_bits,v_bits,variant", [(3, 3, "lanes"), (4, 3, "lanes"), (4, 4, "lanes"), (8, 8, "lanes"),
                                                    (3, 3, "tokens"), (4, 3, "tokens"), (4, 4, "tokens"),
                                                    (3, 3, "mma"), (4, 3, "mma"), (4, 4, "mma")])
def test_decode_model_shape(k_bits, v_bits, variant):
    """The 9B's attention (16 query heads, 4 KV heads, d = 256) over 3,001 cached tokens in 33 splits, and
    the 27B's (24 query heads) over 40,000 in 128."""
    check_decode(H=16, Hkv=4, d=256, L=3001, max_seq=4096, k_bits=k_bits, v_bits=v_bits, n_splits=33,
                 rng=np.random.default_rng(k_bits * 10 + v_bits), variant=variant)
    check_decode(H=24, Hkv=4, d=256, L=40000, max_seq=40960, k_bits=k_bits, v_bits=v_bits, n_splits=128,
                 rng=np.random.default_rng(k_bits * 10 + v_bits), variant=variant)


@pytest.mark.cudasim
@needs_sim_or_gpu
def test_decode_gated():
    """With the layer's projection row the output is gated (o ⊙ σ(gate), flattened)."""
    H, Hkv, d, L, max_seq, bits = 4, 2, 32, 9, 12, 3
    rng = np.random.default_rng(5)
    q = rng.standard_normal((H, d)).astype(np.float16)              # the model's query buffer is f16
    kv = rng.standard_normal((L, Hkv, d)).astype(np.float32)
    kc, kn = ref.quantize(kv, bits, K_SEED)
    codes = np.zeros((Hkv, max_seq, d * bits // 8), np.uint8)
    norms = np.zeros((Hkv, max_seq), np.uint16)
    codes[:, :L], norms[:, :L] = ref.pack(kc, bits).transpose(1, 0, 2), kn.view(np.uint16).T
    d_codes, d_norms, kv_len = cuda.to_device(codes), cuda.to_device(norms), cuda.to_device(np.array([L], np.int32))
    tables = KvqTables(d, bits, K_SEED)
    proj = rng.standard_normal((1, 2 * d * H + 2 * d * Hkv)).astype(np.float32)
    out = cuda.to_device(np.zeros(H * d, np.float32))
    kvq_attention_decode(cuda.to_device(q), d_codes, d_norms, d_codes, d_norms, kv_len, tables, tables, out,
                         KvqDecodeWorkspace(H, d, 2), proj=cuda.to_device(proj))
    o = ref.attention_rotated_ref(q[None].astype(np.float32), kc, kn, kc, kn, np.array([L - 1]), bits, bits,
                                  K_SEED, K_SEED)[0]
    gate = proj[0, :2 * d * H].reshape(H, 2, d)[:, 1]
    want = (o / (1 + np.exp(-gate.astype(np.float64)))).reshape(-1)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_the_kernels_of_one_shape_are_built_once():
    """Each decode call asks for its kernels by shape: building them again would recompile every call."""
    from ninfer_numba.kernels.kvq import decode, decode_mma, decode_tokens
    for module in (decode, decode_tokens, decode_mma):
        assert module._kernels(16, 4, 256, 3, 3, 128, True) is module._kernels(16, 4, 256, 3, 3, 128, True)
