"""``kv_cache.dtype: fp8``: the per-layer scales of the FP8 KV cache, calibrated on the model that ships.

The engines store a layer's keys (after RoPE) and values as float8 e4m3 of ``x / scale``, one scale per layer for
both (TensorRT-LLM's ``kv_cache_scaling_factor``, :mod:`llmc.checkpoint.kv_scales`). This step loads the IR's
weights (int4 layers dequantized: what the engines compute) into the Hugging Face model, runs calibration text
through it and sets each layer's scale to the largest magnitude of its keys and values divided by 448 (e4m3's
largest finite value), so nothing the calibration saw is clipped. Unlike AWQ's statistics, special tokens are
*included*: the cache stores their keys and values too (BOS and chat headers carry the largest ones), and a
scale that left them out would clip exactly those. The text: pydoc windows of the calibration partition and the
chat template's rendering of calibration seed prompts (never the gate's held-out text).

Then the cost is measured on held-out text: per-position KL between the same weights with a 16-bit and with an
fp8 cache (both through transformers' SDPA; fp8 emulated as the engines store and read it). The accuracy gate of a
quantized build scores its int4 weights with the fp8 cache (:class:`llmc.builder.verify.GateModels`); a 16-bit
build fails here where that KL's mean exceeds ``quantization.gate.max_mean_kl`` (gate enabled).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from llmc.builder import calib_text, heldout, seed_prompts
from llmc.builder.devices import describe_device, free_gpu_memory, resolve_build_device
from llmc.builder.hf_kv import observing, use_fp8_cache
from llmc.builder.verify import gate_dtype, hf_state_dict
from llmc.checkpoint import kv_scales
from llmc.checkpoint.io import read_checkpoint, write_checkpoint
from llmc.engine.torch.kv_store import FP8_MAX
from llmc.errors import BuildError

CALIB_WINDOWS, CALIB_CHATS, WINDOW = 8, 8, 512
HELDOUT_TOKENS = 1024  # per gate domain, for the 16-bit vs fp8 cache KL


def calibration_sequences(tokenizer: Any, chat_template: str | None) -> list[list[int]]:
    """Token ids of the calibration text: CALIB_WINDOWS pydoc windows of WINDOW tokens (the tokenizer's special
    tokens added) and CALIB_CHATS seed prompts in the chat template (where the model has one)."""
    text = "\n\n".join(p for doc in calib_text.pydoc_calibration_docs() for p in doc)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]  # BOS where the tokenizer adds one
    body = WINDOW - len(prefix)
    sequences = [prefix + ids[i * body:(i + 1) * body] for i in range(CALIB_WINDOWS) if (i + 1) * body <= len(ids)]
    if chat_template is not None:
        for prompt in seed_prompts.all_prompts()[:CALIB_CHATS]:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True, chat_template=chat_template)
            sequences.append(tokenizer(rendered, add_special_tokens=False)["input_ids"][:WINDOW])
    return [s for s in sequences if s]


@torch.no_grad()
def calibrate(model: torch.nn.Module, sequences: list[list[int]], device: torch.device) -> list[float]:
    """Each layer's scale: the largest |key| and |value| over ``sequences`` / 448 (a layer that saw only zeros
    gets 1.0)."""
    with observing(model) as states:
        for ids in sequences:
            model(input_ids=torch.tensor([ids], device=device))
    return [float(state.amax.max()) / FP8_MAX if float(state.amax.max()) > 0 else 1.0 for state in states]


@torch.no_grad()
def cache_kl(model: torch.nn.Module, windows: dict[str, torch.Tensor], scales: list[float], device: torch.device
             ) -> dict[str, dict[str, float]]:
    """Per domain: KL(16-bit cache || fp8 cache) per position (mean, p99, max) and top-1 agreement."""
    out = {}
    for name, rows in windows.items():
        kls, agree = [], []
        for ids in rows:
            batch = ids[None].to(device)
            use_fp8_cache(model, None)
            p16 = torch.log_softmax(model(input_ids=batch).logits[0].float(), -1)
            use_fp8_cache(model, scales)
            p8 = torch.log_softmax(model(input_ids=batch).logits[0].float(), -1)
            kls.append((p16.exp() * (p16 - p8)).sum(-1).cpu())
            agree.append((p16.argmax(-1) == p8.argmax(-1)).float().cpu())
        kl = torch.cat(kls)
        out[name] = {"mean_kl": float(kl.mean()), "p99_kl": float(kl.quantile(0.99)), "max_kl": float(kl.max()),
                     "top1_agreement": float(torch.cat(agree).mean()), "tokens": int(kl.numel())}
    use_fp8_cache(model, None)
    return out


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (a HF state dict) into ``model``'s parameters; a tied lm_head may be absent."""
    for key, param in model.named_parameters(remove_duplicate=False):
        if key not in weights:
            if key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            raise BuildError(f"the checkpoint's weights lack {key}. Fix: rebuild with `llmc build --force`")
        param.copy_(weights[key])


def calibrate_checkpoint(source: Any, recipe: Any, checkpoint_dir: str | Path) -> dict[str, Any]:
    """Calibrate the FP8 KV-cache scales of the IR in ``checkpoint_dir`` (its weights, as the engines compute
    them), write them into every rank and measure the cache's KL on held-out text. Returns the report; BuildError
    where a 16-bit build's KL exceeds the gate's ``max_mean_kl``."""
    from transformers import AutoModelForCausalLM

    from llmc.tokenizer import load_tokenizer

    started = time.perf_counter()
    device = resolve_build_device(recipe.quantization.device)
    dtype = gate_dtype(recipe, device)
    tokenizer = load_tokenizer(source.hf_dir)
    config, ranks = read_checkpoint(Path(checkpoint_dir))  # once: the weights to load, the ranks to write back
    model = AutoModelForCausalLM.from_pretrained(str(source.hf_dir), dtype=dtype).eval()
    load_weights(model, hf_state_dict(config, ranks, source.hf_config, dtype))
    model.to(device)
    sequences = calibration_sequences(tokenizer, source.chat_template)
    scales = calibrate(model, sequences, device)
    write_checkpoint(checkpoint_dir, config, [{**rank, **kv_scales.tensors(scales)} for rank in ranks])
    gate = recipe.quantization.gate
    texts = heldout.domain_windows(gate.domains, tokenizer, source.chat_template, HELDOUT_TOKENS, WINDOW)
    domains = cache_kl(model, texts.windows, scales, device)
    del model
    free_gpu_memory(device)
    mean_kl = sum(d["mean_kl"] for d in domains.values()) / max(1, len(domains))
    report = {"scales": scales, "calibration_tokens": sum(len(s) for s in sequences),
              "calibration_sequences": len(sequences), "heldout": domains, "mean_kl": mean_kl,
              "device": describe_device(device), "dtype": str(dtype).removeprefix("torch."),
              "seconds": round(time.perf_counter() - started, 2)}
    if recipe.quantization.method == "none" and gate.enabled and mean_kl > gate.max_mean_kl:
        raise BuildError(f"the fp8 KV cache moves this model's next-token distributions by a mean KL of {mean_kl:.4f} "
                         f"on held-out text, above quantization.gate.max_mean_kl {gate.max_mean_kl}. Fix: set "
                         f"kv_cache.dtype to auto (16-bit cache), or relax quantization.gate.max_mean_kl")
    return report
