"""The prefix cache through the server's batched path (the tiny model on the CPU backend): requests sharing a
system prompt reuse its snapshot and report it as ``usage.prompt_tokens_details.cached_tokens``; under a small
budget older snapshots are evicted, a request whose prefix was evicted prefills it again, and every answer
equals a cache-less server's."""
from __future__ import annotations

import pytest

MODEL = "tiny"
# ~200 tokens: past the prefix cache's min_gain (128), so the system turn's end is a snapshot cut
SYSTEM = " ".join(["You answer in short sentences about rivers, stones, lanterns and orbits."] * 14)


@pytest.fixture(scope="module")
def servers(serve_llm, tiny_model):
    """The tiny model with three slots, served without a prefix cache and with one."""
    from ninfer_numba.engine.llm import LLM
    plain = serve_llm(LLM(tiny_model, backend="cpu", max_seq=512, prefix_cache_mb=0), batch_slots=3)
    cached = serve_llm(LLM(tiny_model, backend="cpu", max_seq=512, prefix_cache_mb=1), batch_slots=3)
    return plain, cached


def ask(server, user: str, system: str | None = SYSTEM) -> tuple[str, int]:
    """A greedy chat of 3 tokens (ignore_eos): (its text, the usage's cached_tokens)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                extra_body={"ignore_eos": True})
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content or "", details.cached_tokens if details else 0


def cache_of(server):
    return server.app.state.server.worker.llm.prefix_cache


def test_shared_system_prompt_hits_then_evictions_force_a_full_prefill(servers):
    plain, cached = servers
    cache = cache_of(cached)
    first = ask(cached, "first question")
    assert first[1] == 0 and cache.misses >= 1 and len(cache) >= 2      # the system turn's cut and the prompt
    second = ask(cached, "second question")
    assert second[1] >= 128 and cache.hits >= 1                          # the system turn came from the cache
    assert [first[0], second[0]] == [ask(plain, "first question")[0], ask(plain, "second question")[0]]

    # room for about two snapshots: distinct prompts push the shared prefix's snapshot out
    cache.budget_bytes = 2 * max(s.nbytes for s in cache._entries.values()) + 1
    for i in range(4):
        ask(cached, f"unrelated {i}", system=f"Another system prompt number {i}.")
    assert cache.evictions >= 2 and cache.nbytes <= cache.budget_bytes
    again = ask(cached, "third question")
    assert again[1] == 0                                                 # evicted: prefilled in full
    assert again[0] == ask(plain, "third question")[0]
