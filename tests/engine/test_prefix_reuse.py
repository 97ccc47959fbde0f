"""Prefix reuse (engine/llm.py): a prompt that extends the previous sequence runs only its new tokens, and
computes what a fresh run computes; anything else starts over.

The prefix cache of snapshots is off here (its own tests are in test_prefix_cache.py). CPU backend on the
tiny synthetic model; the GPU variant (marked gpu) runs the same checks on the cuda
runner, whose device sampling and run-ahead feed tokens the host has not seen yet.
"""
import asyncio

import numpy as np
import pytest

from ninfer_numba.config import SamplingParams
from ninfer_numba.engine.llm import LLM

PROMPT = [5, 17, 200, 9, 31, 64, 2, 77]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, top_k=40, seed=7, ignore_eos=True)


def _backend_llm(path, backend, **kw):
    kw.setdefault("prefix_cache_mb", 0)              # the live state alone (tests/engine/test_prefix_cache.py)
    if backend == "cuda":
        from ninfer_numba.kernels.numba_env import SIMULATOR, gpu_available
        if SIMULATOR or not gpu_available():
            pytest.skip("needs a CUDA GPU")
        kw.setdefault("prefill_chunk", 32)          # the continuation crosses chunk boundaries too
    return LLM(path, backend=backend, max_seq=128, **kw)


def _two_turns(llm, params):
    first = llm.generate(PROMPT, params)
    second_prompt = PROMPT + first.token_ids + [11, 12, 13]
    return first, second_prompt, llm.generate(second_prompt, params)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_cpu_extension_reuses_the_state_and_matches_a_fresh_run(tiny_model, params):
    check_extension(tiny_model, "cpu", params)


def _gpu_model_path(tmp_path):
    """The shapes the GPU model tests use (tests/model/test_gpu_model.py's SPEC, Q8_0, seed 21)."""
    from tests.gguf_factory import QT, tensors_for, write_gguf
    from tests.model.test_gpu_model import SPEC
    return write_gguf(tmp_path / "tiny-gpu.gguf", SPEC, tensors_for(SPEC, np.random.default_rng(21)),
                      matrix_type=QT.Q8_0)


@pytest.mark.gpu
def test_gpu_extension_reuses_the_state_and_matches_a_fresh_run(tmp_path):
    """Greedy tokens only: on the GPU the reused run decoded the first answer (int8 activations) where the
    fresh run prefills it (f16 activations), so their logits differ at the int8 level and a sampled token
    may flip; the sampled path is checked on its logits below."""
    check_extension(_gpu_model_path(tmp_path), "cuda", GREEDY)


@pytest.mark.gpu
def test_gpu_sampled_reuse_is_as_close_to_the_reference_as_a_fresh_run(tmp_path):
    """After a sampled first turn (device sampling, run-ahead), the kept state gives last-position logits
    within twice the error of a fresh GPU run or of the int8-emulating reference, whichever is larger."""
    from ninfer_numba.model.reference import ReferenceModel
    from tests.model.test_gpu_model import _rel
    path = _gpu_model_path(tmp_path)
    llm = _backend_llm(path, "cuda")
    first = llm.generate(PROMPT, SAMPLED)
    prompt2 = PROMPT + first.token_ids + [11, 12]
    rest = llm._continue_or_reset(prompt2)
    assert llm.last_cached_tokens >= len(PROMPT) + len(first.token_ids) - 1 and len(rest) < len(prompt2)
    reused = llm.runner.prefill(rest)
    fresh = _backend_llm(path, "cuda", prefix_reuse=False).logits(prompt2)[-1]
    ref_float = (f := ReferenceModel(llm.weights)).forward(prompt2, f.new_state(len(prompt2)))[-1]
    ref_int8 = (q := ReferenceModel(llm.weights, emulate_int8=True)).forward(prompt2, q.new_state(len(prompt2)))[-1]
    bound = 2 * max(_rel(ref_int8, ref_float), _rel(fresh, ref_float))
    assert _rel(reused, ref_float) <= bound, (_rel(reused, ref_float), bound)


def check_extension(path, backend, params):
    llm = _backend_llm(path, backend)
    first, prompt2, second = _two_turns(llm, params)
    assert first.cached_tokens == 0
    # every generated token but the last was fed back; the last one is fed only if the runner ran ahead
    assert second.cached_tokens in (len(PROMPT) + len(first.token_ids) - 1, len(PROMPT) + len(first.token_ids))
    fresh = _backend_llm(path, backend, prefix_reuse=False).generate(prompt2, params)
    assert fresh.cached_tokens == 0
    assert second.token_ids == fresh.token_ids


def test_logits_after_reuse_equal_a_fresh_run(tiny_model):
    """The state kept across calls is the state a fresh prefill builds (up to float32 rounding of a split
    prefill): the last-position logits of the extended prompt agree."""
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    first = llm.generate(PROMPT, GREEDY)
    prompt2 = PROMPT + first.token_ids + [11, 12]
    rest = llm._continue_or_reset(prompt2)
    assert llm.last_cached_tokens > len(PROMPT) and len(rest) < len(prompt2)
    reused = llm.runner.prefill(rest)
    fresh = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0).logits(prompt2)[-1]
    np.testing.assert_allclose(reused, fresh, rtol=1e-4, atol=1e-4 * np.abs(fresh).max())


@pytest.mark.parametrize("other", ["diverges", "same", "shorter"])
def test_anything_but_an_extension_starts_over(tiny_model, other):
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    first = llm.generate(PROMPT, GREEDY)
    seq = PROMPT + first.token_ids[:-1]
    prompt2 = {"diverges": seq[:4] + [99] + seq[5:] + [3], "same": seq, "shorter": seq[:-2]}[other]
    assert llm.generate(prompt2, GREEDY).cached_tokens == 0
    assert llm.runner.position <= len(prompt2) + GREEDY.max_tokens


def test_logits_and_benchmarks_forget_the_sequence(tiny_model):
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    first = llm.generate(PROMPT, GREEDY)
    llm.logits([1, 2, 3])
    assert llm.generate(PROMPT + first.token_ids + [4], GREEDY).cached_tokens == 0


def test_reuse_can_be_turned_off(tiny_model):
    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0, prefix_reuse=False)
    first = llm.generate(PROMPT, GREEDY)
    assert llm.generate(PROMPT + first.token_ids + [4], GREEDY).cached_tokens == 0


def test_server_usage_reports_the_reused_tokens(tiny_model):
    """The OpenAI usage block carries the engine's count (prompt_tokens_details.cached_tokens)."""
    from ninfer_numba.server.responses import usage
    from ninfer_numba.server.worker import Finished, Job, PlainTextParser, run_job

    llm = LLM(tiny_model, backend="cpu", max_seq=128, prefix_cache_mb=0)
    ids = llm.tokenizer.encode("Hello there")
    first = llm.generate(ids, GREEDY)
    loop = asyncio.new_event_loop()
    try:
        job = Job(ids + first.token_ids + llm.tokenizer.encode(" again"), GREEDY, [], PlainTextParser(), loop)
        run_job(llm, job)
        loop.run_until_complete(asyncio.sleep(0))
        items = []
        while not job.events.empty():
            items.append(job.events.get_nowait())
    finally:
        loop.close()
    done = [x for x in items if isinstance(x, Finished)][0]
    assert done.cached_tokens == len(ids) + len(first.token_ids) - 1
    assert usage(done)["prompt_tokens_details"] == {"cached_tokens": done.cached_tokens}

