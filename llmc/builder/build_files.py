"""Files of a build folder made from the source model: the tokenizer folder (with the build's chat template and
reconciled eos) and the manifest. The pipeline and self-generated calibration (which writes a small build folder
of the 16-bit model) both use them."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from llmc import manifest as mf
from llmc.errors import BuildError
from llmc.recipe import Recipe, recipe_to_dict
from llmc.source import load
from llmc.tokenizer import byte_level_decoder, portable_tokenizer_config

# Files of an HF folder that make up its tokenizer (copied when ``save_pretrained`` is not enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def export_tokenizer(source: load.SourceModel, out: Path) -> None:
    """Copy the tokenizer files into ``out`` with the build's chat template and reconciled eos.

    ``tokenizer_config.json``'s eos token becomes the first reconciled id, ``chat_template.jinja`` holds the
    build's template, and ``generation_config.json`` records the whole reconciled list, so every consumer
    stops on the same ids. A byte-level BPE whose decoder is a chain of byte-fallback and ByteLevel steps (a
    GGUF conversion's) gets its ByteLevel decoder alone, where every token decodes as before: guided decoding
    over the build's tokenizer.json (llguidance's, TensorRT-LLM's) then reads spaces as spaces. The config is
    written so that transformers 4 and 5 load and decode it alike (:func:`portable_tokenizer_config`).
    """
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source.hf_dir / name).exists():
            shutil.copy2(source.hf_dir / name, out / name)
    if (out / "tokenizer.json").exists():
        _plain_byte_level_decoder(out / "tokenizer.json")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if source.chat_template is not None:
        (out / "chat_template.jinja").write_text(source.chat_template)
        config.pop("chat_template", None)  # one place for the template: chat_template.jinja
    if source.eos_token_ids:
        _set_eos_token(config, _token_string(out / "tokenizer.json", source.eos_token_ids[0]),
                       source.eos_token_ids[0])
    if (out / "tokenizer.json").exists():
        config = portable_tokenizer_config(config, (out / "tokenizer.json").read_text(encoding="utf-8"))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen_path = source.hf_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = list(source.eos_token_ids)
    if source.bos_token_id is not None:
        gen["bos_token_id"] = source.bos_token_id
    if source.pad_token_id is not None:
        gen["pad_token_id"] = source.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def make_tokenizer_portable(folder: Path) -> None:
    """Rewrite ``folder``'s tokenizer_config.json with :func:`portable_tokenizer_config` where that changes it
    (a tokenizer ``--from-ir`` copied from a build made before :func:`export_tokenizer` wrote it so)."""
    config_path, tokenizer_json = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_json.is_file()):
        return
    config = json.loads(config_path.read_text())
    portable = portable_tokenizer_config(config, tokenizer_json.read_text(encoding="utf-8"))
    if portable != config:
        config_path.write_text(json.dumps(portable, indent=2, sort_keys=True) + "\n")


def _plain_byte_level_decoder(tokenizer_json: Path) -> None:
    """Rewrite ``tokenizer_json`` (the build's copy) with :func:`byte_level_decoder`'s decoder where it changes."""
    text = tokenizer_json.read_text(encoding="utf-8")
    plain = byte_level_decoder(text)
    if plain != text:
        tokenizer_json.write_text(plain, encoding="utf-8")


def _token_string(tokenizer_json: Path, token_id: int) -> str:
    """The text of token ``token_id`` in a tokenizer.json."""
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(tokenizer_json)).id_to_token(token_id)
    if token is None:
        raise BuildError(f"eos id {token_id} is outside the tokenizer's vocabulary ({tokenizer_json}). Fix: "
                         f"correct model.eos_token_ids in the recipe")
    return token


def _set_eos_token(config: dict[str, Any], token: str, token_id: int) -> None:
    """Point a tokenizer_config's eos token at ``token`` (plain string or AddedToken dict form)."""
    current = config.get("eos_token")
    if isinstance(current, dict):
        config["eos_token"] = {**current, "content": token}
    else:
        config["eos_token"] = token
    if "eos_token_id" in config:
        config["eos_token_id"] = token_id


def make_manifest(recipe: Recipe, recipe_sha: str, source: load.SourceModel, timings: dict[str, float]) -> mf.Manifest:
    """The manifest of a build of ``recipe`` from ``source``."""
    recipe_dict = recipe_to_dict(recipe)
    return mf.Manifest(
        name=recipe.name,
        recipe=recipe_dict,
        recipe_sha256=recipe_sha,
        backend=recipe.backend,
        dtype=recipe.model.dtype,
        quantization=recipe_dict["quantization"],
        eos_token_ids=tuple(source.eos_token_ids),
        special_token_ids=tuple(source.special_token_ids),
        source={"kind": source.kind, "origin": str(source.origin), "spec": str(recipe.model.source),
                "sha256": source.sha256},
        model={k: source.hf_config.get(k) for k in mf.SHAPE_KEYS},
        tools=mf.tool_versions(),
        timings=timings,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        eos_warnings=tuple(source.eos_warnings),
    )
