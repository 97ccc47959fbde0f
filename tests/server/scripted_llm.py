"""A scripted engine with the LLM interface, for server tests: fixed replies, real Qwen3.5 tokenizer.

Replies are chosen by the last user message of the prompt (or the whole prompt for /v1/completions) and go
through the real detokenize and parse path as token ids. Without a registered reply the engine answers with
reasoning (when the prompt ends inside <think>) followed by an echo of the user message. ``scheduler(n)`` runs
the same replies in the slots of the engine's real scheduler (engine/scheduler.py), for the batched path.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator

from ninfer_numba.config import ModelConfig, SamplingParams

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Reply:
    text: str
    token_delay_s: float = 0.0      # sleep before each token (slow generation for disconnect tests)
    fail_at: int | None = None      # raise after yielding this many tokens
    end_of_turn: bool = True        # append <|im_end|>


def scripted_config(n_vocab: int, context_length: int) -> ModelConfig:
    return ModelConfig(n_vocab=n_vocab, n_embd=64, n_layer=4, n_ff=128, n_head=2, n_head_kv=1, head_dim=32,
                       n_rot=16, rope_base=1e7, rope_sections=(3, 3, 2, 0), rms_eps=1e-6, conv_kernel=4,
                       ssm_state=16, ssm_groups=2, ssm_heads=4, full_attn_interval=4,
                       context_length=context_length, tied_embeddings=True, name="scripted")


def last_user_text(prompt: str) -> str | None:
    start = prompt.rfind(IM_START + "user\n")
    if start < 0:
        return None
    body = prompt[start + len(IM_START + "user\n"):]
    return body[:body.find(IM_END)] if IM_END in body else body


class ScriptedLLM:
    def __init__(self, tokenizer, *, model_id: str = "scripted-qwen35", max_seq: int = 512):
        self.tokenizer = tokenizer
        self.config = scripted_config(tokenizer.n_vocab, 262144)
        self.model_id = model_id
        self.max_seq = max_seq
        self.chat_template = None           # render_chat's default Qwen3.5 template
        self.replies: dict[str, Reply] = {}
        self.calls: list[tuple[str, SamplingParams]] = []   # (prompt text, params) per stream started
        self.closed_early: list[str] = []   # keys of streams closed by the caller before their end
        self.max_active = 0
        self._active = 0
        self._lock = threading.Lock()
        self._im_end = tokenizer.token_id(IM_END)
        self.last_cached_tokens = 0         # as engine/llm.py reports it; the script reuses no state
        self.last_logprobs: list = []
        self.constraints: list = []         # the grammar each stream() was given (None for plain requests)

    def reply_for(self, prompt: str) -> tuple[str, Reply]:
        user = last_user_text(prompt)
        key = user if user is not None else prompt
        if key in self.replies:
            return key, self.replies[key]
        if user is None:
            return key, Reply(f" continued: {prompt[-20:]}")
        thinking = prompt.endswith("<think>\n")
        return key, Reply((f"Thinking about {user!r}.\n</think>\n\n" if thinking else "") + f"You said: {user}")

    def stream(self, prompt_ids: list[int], params: SamplingParams, constraint=None,
               snapshot_at: int | None = None) -> Iterator[int]:
        """The scripted reply; a grammar is recorded, not applied; each token has probability 1 (logprob 0)."""
        from ninfer_numba.engine.sampling import TokenLogprob
        self.constraints.append(constraint)
        self.last_logprobs = []
        prompt = self.tokenizer.decode(prompt_ids)
        key, reply = self.reply_for(prompt)
        ids = self.tokenizer.encode(reply.text) + ([self._im_end] if reply.end_of_turn else [])
        stops = params.stop_ids(self.tokenizer.eos_ids)
        with self._lock:
            self._active += 1
            self.max_active = max(self.max_active, self._active)
            self.calls.append((prompt, params))
        todo = ids[:params.max_tokens]
        last_sent = False   # closing after the final token is the normal end, not an early close
        try:
            for n, token_id in enumerate(todo):
                if reply.fail_at is not None and n == reply.fail_at:
                    raise RuntimeError("scripted engine failure")
                if reply.token_delay_s:
                    time.sleep(reply.token_delay_s)
                last_sent = token_id in stops or n + 1 == len(todo)
                if params.logprobs is not None:
                    self.last_logprobs.append(TokenLogprob(token_id, 0.0, ((token_id, 0.0),) * min(params.logprobs, 1)))
                yield token_id
                if token_id in stops:
                    break
        except GeneratorExit:
            if not last_sent:
                with self._lock:
                    self.closed_early.append(key)
            raise
        finally:
            with self._lock:
                self._active -= 1

    def scheduler(self, n_slots: int):
        from ninfer_numba.engine.scheduler import Scheduler
        self.slots = ScriptedSlots(self, n_slots)
        return Scheduler(self.slots)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._active == 0:
                    return True
            time.sleep(0.01)
        return False


class ScriptedSlots:
    """The replies as a slot decoder: prefill picks a slot's reply by its prompt and gives its first token, each
    step the next one (past the end of a reply the slot says <|im_end|>). A step sleeps the longest
    token_delay_s of its slots once (one batched forward) and raises at a slot's fail_at."""

    def __init__(self, llm: ScriptedLLM, n_slots: int):
        self.llm, self.n_slots, self.max_seq = llm, n_slots, llm.max_seq
        self.script: list[tuple[Reply, list[int]] | None] = [None] * n_slots
        self.made = [0] * n_slots                   # tokens each slot has given
        self.prompts: list[str] = []                # every prompt prefilled, in order
        self.batch_sizes: list[int] = []            # sequences in each step

    def reset(self, s: int) -> None:
        self.script[s], self.made[s] = None, 0

    def release(self, s: int) -> None:
        self.reset(s)

    def prefill(self, s: int, ids: list[int]) -> int:
        prompt = self.llm.tokenizer.decode(ids)
        _, reply = self.llm.reply_for(prompt)
        self.prompts.append(prompt)
        self.script[s] = (reply, self.llm.tokenizer.encode(reply.text) + [self.llm._im_end])
        return self._next(s)

    def step(self, slots: list[int], tokens: list[int]) -> list[int]:
        self.batch_sizes.append(len(slots))
        delay = max(self.script[s][0].token_delay_s for s in slots)
        if delay:
            time.sleep(delay)
        return [self._next(s) for s in slots]

    def _next(self, s: int) -> int:
        reply, ids = self.script[s]
        if reply.fail_at is not None and self.made[s] == reply.fail_at:
            raise RuntimeError("scripted engine failure")
        self.made[s] += 1
        return ids[self.made[s] - 1] if self.made[s] <= len(ids) else self.llm._im_end
