"""What the server asks of the engine it serves: engine/llm.LLM has all of it, and so may any other object
(the server tests serve a scripted one). The handlers read the model's identity, limits, tokenizer and chat
template; the worker runs a request alone through ``stream`` and, with batch slots, greedy requests through a
``scheduler`` (engine/scheduler.py). Checked when the app is made (``check_engine``), so a missing member is
one clear error at start, not an AttributeError in the middle of a request.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

from ninfer_numba.config import ModelConfig, SamplingParams


@runtime_checkable
class ServedEngine(Protocol):
    tokenizer: Any               # formats/tokenizer.Tokenizer; None for a file without a vocabulary
    config: ModelConfig
    model_id: str                # the id /v1/models lists (engine/llm.py: the GGUF file's stem)
    max_seq: int                 # tokens of context: prompt and completion together
    chat_template: str | None    # the file's jinja template; None: render_chat's Qwen3.5 default
    last_cached_tokens: int      # prompt tokens the last stream() reused instead of prefilling
    last_logprobs: list          # the last stream()'s engine/sampling.TokenLogprob entries (params.logprobs)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, constraint: Any = None,
               snapshot_at: Sequence[int] = ()) -> Iterator[int]:
        """One sequence's generated ids, one at a time; closing the generator stops it."""
        ...


@runtime_checkable
class BatchingEngine(ServedEngine, Protocol):
    def scheduler(self, n_slots: int) -> Any:
        """An engine/scheduler.Scheduler of n_slots greedy sequences on this engine's model."""
        ...


def members(protocol: type) -> set[str]:
    """The attributes and methods a protocol of this module declares, its bases' included."""
    out: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (ServedEngine, BatchingEngine):
            out |= set(inspect.get_annotations(cls))
            out |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    return out


def check_engine(engine: Any, batch_slots: int) -> None:
    """TypeError naming what ``engine`` lacks of ServedEngine (and of BatchingEngine with batch_slots > 1)."""
    want = BatchingEngine if batch_slots > 1 else ServedEngine
    if isinstance(engine, want):
        return
    missing = sorted(m for m in members(want) if not hasattr(engine, m))
    raise TypeError(f"{type(engine).__name__} cannot be served{' with batch slots' if batch_slots > 1 else ''}: "
                    f"it lacks {', '.join(missing)} (server/engine_api.py)")
