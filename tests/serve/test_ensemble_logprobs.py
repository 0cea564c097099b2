"""The ensemble's ``return_log_probs`` input and its ``cum_log_probs`` / ``output_log_probs`` outputs on every
ensemble-speaking endpoint of ``llmc serve`` (tritonclient HTTP ``/infer``, gRPC ModelInfer and ModelStreamInfer,
the generate extension's JSON and SSE) and in the ``llmc`` Triton model. Values are compared with the offline
engine's ``SamplingParams(logprobs=0)`` log-probabilities; shapes and the stop-id rule are tensorrtllm_backend's
(llmc/serve/ensemble_logprobs.py)."""

from __future__ import annotations

import importlib.util
import queue

import numpy as np
import pytest

from llmc.request.params import SamplingParams
from llmc.serve.repo import template_root

PROMPTS = ["Tell me about rivers and lakes", "Write about the quiet mountains", "Stories of old trains"]
N = 8
DATATYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
             np.dtype(np.bool_): "BOOL"}


def reference(offline, prompt, n=N, **params):
    """The offline engine's greedy completion with each token's log-probability (a stop id's included)."""
    done = offline.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=0, **params))[0]
    assert len(done.logprobs) == len(done.token_ids)
    return done, [lp.logprob for lp in done.logprobs]


def inputs(module, prompt, n=N, **extra):
    """tritonclient InferInputs (http or grpc ``module``) for a greedy request; ``extra``: name -> numpy array."""
    arrays = {"text_input": np.array([[prompt.encode()]], dtype=np.object_), "max_tokens": np.array([[n]], np.int32),
              "temperature": np.array([[0.0]], np.float32), **extra}
    out = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), DATATYPES[array.dtype])
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def text_of(array):
    """The one string of a text_output tensor (tritonclient.http decodes JSON BYTES data to str, grpc to bytes)."""
    value = array.reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else value


def flag(value):
    return np.array([[value]], dtype=np.bool_)


def check_tensors(cum, output, expected_output, expected_cum):
    """The two outputs' dtypes, shapes ([batch, beams] and [batch, beams, tokens]) and values."""
    assert cum.dtype == np.float32 and output.dtype == np.float32
    assert cum.shape == (1, 1) and output.shape == (1, 1, len(expected_output))
    assert output[0, 0].tolist() == pytest.approx(expected_output, abs=1e-5)
    assert float(cum[0, 0]) == pytest.approx(expected_cum, abs=1e-5)


def grpc_stream(server, request_inputs, empty_final=True):
    """Every response of one ModelStreamInfer request (tritonclient's InferResult objects), the final one last."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("ensemble", request_inputs, request_id="lp", enable_empty_final_response=empty_final)
    responses = []
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        responses.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return responses


def as_list(value):
    """A generate-extension JSON tensor: one element is a number, more are a flat list (Triton's conversion)."""
    return [value] if isinstance(value, float) else value


def stop_id_case(offline):
    """(prompt, end_id, completion, log-probs) for a greedy run that ends on a stop id: the first token of a plain
    greedy output (after its first) that did not occur before it, for the first prompt that has one."""
    for prompt in PROMPTS:
        plain, _ = reference(offline, prompt)
        ids = list(plain.token_ids)
        fresh = [t for i, t in enumerate(ids) if i >= 1 and t not in ids[:i]]
        if fresh:
            done, values = reference(offline, prompt, stop_token_ids=(fresh[0],))
            assert (done.finish_reason, done.stop_reason) == ("stop", fresh[0]) and len(values) >= 2
            return prompt, fresh[0], done, values
    raise AssertionError("no prompt's greedy output has two different tokens; change PROMPTS")


def test_tritonclient_http_infer_returns_the_engines_log_probs(tiny_server, offline):
    import tritonclient.http as httpclient

    done, values = reference(offline, PROMPTS[0])
    assert done.finish_reason == "length"
    client = httpclient.InferenceServerClient(tiny_server.http.removeprefix("http://"))
    result = client.infer("ensemble", inputs(httpclient, PROMPTS[0], return_log_probs=flag(True)))
    assert text_of(result.as_numpy("text_output")) == done.text
    check_tensors(result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs"), values, sum(values))
    plain = client.infer("ensemble", inputs(httpclient, PROMPTS[0]))
    assert [o["name"] for o in plain.get_response()["outputs"]] == ["text_output"]
    off = client.infer("ensemble", inputs(httpclient, PROMPTS[0], return_log_probs=flag(False)))
    assert off.get_response() == plain.get_response()


def test_tritonclient_grpc_infer_returns_the_engines_log_probs(tiny_server, offline):
    import tritonclient.grpc as grpcclient

    done, values = reference(offline, PROMPTS[1])
    client = grpcclient.InferenceServerClient(tiny_server.grpc)
    result = client.infer("ensemble", inputs(grpcclient, PROMPTS[1], return_log_probs=flag(True)))
    assert text_of(result.as_numpy("text_output")) == done.text
    names = [o.name for o in result.get_response().outputs]
    assert names == ["text_output", "cum_log_probs", "output_log_probs"]
    assert [o.datatype for o in result.get_response().outputs][1:] == ["FP32", "FP32"]
    check_tensors(result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs"), values, sum(values))
    plain = client.infer("ensemble", inputs(grpcclient, PROMPTS[1]))
    assert [o.name for o in plain.get_response().outputs] == ["text_output"]
    off = client.infer("ensemble", inputs(grpcclient, PROMPTS[1], return_log_probs=flag(False)))
    assert off.get_response().SerializeToString() == plain.get_response().SerializeToString()
    client.close()


def test_grpc_stream_carries_every_token_so_far_in_each_response(tiny_server, offline):
    import tritonclient.grpc as grpcclient

    done, values = reference(offline, PROMPTS[2])
    stream = flag(True)
    responses = grpc_stream(tiny_server, inputs(grpcclient, PROMPTS[2], stream=stream, return_log_probs=flag(True)))
    texts = [r.as_numpy("text_output") for r in responses]
    assert sum(t is not None for t in texts) > 1, "the request was not streamed in several responses"
    seen = 0
    for result, text in zip(responses, texts):
        output, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
        assert output is not None and cum is not None  # every text response and the (otherwise empty) final one
        count = output.shape[2]
        assert count >= seen
        check_tensors(cum, output, values[:count], sum(values[:count]))
        seen = count
    assert seen == len(values)
    text = "".join(text_of(t) for t in texts if t is not None)
    assert text == done.text
    plain = grpc_stream(tiny_server, inputs(grpcclient, PROMPTS[2], stream=stream))
    assert all([o.name for o in r.get_response().outputs] in ([], ["text_output"]) for r in plain)


def test_grpc_stream_without_stream_flag_sends_one_text_response_with_all_values(tiny_server, offline):
    import tritonclient.grpc as grpcclient

    done, values = reference(offline, PROMPTS[0])
    responses = grpc_stream(tiny_server, inputs(grpcclient, PROMPTS[0], return_log_probs=flag(True)),
                            empty_final=False)
    (result,) = responses
    assert text_of(result.as_numpy("text_output")) == done.text
    check_tensors(result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs"), values, sum(values))


def test_generate_json_and_sse_carry_the_log_probs(tiny_server, offline):
    from tests.serve.test_server import sse

    done, values = reference(offline, PROMPTS[1])
    body = {"text_input": PROMPTS[1], "max_tokens": N, "temperature": 0.0}
    status, reply = tiny_server.post("/v2/models/ensemble/generate", {**body, "return_log_probs": True})
    assert status == 200 and reply["text_output"] == done.text
    assert list(reply)[:5] == ["model_name", "model_version", "text_output", "cum_log_probs", "output_log_probs"]
    assert as_list(reply["output_log_probs"]) == pytest.approx(values, abs=1e-5)
    assert reply["cum_log_probs"] == pytest.approx(sum(values), abs=1e-5)
    events = sse(tiny_server, "/v2/models/ensemble/generate_stream", {**body, "stream": True, "return_log_probs": True})
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == done.text
    seen = 0
    for event in events:
        got = as_list(event["output_log_probs"])
        assert len(got) >= seen and got == pytest.approx(values[:len(got)], abs=1e-5)
        assert event["cum_log_probs"] == pytest.approx(sum(values[:len(got)]), abs=1e-5)
        seen = len(got)
    assert seen == len(values)
    # Triton's generate extension writes a one-element tensor as a number: a one-token output's list is one.
    status, one = tiny_server.post("/v2/models/ensemble/generate", {**body, "max_tokens": 1, "return_log_probs": True})
    assert status == 200 and isinstance(one["output_log_probs"], float) and isinstance(one["cum_log_probs"], float)
    assert one["output_log_probs"] == pytest.approx(values[0], abs=1e-5) == one["cum_log_probs"]


def test_omitting_return_log_probs_leaves_generate_responses_unchanged(tiny_server):
    from tests.serve.test_server import sse

    body = {"text_input": PROMPTS[2], "max_tokens": N, "temperature": 0.0}
    status, plain = tiny_server.post("/v2/models/ensemble/generate", body)
    assert status == 200
    assert set(plain) == {"model_name", "model_version", "text_output", "finish_reason", "stop_reason",
                          "prompt_tokens", "completion_tokens"}
    assert tiny_server.post("/v2/models/ensemble/generate", {**body, "return_log_probs": False}) == (200, plain)
    plain_events = sse(tiny_server, "/v2/models/ensemble/generate_stream", {**body, "stream": True})
    off_events = sse(tiny_server, "/v2/models/ensemble/generate_stream",
                     {**body, "stream": True, "return_log_probs": False})
    assert off_events == plain_events and not any("output_log_probs" in e for e in plain_events)


def test_a_stop_id_is_not_an_output_token_and_has_no_log_prob(tiny_server, offline):
    """TensorRT-LLM does not advance the sequence length for the end token, and (one beam) returns neither its
    log-probability nor a cum_log_probs that includes it: both cover the output tokens only."""
    import tritonclient.grpc as grpcclient

    prompt, end_id, done, values = stop_id_case(offline)
    body = {"text_input": prompt, "max_tokens": N, "temperature": 0.0, "end_id": end_id, "return_log_probs": True}
    status, reply = tiny_server.post("/v2/models/ensemble/generate", body)
    assert status == 200 and reply["text_output"] == done.text and reply["stop_reason"] == end_id
    assert as_list(reply["output_log_probs"]) == pytest.approx(values[:-1], abs=1e-5)
    assert reply["cum_log_probs"] == pytest.approx(sum(values[:-1]), abs=1e-5)
    assert abs(sum(values) - sum(values[:-1])) > 1e-4  # the stop id's term would show
    extra = {"end_id": np.array([[end_id]], np.int32), "return_log_probs": flag(True), "stream": flag(True)}
    final = grpc_stream(tiny_server, inputs(grpcclient, prompt, **extra))[-1]
    check_tensors(final.as_numpy("cum_log_probs"), final.as_numpy("output_log_probs"), values[:-1],
                  sum(values[:-1]))


@pytest.mark.parametrize("value", ["yes", 1, 0.5, [True, False]])
def test_a_non_bool_return_log_probs_is_a_400_naming_it(tiny_server, value):
    body = {"text_input": "hi", "max_tokens": 2, "return_log_probs": value}
    for path in ("generate", "generate_stream"):
        status, reply = tiny_server.post(f"/v2/models/ensemble/{path}", body)
        assert status == 400 and "return_log_probs" in reply["error"], reply


def test_a_wrong_datatype_is_refused_on_infer_and_grpc(tiny_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    tensor = {"name": "return_log_probs", "datatype": "INT32", "shape": [1, 1], "data": [1]}
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [2]}, tensor]}
    status, reply = tiny_server.post("/v2/models/ensemble/infer", body)
    assert status == 400 and "return_log_probs" in reply["error"] and "BOOL" in reply["error"], reply
    client = grpcclient.InferenceServerClient(tiny_server.grpc)
    with pytest.raises(InferenceServerException, match="return_log_probs.*BOOL") as info:
        client.infer("ensemble", inputs(grpcclient, "hi", 2, return_log_probs=np.array([[1]], np.int32)))
    assert "INVALID_ARGUMENT" in str(info.value.status())
    client.close()


def test_metadata_lists_the_input_and_both_outputs(tiny_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http_meta = httpclient.InferenceServerClient(tiny_server.http.removeprefix("http://")).get_model_metadata(
        "ensemble")
    grpc_meta = grpcclient.InferenceServerClient(tiny_server.grpc).get_model_metadata("ensemble", as_json=True)
    for meta in (http_meta, grpc_meta):
        ins = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in meta["inputs"]}
        outs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in meta["outputs"]}
        assert ins["return_log_probs"] == ("BOOL", [-1, 1])
        assert outs == {"text_output": ("BYTES", [-1, -1]), "cum_log_probs": ("FP32", [-1, -1]),
                        "output_log_probs": ("FP32", [-1, -1, -1])}


class _PbUtils:
    """Stands in for triton_python_backend_utils in the ``llmc`` model's sink: tensors and responses as plain
    objects."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.tensors = {t.name: t.array for t in output_tensors}
            self.error = error

    class TritonError(Exception):
        pass


def test_the_llmc_triton_model_sends_the_log_probs(offline):
    """model_repo/llmc/1/model.py's engine callback, fed the offline engine's real events."""
    from llmc.serve.protocol import parse_generate_fields

    spec = importlib.util.spec_from_file_location("llmc_triton_model", template_root() / "llmc" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt, end_id, done, values = stop_id_case(offline)
    fields = {"text_input": prompt, "max_tokens": N, "temperature": 0.0, "end_id": end_id, "stream": True,
              "return_log_probs": True}
    req = parse_generate_fields(fields, offline.default_params, offline.runner.vocab_size, allow_extras=False)
    sent = []
    sink = module.TritonPythonModel._sink(type("Sender", (), {"send": lambda self, r, flags=0: sent.append(
        (r, flags))})(), req, _PbUtils)
    for event in offline.stream(req.prompt, req.params):
        sink(event)
    *responses, (last, flags) = sent
    assert last is None and flags == _PbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert "".join(r.tensors["text_output"][0, 0].decode() for r, _ in responses) == done.text
    final = responses[-1][0].tensors
    check_tensors(final["cum_log_probs"], final["output_log_probs"], values[:-1], sum(values[:-1]))
    for response, _ in responses:
        count = response.tensors["output_log_probs"].shape[2]
        assert response.tensors["output_log_probs"][0, 0].tolist() == pytest.approx(values[:count], abs=1e-5)
