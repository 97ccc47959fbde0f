"""Prefix reuse as clients see it, through the server: a chat's second turn after another client's request,
and many clients sharing one long system prompt.

    python -m benchmarks.e2e.prefix_gate [--model models/q35-9b-vocab.gguf --backend cuda] [--history 8192]
                                         [--clients 16]

Turn 1: a system prompt and a user message of about --history tokens; then another client's short chat
(the engine's live state is replaced); then turn 2: turn 1's messages, its answer and a short question.
The same three requests run first on another text, so the timed ones find every kernel compiled.
Each is streamed: time to the first generated text, and the usage's prompt and cached tokens. Then
--clients clients, each the same --history-token system prompt and its own short question: how many prompt
tokens each reused and how many were prefilled in all. Without --model: the tiny synthetic model on the
CPU with --history 600 (the mechanism, not the timing).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.e2e.server_stream import chat_deltas

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly".split()


def text_of(tokenizer, n: int, start: int = 0) -> str:
    """A text of n tokens (cut from a longer one at a token boundary); another start, another text."""
    text = " ".join(WORDS[(i + start) % len(WORDS)] for i in range(2 * n))
    return tokenizer.decode(tokenizer.encode(text)[:n])


def ask(http, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: seconds to the first generated text, the text, the usage."""
    body = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
    t0 = time.perf_counter()
    deltas, usage = chat_deltas(http, body)
    pieces = [(t, d) for t, d in deltas if d.get("content") or d.get("reasoning_content")]
    first = pieces[0][0] - t0 if pieces else None
    parts = [d.get("content") or "" for _, d in deltas]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft": first if first is not None else time.perf_counter() - t0, "text": "".join(parts),
            "prompt": usage["prompt_tokens"], "cached": cached, "timings": usage.get("timings")}


def phases(t: dict | None) -> str:
    """The server's timings of one request (worker.JobOutput.timings), in one parenthesis."""
    if not t:
        return ""
    return (f" (server: prepare {t['prepare_ms']:.1f}, queue {t['queue_ms']:.1f}, prefill {t['prefill_ms']:.1f} "
            f"ms to its first token)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file with a vocabulary (default: a tiny synthetic model, CPU)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--history", type=int, default=None, help="tokens of the long message (default 8192; tiny: 600)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    from fastapi.testclient import TestClient

    from ninfer_numba.engine.llm import LLM
    from ninfer_numba.server.api import create_app
    with tempfile.TemporaryDirectory() as tmp:
        path, backend, history = a.model, a.backend, a.history or 8192
        if path is None:
            from ninfer_numba.synth import write_synthetic_gguf
            path, backend, history = str(write_synthetic_gguf(Path(tmp) / "tiny.gguf", "tiny", seed=0)), "cpu", \
                a.history or 600
        llm = LLM(path, backend=backend, max_seq=history + 1024)
        long_text, model = text_of(llm.tokenizer, history), llm.model_id
        with TestClient(create_app(llm)) as http:
            def two_turns(text: str) -> tuple[dict, dict]:
                first = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]
                t1 = ask(http, model, first, a.max_tokens)
                ask(http, model, [{"role": "user", "content": "Something else entirely."}], a.max_tokens)
                second = first + [{"role": "assistant", "content": t1["text"] or "Yes."},
                                  {"role": "user", "content": "And then?"}]
                return t1, ask(http, model, second, a.max_tokens)
            # once on another text first: every kernel compiled and graph captured before the timed turns
            two_turns(text_of(llm.tokenizer, history, start=3))
            t1, t2 = two_turns(long_text)
            print(f"turn 1: {t1['prompt']} prompt tokens, {t1['cached']} cached, first token after "
                  f"{t1['ttft'] * 1e3:.1f} ms{phases(t1['timings'])}")
            print(f"turn 2 (after another client): {t2['prompt']} prompt tokens, {t2['cached']} cached, first "
                  f"token after {t2['ttft'] * 1e3:.1f} ms = {t2['ttft'] / t1['ttft']:.1%} of turn 1's"
                  f"{phases(t2['timings'])}")
            runs = [ask(http, model, [{"role": "system", "content": long_text},
                                      {"role": "user", "content": f"Client {i}: what now?"}], a.max_tokens)
                    for i in range(a.clients)]
            prefilled = sum(r["prompt"] - r["cached"] for r in runs)
            print(f"{a.clients} clients sharing a {history}-token system prompt: cached tokens "
                  f"{[r['cached'] for r in runs]}; prompt tokens prefilled in all {prefilled} of "
                  f"{sum(r['prompt'] for r in runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
