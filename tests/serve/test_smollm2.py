"""``llmc serve`` with the embedded SmolLM2-135M: tritonclient gRPC streaming, SSE, OpenAI chat and 16
concurrent streams all equal the offline runtime's greedy outputs."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine
from scripts.client_grpc_stream import stream_once
from tests.serve.conftest import start_server
from tests.serve.test_server import sse

pytestmark = pytest.mark.slow
PROMPTS = [f"Question {i}: what is the capital of {c}? Answer:" for i, c in enumerate(
    "France Spain Italy Japan Peru Chile Kenya Egypt India China Brazil Canada Mexico Norway Poland Greece".split())]


@pytest.fixture(scope="module")
def server(serve_smollm2_build):
    server = start_server(serve_smollm2_build)
    yield server
    server.close()


@pytest.fixture(scope="module")
def offline(server):
    """An offline engine over the server's runner (used only while the server is idle: they share the KV cache)."""
    return Engine(server.engine.runner, server.engine.tokenizer, server.engine.recipe, server.engine.eos_token_ids)


class TestEmbeddedModel:
    def test_grpc_and_sse_stream_the_greedy_text(self, server, offline):
        params = SamplingParams(max_new_tokens=16, temperature=0.0)
        expected = offline.generate([PROMPTS[0]], params)[0].text
        assert expected.strip()
        grpc_result = stream_once(server.grpc, "ensemble", PROMPTS[0], 16, temperature=0.0, out=io.StringIO())
        assert grpc_result["error"] is None and grpc_result["text"] == expected
        events = sse(server, f"/v2/models/{server.model}/generate_stream",
                     {"text_input": PROMPTS[0], "max_tokens": 16, "temperature": 0.0, "stream": True})
        assert "".join(e["text_output"] for e in events) == expected

    def test_openai_chat_uses_the_chat_template(self, server, offline):
        messages = [{"role": "user", "content": "What is 2+2?"}]
        expected = offline.generate([messages], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
        status, body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
        assert status == 200 and body["choices"][0]["message"]["content"] == expected.text
        assert body["usage"]["prompt_tokens"] == expected.metrics.prompt_tokens

    def test_sixteen_concurrent_streams(self, server, offline):
        expected = [c.text for c in offline.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))]
        body = lambda p: {"text_input": p, "max_tokens": 6, "temperature": 0.0, "stream": True}
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: sse(server, "/v2/models/ensemble/generate_stream", body(p)), PROMPTS))
        assert ["".join(e["text_output"] for e in events) for events in results] == expected
