"""Forced tool calls and JSON-schema answers through the server, counted: how many of N requests of each kind
come back valid against their schema, and what the grammar costs per token.

    python -m benchmarks.e2e.structured_output [--model models/q35-9b.gguf] [--backend cuda] [-n 100]

Without --model a tiny synthetic model with the real Qwen3.5 vocabulary is written to a temporary folder
and run on the CPU backend: a random model writes whatever the grammar allows, so every valid answer is the
grammar's doing. The schemas below have bounded values. The per-token cost is reported twice, both measured
in this run: the mean time of the grammar's mask (``TokenConstraint.allowed`` / ``bitmask``) next to the mean
decode step (what the grammar would add if the step waited for it), and the exposed cost: the wall time per
token of a constrained greedy answer against the same number of unconstrained tokens from the same prompt
(on cuda the mask is computed while the step's forward runs, so the exposed cost is the smaller one).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# The schemas and their validators (shared with tests/server/test_structured_output.py)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"]}}}
LIGHTS = {"type": "function", "function": {"name": "set_lights", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}}}}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "level", "n"], "additionalProperties": False}


def valid_answer(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"ok", "level", "n"} and isinstance(obj["ok"], bool)
            and obj["level"] in ("low", "high") and type(obj["n"]) is int and 0 <= obj["n"] <= 9)


def valid_call(name: str, args: dict) -> bool:
    if name == "get_weather":
        return (set(args) == {"unit", "days"} and args["unit"] in ("celsius", "fahrenheit")
                and type(args["days"]) is int and 1 <= args["days"] <= 7)
    return name == "set_lights" and set(args) <= {"on"} and all(isinstance(v, bool) for v in args.values())


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request number {i}: what now?"}]


KINDS = {
    "tool_choice required": dict(tools=[WEATHER, LIGHTS], tool_choice="required"),
    "tool_choice named": dict(tools=[WEATHER, LIGHTS],
                              tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "response_format json_schema": dict(response_format={"type": "json_schema",
                                                         "json_schema": {"name": "answer", "schema": ANSWER}}),
}


def _valid(kind: str, choice: dict) -> bool:
    msg = choice["message"]
    try:
        if kind.startswith("tool_choice"):
            calls = msg.get("tool_calls") or []
            return (choice["finish_reason"] == "tool_calls" and len(calls) == 1
                    and valid_call(calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"]))
                    and (kind != "tool_choice named" or calls[0]["function"]["name"] == "get_weather"))
        return choice["finish_reason"] == "stop" and valid_answer(json.loads(msg["content"]))
    except (ValueError, KeyError, TypeError):
        return False


def _timed_masks(llm, n_tokens: int) -> float:
    """Mean seconds of the grammar's per-token host work over n_tokens steps of a json_schema answer (greedy):
    the mask the engine asks for (packed for the device sampler on cuda, a bool array on the CPU)."""
    from ninfer_numba.config import SamplingParams
    from ninfer_numba.engine.constraint import json_constraint
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0)
    c = json_constraint(llm.tokenizer, ANSWER, params.stop_ids(llm.tokenizer.eos_ids))
    name = "bitmask" if llm.backend == "cuda" else "allowed"
    inner, spent, calls = getattr(c, name), [0.0], [0]

    def timed(*args):
        t0 = time.perf_counter()
        out = inner(*args)
        spent[0] += time.perf_counter() - t0
        calls[0] += 1
        return out
    setattr(c, name, timed)
    llm.generate(llm.tokenizer.encode("Answer:"), params, constraint=c)
    return spent[0] / max(calls[0], 1)


def _exposed_overhead(llm, reps: int = 7) -> float:
    """Median over reps of (constrained - unconstrained) / unconstrained wall time of a greedy answer: the
    constrained json_schema answer, then as many tokens without the grammar (eos ignored) from the same
    prompt. The prefix cache serves the prompt to both alike."""
    from ninfer_numba.config import SamplingParams
    from ninfer_numba.engine.constraint import json_constraint
    prompt = llm.tokenizer.encode("Answer:")
    ratios = []
    for _ in range(reps):
        params = SamplingParams(max_tokens=64, temperature=0.0)
        c = json_constraint(llm.tokenizer, ANSWER, params.stop_ids(llm.tokenizer.eos_ids))
        t0 = time.perf_counter()
        n = llm.generate(prompt, params, constraint=c).completion_tokens
        t1 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1) - 1.0)
    return sorted(ratios)[len(ratios) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: a tiny synthetic model, CPU backend)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("-n", type=int, default=100, help="requests of each kind")
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args(argv)
    from fastapi.testclient import TestClient

    from ninfer_numba.engine.llm import LLM
    from ninfer_numba.server.api import create_app
    with tempfile.TemporaryDirectory() as tmp:
        path, backend = a.model, a.backend
        if path is None:
            from ninfer_numba.synth import write_synthetic_gguf
            path, backend = str(write_synthetic_gguf(Path(tmp) / "tiny.gguf", "tiny", seed=0)), "cpu"
        llm = LLM(path, backend=backend, max_seq=1024)
        with TestClient(create_app(llm)) as http:
            for kind, extra in KINDS.items():
                ok, t0 = 0, time.perf_counter()
                for i in range(a.n):
                    r = http.post("/v1/chat/completions", json=dict(
                        model=llm.model_id, messages=ask(i), max_tokens=a.max_tokens, temperature=1.0, seed=i,
                        **extra))
                    ok += r.status_code == 200 and _valid(kind, r.json()["choices"][0])
                print(f"{kind:30s} {ok:4d} / {a.n} schema-valid  ({time.perf_counter() - t0:.1f} s)", flush=True)
        mask_s = _timed_masks(llm, 64)
        step_s = llm.bench_decode(32) / 32
        print(f"grammar mask {mask_s * 1e3:.3f} ms per token; decode step {step_s * 1e3:.3f} ms "
              f"({llm.backend}); overhead {mask_s / step_s:.1%} if the step waited for the mask")
        print(f"exposed: a constrained answer's wall time per token {_exposed_overhead(llm):+.1%} against "
              f"unconstrained tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
