"""server/engine_api.py: the engine the server types. LLM and the scripted test engine have what it asks;
an engine lacking members is refused when the app is made, naming them."""
import pytest

from ninfer_numba.server.api import create_app
from ninfer_numba.server.engine_api import BatchingEngine, ServedEngine, check_engine, members


def test_llm_and_the_scripted_engine_are_served_engines(tiny_model, scripted):
    from ninfer_numba import LLM
    llm = LLM(tiny_model, backend="cpu", max_seq=64)
    assert isinstance(llm, BatchingEngine) and isinstance(scripted, ServedEngine)
    assert members(BatchingEngine) == members(ServedEngine) | {"scheduler"}
    assert {"stream", "tokenizer", "max_seq", "last_cached_tokens"} <= members(ServedEngine)


def test_an_engine_lacking_members_is_refused_by_name(scripted):
    class Half:
        tokenizer = config = chat_template = None
        model_id, max_seq = "half", 64

    with pytest.raises(TypeError, match=r"Half cannot be served: it lacks last_cached_tokens, last_logprobs, "
                                        r"stream \(server/engine_api.py\)"):
        create_app(Half(), batch_slots=1)
    with pytest.raises(TypeError, match="Half cannot be served with batch slots: it lacks .*, scheduler, stream"):
        create_app(Half())                                      # the default batch slots need a scheduler

    class Alone(Half):                                          # everything but a scheduler
        last_cached_tokens, last_logprobs = 0, []

        def stream(self, prompt_ids, params, constraint=None, snapshot_at=()):
            yield from ()

    check_engine(Alone(), 1)
    with pytest.raises(TypeError, match="with batch slots: it lacks scheduler "):
        check_engine(Alone(), 4)
    check_engine(scripted, 4)
