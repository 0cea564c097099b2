"""``llmc serve`` loading a build: the ``--max-queue-size`` override, the ``--metrics-log`` of its steps, TensorRT-LLM
builds refused in one line, and a port in use as one ``error:`` line (exit 2, never a traceback).

A TensorRT-LLM build used to reach ``Engine(engine.runner, ...)`` with TensorRT-LLM's runner, which has no
``num_blocks``: an AttributeError traceback instead of an answer.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from llmc.cli import main
from llmc.engine.tensorrt_llm.runner import TrtllmRunner
from llmc.errors import EngineError
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine
from llmc.serve.run import load_engine, with_max_queue_size
from tests.serve.conftest import free_port
from tests.engine.tensorrt_llm.test_engine import open_engine, trt_build_dir  # noqa: F401 - a fixture

TRITON_FIX = r"TensorRT-LLM build, which llmc serve cannot run\. Fix: .*tritonserver --model-repository"


def test_max_queue_size_overrides_the_recipe(tiny_build_dir):
    engine = load_engine(tiny_build_dir, "cpu", max_queue_size=3)
    try:
        assert engine.recipe.serving.max_queue_size == 3 and engine.scheduler.waiting.max_size == 3
    finally:
        engine.shutdown()


def test_speculative_tokens_and_the_loaded_engines_overrides_survive_a_queue_size_override(tiny_build_dir, tmp_path):
    """``llmc serve --speculative-tokens``: the engine drafts; ``--max-queue-size`` / ``--metrics-log`` make a new
    engine over the same runner, which keeps the loaded one's drafts, prefix caching and step budget."""
    engine = load_engine(tiny_build_dir, "cpu", max_queue_size=3, metrics_log=tmp_path / "m.jsonl",
                         speculative_tokens=4)
    try:
        assert engine.scheduler.speculator.num_draft == 4 and engine.scheduler.waiting.max_size == 3
        base = Engine.from_dir(tiny_build_dir, device="cpu", prefix_caching=False, mixed_step_tokens=64,
                               speculative_tokens=2)
        copy = with_max_queue_size(base, 5)
        assert (copy.scheduler.speculator.num_draft, copy.block_manager.enable_prefix_caching,
                copy.scheduler.max_mixed_tokens) == (2, False, 64)
        done = engine.generate(["Hello there"], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        assert len(done[0].token_ids) == 16 and engine.stats()["draft_tokens"] > 0
    finally:
        engine.shutdown()
    plain = load_engine(tiny_build_dir, "cpu")
    try:
        assert plain.scheduler.speculator is None  # the tiny build's recipe: off
    finally:
        plain.shutdown()


def test_a_tensorrt_llm_engine_with_max_queue_size_is_one_clear_error(trt_build_dir):  # noqa: F811
    engine, _ = open_engine(trt_build_dir, [[5]])  # TensorRT-LLM's runner over the ModelRunnerCpp test double
    assert isinstance(engine.runner, TrtllmRunner)
    for size in (4, None):
        with pytest.raises(EngineError, match=TRITON_FIX):
            with_max_queue_size(engine, size)


def test_engine_refuses_a_runner_it_cannot_step(trt_build_dir):  # noqa: F811
    engine, _ = open_engine(trt_build_dir, [[5]])
    with pytest.raises(EngineError, match="Engine drives step runners .* not a TrtllmRunner. Fix: open the build"):
        Engine(engine.runner, engine.tokenizer, engine.recipe, engine.eos_token_ids)


def test_llmc_serve_on_a_tensorrt_llm_build_says_so_in_one_line(trt_build_dir, capsys):  # noqa: F811
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(trt_build_dir), "--max-queue-size", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "tritonserver --model-repository" in err and "Traceback" not in err


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_port_in_use_is_one_error_line(serve_tiny_build, which):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        port, grpc_port = (busy, free_port()) if which == "http" else (free_port(), busy)
        proc = subprocess.run([sys.executable, "-m", "llmc.cli", "serve", str(serve_tiny_build), "--device", "cpu",
                               "--port", str(port), "--grpc-port", str(grpc_port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: cannot ") and str(busy) in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("--port" if which == "http" else "--grpc-port") in lines[-1]


@pytest.mark.parametrize("max_queue_size", [None, 3])
def test_metrics_log_records_the_served_steps(tiny_build_dir, tmp_path, max_queue_size):
    log = tmp_path / "serve.jsonl"
    log.write_text('{"type": "earlier run"}\n')  # a server appends: an earlier run's records stay
    engine = load_engine(tiny_build_dir, "cpu", max_queue_size=max_queue_size, metrics_log=log)
    try:
        assert engine.scheduler.waiting.max_size == (max_queue_size or engine.recipe.serving.max_queue_size)
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))
    finally:
        engine.shutdown()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0] == {"type": "earlier run"}
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 3 and steps[0]["prefill_tokens"] == 3 and steps[-1]["decode_tokens"] == 1
    assert [r["generated_tokens"] for r in records if r["type"] == "request"] == [3]


def test_serve_passes_the_metrics_log_and_speculative_tokens(monkeypatch, tmp_path, tiny_build_dir):
    from click.testing import CliRunner

    import llmc.serve.run as run_module
    from llmc.serve.commands import serve_cmd

    seen = {}

    def fake_load(build_dir, device, max_queue_size, metrics_log=None, speculative_tokens=None):
        seen["metrics_log"], seen["speculative_tokens"] = metrics_log, speculative_tokens
        raise EngineError("stop here")

    monkeypatch.setattr(run_module, "load_engine", fake_load)
    result = CliRunner().invoke(serve_cmd, [str(tiny_build_dir), "--metrics-log", str(tmp_path / "m.jsonl"),
                                            "--speculative-tokens", "3"])
    assert isinstance(result.exception, EngineError) and seen == {"metrics_log": tmp_path / "m.jsonl",
                                                                  "speculative_tokens": 3}
