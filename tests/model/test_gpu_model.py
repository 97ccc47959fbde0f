"""The whole GPU model (kernels, weight repack, buffers, graph-replayed decode) against the NumPy reference.

Oracle. Random synthetic models amplify small perturbations: on them a relative change of 1e-5 in the
embeddings moves the int8-emulating reference's logits by ~10% (every int8 activation rounding that flips
cascades through the layers), while the float reference moves by ~1e-4. So a tight bound against the
int8-emulating reference cannot be met by any implementation on such a model. The check is therefore the
same-precision oracle: the GPU's distance to the float reference must be at most twice the int8-emulating
reference's own distance to it, and its top-1 agreement with the float reference at most 10 points lower.
The tight end-to-end check is against the int8-emulating reference that follows the GPU's one-level rounding
decisions (benchmarks/e2e/act_follow.py; the last test here). (GPU-only: under the CUDA simulator this model takes
longer than the whole suite's budget.)
"""
import numpy as np
import pytest

from tests.gguf_factory import QT, TinySpec, tensors_for, write_gguf

SPEC = TinySpec(n_embd=64, n_layer=4, n_head=2, n_head_kv=1, head_dim=32, n_rot=16, n_ff=96, ssm_groups=4,
                ssm_heads=16, ssm_state=16, n_vocab=320, tied=False)


def tiny_gpu_model(tmp_dir, **engine):
    """The SPEC model (Q8_0, seed 21) as a bare Qwen35Gpu on its own stream, engine fields as given (for
    simulator tests of one layer's kernels: the whole model there takes minutes per forward)."""
    from ninfer_numba.config import EngineConfig
    from ninfer_numba.kernels.numba_env import cuda
    from ninfer_numba.model.gpu_weights import GpuWeights
    from ninfer_numba.model.qwen35 import Qwen35Gpu
    from ninfer_numba.model.weights import open_model
    w = open_model(write_gguf(f"{tmp_dir}/m.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                              matrix_type=QT.Q8_0))
    return Qwen35Gpu(GpuWeights(w), EngineConfig(backend="cuda", **engine), cuda.stream())


def _tiny_gpu_llm(tmp_path, **engine):
    """The SPEC model (Q8_0, seed 21) on the cuda backend, prefill in 32-token chunks."""
    from ninfer_numba import LLM
    path = write_gguf(tmp_path / "tiny-gpu.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                      matrix_type=QT.Q8_0)
    return LLM(path, backend="cuda", max_seq=96, prefill_chunk=32, **engine)


def prefill_and_greedy_steps(llm, prompt: list[int], n: int):
    """(sequence, GPU logits of its every position, greedy tokens): the prompt's logits from the prefill path,
    then n - 1 greedy decode steps (the decode path) after a reset."""
    gpu_prompt = llm.logits(prompt)
    llm.runner.reset()
    last = llm.runner.prefill(prompt)
    toks, steps = [], []
    for _ in range(n):
        toks.append(int(np.argmax(last)))
        last = llm.runner.decode(toks[-1])
        steps.append(last)
    return prompt + toks[:-1], np.concatenate([gpu_prompt, np.stack(steps[:-1])]), toks


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
def test_gpu_model_against_reference(tmp_path):
    from ninfer_numba.model.reference import ReferenceModel
    llm = _tiny_gpu_llm(tmp_path)
    prompt = np.random.default_rng(3).integers(0, SPEC.n_vocab, 70).tolist()   # > two 32-token chunks
    seq, gpu, toks = prefill_and_greedy_steps(llm, prompt, 8)
    f = ReferenceModel(llm.weights)
    ref_float = f.forward(seq, f.new_state(len(seq)))
    q = ReferenceModel(llm.weights, emulate_int8=True)
    ref_int8 = q.forward(seq, q.new_state(len(seq)))
    baseline = _rel(ref_int8, ref_float)
    assert _rel(gpu, ref_float) <= 2 * baseline, (_rel(gpu, ref_float), baseline)
    top_base = np.mean(ref_int8.argmax(-1) == ref_float.argmax(-1))
    assert np.mean(gpu.argmax(-1) == ref_float.argmax(-1)) >= top_base - 0.10
    # the graph-replayed greedy path returns the same token as the host argmax of the same step
    llm.runner.reset()
    llm.runner.prefill(prompt)
    assert llm.runner.decode_greedy(toks[0]) == toks[1]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(temperature=0.9, top_k=40, top_p=0.95, seed=11),
                                 dict(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=12),
                                 dict(temperature=0.8, presence_penalty=0.6, frequency_penalty=0.4, seed=13),
                                 dict(temperature=0.0, frequency_penalty=2.0), dict(temperature=0.0)])
def test_device_sampling_matches_host_sampler(tmp_path, cfg):
    """LLM.stream's graph-replayed device sampler (or argmax), one step run ahead, picks what the host sampler
    picks from the same logits, step by step."""
    from ninfer_numba import SamplingParams
    from ninfer_numba.engine.sampling import Sampler
    llm = _tiny_gpu_llm(tmp_path)
    prompt = np.random.default_rng(4).integers(0, SPEC.n_vocab, 40).tolist()
    params = SamplingParams(max_tokens=24, ignore_eos=True, **cfg)
    device = list(llm.stream(prompt, params))
    host = Sampler(params, SPEC.n_vocab, prompt)
    llm.runner.reset()
    toks = [host.pick(llm.runner.prefill(prompt))]
    while len(toks) < params.max_tokens:
        toks.append(host.pick(llm.runner.decode(toks[-1])))
    assert device == toks
    assert len(set(toks)) > 1


@pytest.mark.gpu
def test_prefill_graph_replay_matches_eager(tmp_path):
    """A 70-token prompt in chunks of 32, 32, 6: the second 32 is captured and replayed; a second run
    replays 32 twice and captures 6; the logits, the position and the next greedy tokens equal an eager-only
    engine's."""
    graphs, eager = _tiny_gpu_llm(tmp_path), _tiny_gpu_llm(tmp_path, prefill_graphs=False)
    prompt = np.random.default_rng(6).integers(0, SPEC.n_vocab, 70).tolist()
    runs = []
    for llm in (graphs, graphs, eager):
        llm.runner.reset()
        last = llm.runner.prefill(prompt)
        toks = [int(np.argmax(last))]
        toks += [llm.runner.decode_greedy(toks[-1]) for _ in range(4)]
        runs.append((last, toks, llm.runner.state.host_pos))
    assert len(graphs.runner._prefill_graphs) == 2 and not eager.runner._prefill_graphs   # lengths 32 and 6
    for last, toks, pos in runs[:2]:
        assert np.array_equal(last, runs[2][0]) and toks == runs[2][1] and pos == runs[2][2] == 74


@pytest.mark.gpu
def test_gpu_layers_match_reference_layers(tmp_path):
    """Each layer and the head, fed the GPU's own input, within 5e-3 of the int8-emulating reference (which
    emulates the W8A16 rows as such: float16 activations and weights)."""
    from benchmarks.e2e.layer_check import compare_layers, gpu_residual_streams
    llm = _tiny_gpu_llm(tmp_path)
    prompt = np.random.default_rng(3).integers(0, SPEC.n_vocab, 70).tolist()
    streams, logits, toks, f16 = gpu_residual_streams(llm.runner, prompt, 8)
    assert len(streams) == SPEC.n_layer + 1 and streams[0].shape == (78, SPEC.n_embd) and len(toks) == 8
    r = compare_layers(llm.weights, streams, logits, f16=f16)
    assert r["max_rel"] < 5e-3 and r["head_rel"] < 5e-3, r


@pytest.mark.gpu
def test_gpu_model_matches_int8_reference_following_near_ties(tmp_path):
    """End to end against the int8-emulating reference that takes the GPU's one-level rounding decisions
    (benchmarks/e2e/act_follow.py): no GPU int8 activation is two levels or more from the reference's own, and then
    the logits at every position, the top-1 and the greedy tokens (graph path) all agree tightly."""
    from benchmarks.e2e.act_follow import follow_in_pieces, gpu_activations
    llm = _tiny_gpu_llm(tmp_path)
    prompt = np.random.default_rng(5).integers(0, SPEC.n_vocab, 70).tolist()
    acts, logits, toks, pieces = gpu_activations(llm.runner, prompt, 8)
    assert pieces == [32, 32, 6] + [1] * 8                 # the reference runs the same forward calls
    ref_logits, follower = follow_in_pieces(llm.weights, acts, prompt + toks, pieces)
    rep = follower.report()
    assert logits.shape == ref_logits.shape == (78, SPEC.n_vocab)
    assert rep["disagreements"] == 0, (rep, [st for st in follower.stats if st["disagreements"]][:3])
    assert _rel(logits, ref_logits) < 5e-3
    assert np.mean(logits.argmax(-1) == ref_logits.argmax(-1)) >= 0.99
    assert ref_logits[69:77].argmax(-1).tolist() == toks
    llm.runner.reset()
    assert [int(np.argmax(llm.runner.prefill(prompt)))] + [llm.runner.decode_greedy(t) for t in toks[:-1]] == toks
