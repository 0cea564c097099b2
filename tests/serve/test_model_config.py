"""The served model's Triton ModelConfig (``GET /v2/models/<m>/config``, gRPC ``ModelConfig``): what Triton's tools
read before their first request (perf_analyzer and genai-perf exit without it; they check every config input
against the metadata, drop the batch dim when ``max_batch_size`` > 0, and stream only from decoupled models)."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from llmc.serve.pbtxt import read_config
from llmc.serve.repo import generate_model_repo

WIRE = {"TYPE_STRING": "BYTES"}


def configs(server, name: str) -> list[dict]:
    http = httpclient.InferenceServerClient(server.http.removeprefix("http://")).get_model_config(name)
    grpc = grpcclient.InferenceServerClient(server.grpc).get_model_config(name, as_json=True)["config"]
    return [http, grpc]


@pytest.mark.parametrize("name", ["ensemble", "tensorrt_llm_bls", None])
def test_http_and_grpc_give_the_config_perf_analyzer_reads(tiny_server, name):
    name = name or tiny_server.model
    http, grpc = configs(tiny_server, name)
    assert http["name"] == grpc["name"] == name and http["backend"] == "llmc" and http["platform"] == ""
    assert int(http["max_batch_size"]) == int(grpc["max_batch_size"]) == 1  # one prompt per request
    assert http["model_transaction_policy"] == grpc["model_transaction_policy"] == {"decoupled": True}
    for config in (http, grpc):
        assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]], t.get("optional", False))
                for t in config["input"]] == [(t["name"], t["data_type"], t["dims"], t["optional"])
                                              for t in http["input"]]
    meta = httpclient.InferenceServerClient(tiny_server.http.removeprefix("http://")).get_model_metadata(name)
    shapes = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"] + meta["outputs"]}
    for tensor in http["input"] + http["output"]:  # perf_analyzer: each in the metadata, batch dim dropped
        datatype = WIRE.get(tensor["data_type"], tensor["data_type"].removeprefix("TYPE_"))
        assert shapes[tensor["name"]] == (datatype, [-1, *tensor["dims"]])
    required = [t["name"] for t in http["input"] if not t["optional"]]
    assert required == ["text_input", "max_tokens"]  # genai-perf sends both; every other input may be left out


def test_the_server_metadata_lists_the_extension_and_no_statistics(tiny_server):
    http = httpclient.InferenceServerClient(tiny_server.http.removeprefix("http://")).get_server_metadata()
    grpc = grpcclient.InferenceServerClient(tiny_server.grpc).get_server_metadata(as_json=True)
    for meta in (http, grpc):
        assert "model_configuration" in meta["extensions"] and "generate" in meta["extensions"]
        assert "statistics" not in meta["extensions"]  # perf_analyzer asks for no server-side statistics then


def test_an_unknown_model_has_no_config(tiny_server):
    assert tiny_server.get("/v2/models/nope/config")[0] == 404
    with pytest.raises(InferenceServerException, match="nope"):
        grpcclient.InferenceServerClient(tiny_server.grpc).get_model_config("nope")


def test_it_describes_the_tensors_of_the_triton_repositorys_llmc_model(tiny_server, serve_tiny_build, tmp_path):
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo")
    written = json_format.MessageToDict(read_config(repo / tiny_server.model), preserving_proto_field_name=True)
    served = configs(tiny_server, "ensemble")[1]
    for key in ("input", "output", "model_transaction_policy"):
        assert served[key] == written[key], key
