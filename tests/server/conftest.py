"""Fixtures for the server tests: the real Qwen3.5 tokenizer, a scripted engine, and live uvicorn servers on
127.0.0.1 (a free port picked by the OS) driven through the real `openai` client."""
from __future__ import annotations

import socket
import threading
import time

import openai
import pytest
import uvicorn

from ninfer_numba.server.api import create_app
from tests.server.scripted_llm import ScriptedLLM


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from ninfer_numba.formats.qwen_vocab import qwen35_vocab_metadata
    from ninfer_numba.formats.tokenizer import Tokenizer
    return Tokenizer.from_gguf_kv(qwen35_vocab_metadata())


class LiveServer:
    """uvicorn serving `app` from a background thread, on a socket bound before the server starts."""

    def __init__(self, app):
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        # max_retries=0: a 5xx must show up in the test, not be retried away.
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30, **kwargs)


@pytest.fixture(scope="module")
def serve_llm():
    """Factory: serve_llm(llm, **create_app_kwargs) -> a started LiveServer, stopped at module end."""
    servers: list[LiveServer] = []

    def start(llm, **kwargs) -> LiveServer:
        server = LiveServer(create_app(llm, **kwargs)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def scripted(qwen_tokenizer) -> ScriptedLLM:
    return ScriptedLLM(qwen_tokenizer)


@pytest.fixture(scope="module")
def live(serve_llm, scripted) -> LiveServer:
    return serve_llm(scripted)


@pytest.fixture
def client(live) -> openai.OpenAI:
    return live.client()
