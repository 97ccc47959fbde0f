"""Snapshots at prompt prefixes (engine/prefix_cache.py) reused across requests, on the CPU backend: a prompt
that shares a prefix with an earlier one, even after another request replaced the state, restores the
longest snapshot and prefills the rest; what it computes equals a fresh run; the cache keeps to its budget."""
import numpy as np
import pytest

from ninfer_numba.config import SamplingParams
from ninfer_numba.engine.llm import LLM
from ninfer_numba.engine.prefix_cache import PrefixCache

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = np.random.default_rng(0).integers(0, 5000, 40).tolist()       # a shared "system prompt"


def _llm(path, **kw):
    kw.setdefault("snapshot_every", 16)
    return LLM(path, backend="cpu", max_seq=256, **kw)


def test_clients_sharing_a_prefix_prefill_it_once(tiny_model):
    llm = _llm(tiny_model)
    a = llm.generate(SYSTEM + [11, 12, 13], GREEDY)
    b = llm.generate(SYSTEM + [21, 22], GREEDY)          # diverges after SYSTEM: the live state cannot serve
    assert a.cached_tokens == 0 and b.cached_tokens == 32       # the snapshot at 2 x 16 tokens
    fresh = _llm(tiny_model, prefix_cache_mb=0).generate(SYSTEM + [21, 22], GREEDY)
    assert b.token_ids == fresh.token_ids
    turn2 = SYSTEM + [11, 12, 13] + a.token_ids + [14]    # A's next turn: A's whole prompt was kept
    second = llm.generate(turn2, GREEDY)
    assert second.cached_tokens == len(SYSTEM) + 3
    assert second.token_ids == _llm(tiny_model, prefix_cache_mb=0).generate(turn2, GREEDY).token_ids
    again = llm.generate(SYSTEM + [11, 12, 13], GREEDY)   # A's prompt again: its last multiple of 16
    assert again.cached_tokens == 32 and again.token_ids == a.token_ids


def test_a_snapshot_where_the_chat_history_ends(tiny_model):
    """stream(snapshot_at=k) keeps the state after the first k prompt tokens too: a later prompt that shares
    exactly those k (the next turn of a chat: server/chat.py) restores it after another sequence ran."""
    llm = _llm(tiny_model)
    assert llm.prefix_cache.boundaries(0, 44, (42,)) == [16, 32]   # 10 tokens past 32: not worth a split
    llm.prefix_cache.min_gain = 8
    first = SYSTEM + [11, 12, 13, 14]                      # 44 tokens; history ends at 42
    list(llm.stream(first, GREEDY, snapshot_at=(42,)))
    llm.generate([7, 7, 7], GREEDY)
    turn2 = first[:42] + [50, 51, 52]
    out = llm.generate(turn2, GREEDY)
    assert out.cached_tokens == 42
    assert out.token_ids == _llm(tiny_model, prefix_cache_mb=0).generate(turn2, GREEDY).token_ids
    assert llm.prefix_cache.boundaries(0, 44, (42,)) == [16, 32, 42] and llm.prefix_cache.boundaries(42, 44, (42,)) == []
    assert llm.prefix_cache.boundaries(0, 44, (20, 36)) == [16, 32]          # 4 past the cuts before them
    assert llm.prefix_cache.boundaries(0, 44, (24, 28)) == [16, 24, 32]      # 28: 4 past the extra 24


def test_restored_state_gives_the_fresh_logits(tiny_model):
    llm = _llm(tiny_model)
    llm.generate(SYSTEM, GREEDY)
    llm.generate([7, 7, 7], GREEDY)                      # another sequence replaces the state
    prompt = SYSTEM + [30, 31]
    rest = llm._resume_from_snapshots(prompt, llm._continue_or_reset(prompt))
    assert llm.last_cached_tokens == len(SYSTEM) and rest == prompt[-2:]     # the first prompt's own snapshot
    reused = llm.runner.prefill(rest)
    fresh = _llm(tiny_model, prefix_cache_mb=0).logits(prompt)[-1]
    np.testing.assert_allclose(reused, fresh, rtol=1e-4, atol=1e-4 * np.abs(fresh).max())


def test_budget_evicts_least_recently_used():
    class Snap:
        def __init__(self, n):
            self.nbytes = n
    cache = PrefixCache(budget_bytes=100, every=8)
    cache.put([1, 2], Snap(40))
    cache.put([1, 2, 3], Snap(40))
    assert cache.longest([1, 2, 9])[0] == 2               # [1, 2] is now the most recently used
    cache.put([5, 6], Snap(40))                           # over budget: [1, 2, 3] goes
    assert cache.stats() == {"entries": 2, "bytes": 80, "hits": 1, "misses": 0, "evictions": 1}
    assert cache.longest([1, 2, 3, 4])[0] == 2 and cache.longest([9]) is None
    cache.put([7], Snap(101))                             # larger than the whole budget: not kept
    assert len(cache) == 2 and not cache.has([7])
    assert cache.boundaries(0, 20) == [8, 16] and cache.boundaries(16, 20) == [] and cache.boundaries(5, 17) == [8, 16]
    assert cache.boundaries(0, 8) == [] and cache.boundaries(0, 1) == []
    taken = []
    cache.keep([1, 2], lambda: taken.append("again") or Snap(1))      # kept already: no snapshot is taken
    cache.keep([8], lambda: taken.append("new") or Snap(10))
    assert taken == ["new"] and cache.has([8])
    with pytest.raises(ValueError):
        PrefixCache(budget_bytes=-1, every=8)


def test_a_small_budget_still_answers_correctly(tiny_model):
    llm = _llm(tiny_model, prefix_cache_mb=1)
    outs = [llm.generate(SYSTEM + [i], GREEDY).token_ids for i in range(3)]
    fresh = [_llm(tiny_model, prefix_cache_mb=0).generate(SYSTEM + [i], GREEDY).token_ids for i in range(3)]
    assert outs == fresh and llm.prefix_cache.nbytes <= 1 << 20


@pytest.mark.gpu
def test_gpu_snapshots_restore_the_state(tmp_path):
    """The cuda runner's snapshots (device copies of KV rows and GDN states): after another sequence, a prompt
    sharing a prefix restores it, and its last-position logits are as close to the float reference as a
    fresh GPU run's (within twice that distance or the int8 emulation's, whichever is larger)."""
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    if SIMULATOR or not gpu_available():
        pytest.skip("needs a CUDA GPU")
    from ninfer_numba.model.reference import ReferenceModel
    from tests.gguf_factory import QT, tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC, _rel
    path = write_gguf(tmp_path / "tiny-gpu.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                      matrix_type=QT.Q8_0)
    system = np.random.default_rng(1).integers(0, SPEC.n_vocab, 40).tolist()
    llm = LLM(path, backend="cuda", max_seq=96, prefill_chunk=32, snapshot_every=16)
    llm.generate(system, GREEDY)
    llm.generate([7, 7, 7], GREEDY)
    prompt = system + [30, 31]
    rest = llm._resume_from_snapshots(prompt, llm._continue_or_reset(prompt))
    assert llm.last_cached_tokens == len(system) and rest == prompt[-2:]
    reused = llm.runner.prefill(rest)
    fresh = LLM(path, backend="cuda", max_seq=96, prefill_chunk=32, prefix_cache_mb=0).logits(prompt)[-1]
    f = ReferenceModel(llm.weights)
    ref_float = f.forward(prompt, f.new_state(len(prompt)))[-1]
    e = ReferenceModel(llm.weights, emulate_int8=True)
    ref_int8 = e.forward(prompt, e.new_state(len(prompt)))[-1]
    bound = 2 * max(_rel(ref_int8, ref_float), _rel(fresh, ref_float))
    assert _rel(reused, ref_float) <= bound, (_rel(reused, ref_float), bound)


@pytest.mark.cudasim
def test_cuda_snapshot_copies_rows_below_the_position_and_the_states(tmp_path):
    """CudaSnapshot (engine/snapshot.py) on a SequenceState of the GPU model tests' shapes: KV rows < pos
    and every GDN state are copied out, later changes do not reach the copy, and restoring brings them back
    with the position (device and host)."""
    from ninfer_numba.engine.snapshot import CudaSnapshot
    from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
    from ninfer_numba.engine.cache import SequenceState
    from ninfer_numba.model.weights import open_model
    from tests.gguf_factory import tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC
    if not SIMULATOR:
        pytest.skip("simulator test (the GPU runs test_gpu_snapshots_restore_the_state)")
    c = open_model(write_gguf(tmp_path / "m.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(2)))).config
    stream = cuda.stream()
    st = SequenceState(c, 12, stream)
    rng = np.random.default_rng(4)
    fill = {}
    for name in ("k_cache", "v_cache", "conv", "ssm"):
        for i, a in getattr(st, name).items():
            fill[name, i] = rng.standard_normal(a.shape).astype(a.dtype)
            a.copy_to_device(fill[name, i])
    st.host_pos = 5
    snap = CudaSnapshot(st, stream)
    for name in ("k_cache", "v_cache", "conv", "ssm"):
        for a in getattr(st, name).values():
            a.copy_to_device(np.zeros(a.shape, a.dtype))
    st.host_pos = 0
    snap.restore_into(st, stream)
    assert st.host_pos == 5 and int(st.pos.copy_to_host()[0]) == 5
    for (name, i), want in fill.items():
        got = getattr(st, name)[i].copy_to_host()
        if name in ("k_cache", "v_cache"):
            np.testing.assert_array_equal(got[:, :5], want[:, :5])
            assert (got[:, 5:] == 0).all()                 # rows past the position are not part of it
        else:
            np.testing.assert_array_equal(got, want)
    rows = sum(a[:, :5].nbytes for name in ("k_cache", "v_cache") for a in getattr(st, name).values())
    assert snap.nbytes == rows + sum(a.nbytes for name in ("conv", "ssm") for a in getattr(st, name).values())
    other = SequenceState(c, 12, stream, layers=range(2))             # another layout: refused
    with pytest.raises(ValueError, match="another model's state layout"):
        snap.restore_into(other, stream)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_type", ["f16", "k3v3"])
def test_gpu_restored_state_equals_the_same_prefill_run_fresh(tmp_path, kv_type):
    """A restored snapshot is the state itself: after another sequence, the prompt restored at its system
    prefix and prefilled on gives logits bit-equal to a fresh run of the same chunks (engine/snapshot.py). With
    a coded cache the snapshot must carry the codes and norms (the f16 rows are a scratch every layer shares)."""
    from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
    if SIMULATOR or not gpu_available():
        pytest.skip("needs a CUDA GPU")
    from tests.gguf_factory import QT, tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC
    path = write_gguf(tmp_path / "tiny-gpu.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                      matrix_type=QT.Q8_0)
    system = np.random.default_rng(1).integers(0, SPEC.n_vocab, 40).tolist()
    kw = dict(backend="cuda", max_seq=96, prefill_chunk=32, kv_type=kv_type)
    llm = LLM(path, snapshot_every=16, **kw)
    llm.generate(system, GREEDY)                       # snapshots at 16, 32 and 40
    llm.generate([7, 7, 7] * 12, GREEDY)               # another sequence overwrites the state
    prompt = system + [30, 31]
    rest = llm._resume_from_snapshots(prompt, llm._continue_or_reset(prompt))
    assert llm.last_cached_tokens == len(system) and rest == prompt[-2:]
    reused = llm.runner.prefill(rest)
    fresh = LLM(path, prefix_cache_mb=0, **kw)
    for a, b in ((0, 16), (16, 32), (32, 40), (40, 42)):   # the chunks the first run's snapshots cut
        logits = fresh.runner.prefill(prompt[a:b])
    np.testing.assert_array_equal(reused, logits)


@pytest.mark.cudasim
def test_copy_rows_moves_rows_below_the_count_and_the_states(tmp_path):
    """engine/snapshot.copy_rows (the batched decoder's slot <-> staging copies): rows < 7 of every KV head and
    every GDN state reach the destination, its rows past 7 and its position stay."""
    from ninfer_numba.engine.cache import SequenceState
    from ninfer_numba.engine.snapshot import copy_rows
    from ninfer_numba.kernels.numba_env import SIMULATOR, cuda
    from ninfer_numba.model.weights import open_model
    from tests.gguf_factory import tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC
    if not SIMULATOR:
        pytest.skip("simulator test (the GPU runs the batched decoder's tests)")
    c = open_model(write_gguf(tmp_path / "m.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(2)))).config
    stream = cuda.stream()
    src, dst = SequenceState(c, 12, stream), SequenceState(c, 12, stream)
    rng = np.random.default_rng(6)
    fill = {}
    for name in ("k_cache", "v_cache", "conv", "ssm"):
        for i in getattr(src, name):
            for which, st in (("src", src), ("dst", dst)):
                a = getattr(st, name)[i]
                fill[which, name, i] = rng.standard_normal(a.shape).astype(a.dtype)
                a.copy_to_device(fill[which, name, i])
    dst.reset(stream)
    copy_rows(dst, src, 7, stream)
    assert dst.host_pos == 0 and int(dst.pos.copy_to_host()[0]) == 0
    for name in ("k_cache", "v_cache", "conv", "ssm"):
        for i, a in getattr(dst, name).items():
            got, want, before = a.copy_to_host(), fill["src", name, i], fill["dst", name, i]
            if name in ("k_cache", "v_cache"):
                np.testing.assert_array_equal(got[:, :7], want[:, :7])
                np.testing.assert_array_equal(got[:, 7:], before[:, 7:])
            else:
                np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="different layouts"):
        copy_rows(SequenceState(c, 12, stream, layers=range(2)), src, 7, stream)
