"""Accuracy gate: the int4 checkpoint against the 16-bit model and against round-to-nearest int4 of the same
model, token by token, on several held-out domains.

Domains (``quantization.gate.domains``, :mod:`llmc.builder.heldout`): held-out pydoc topics (the shipped
recipes' calibration domain), English prose, Python code, multi-turn chat (rendered with the model's chat
template) and Chinese -- each disjoint from every calibration source. Per domain, ``n_tokens`` of text (rounded up
to windows of GATE_WINDOW tokens; fewer when the text is shorter with this tokenizer) are scored.

Three weight sets run through the same Hugging Face model class (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...):
the 16-bit model from ``source.hf_dir``; the int4 model built by dequantizing the written W4A16_AWQ IR
(``dequantize_w4a16``) back into HF tensors -- AWQ-folded norms, the IR's 16-bit embedding and biases included -- so
the gate scores exactly the weights that ship; and its round-to-nearest twin (``gate.rtn_baseline``): the 16-bit
weights rounded per group exactly as ``method: rtn`` stores them (library scales absmax / 7.5 in the IR dtype; other
tensors in the IR dtype), computed in memory in seconds. Metrics per domain and model: perplexity, per-position
KL(p16 || pq) mean / p99 / max, top-1 agreement; and the build / RTN ratios of KL and perplexity. Chat check: for
CHAT_PROMPTS held-out prompts in the chat template, greedy decoding must end the turn with an end token within 2 x
CHAT_BUDGET tokens for the int4 model wherever the 16-bit model ends it within CHAT_BUDGET.

Device (``quantization.device``): on the CPU everything computes in float32, as before. On CUDA the models
compute in the IR dtype (what the engine runs there) and one model is on the GPU at a time: the weight sets
wait in host memory and are copied into one model in turn, and the 16-bit logits of the windows are kept on the
GPU while the int4 and RTN weights are scored against them, so peak GPU memory is one 16-bit model plus the
logits, not three models.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from rich.console import Console

from llmc.builder import gate_report, heldout
from llmc.builder.devices import PeakMemory, describe_device, free_gpu_memory, resolve_build_device
from llmc.builder.hf_kv import use_fp8_cache
from llmc.checkpoint import names
from llmc.checkpoint.convert import dequantized_weights, trtllm_to_hf
from llmc.checkpoint.io import read_checkpoint, read_kv_scales
from llmc.console import table_console
from llmc.engine.torch import cpu_gemm
from llmc.errors import AccuracyGateError, BuildError
from llmc.recipe import Recipe
from llmc.source.load import SourceModel

GATE_WINDOW = 512
GATE_BATCH = 4  # windows per forward pass
CHAT_PROMPTS = 4
CHAT_BUDGET = 64
RTN_QMAX = 7.5  # the library's symmetric int4 scale: absmax / ((7 - (-8)) / 2)
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
WeightFn = Callable[[str, torch.Tensor], torch.Tensor]  # (HF name, host tensor) -> tensor to load


def accuracy_gate(source: SourceModel, recipe: Recipe, checkpoint_dir: str | Path, console: Console | None = None,
                  device: torch.device | None = None) -> dict[str, Any]:
    """Compare the int4 IR in ``checkpoint_dir`` with ``source``'s 16-bit model (and its RTN twin) per domain.

    Prints a rich table to ``console`` (default: stderr). Raises AccuracyGateError (with ``.report`` holding the
    full report) when any domain exceeds a bound of ``quantization.gate`` (``max_mean_kl``, ``max_ppl_ratio``,
    ``max_kl_vs_rtn``, ``max_ppl_vs_rtn``) or the int4 model loses the chat end token; its message lists the
    worst positions. BuildError when no domain has a window of text with this tokenizer.
    """
    from llmc.tokenizer import load_tokenizer

    gate = recipe.quantization.gate
    device = device if device is not None else resolve_build_device(recipe.quantization.device)
    dtype = gate_dtype(recipe, device)
    started = time.perf_counter()
    tokenizer = load_tokenizer(source.hf_dir)
    texts = heldout.domain_windows(gate.domains, tokenizer, source.chat_template, gate.n_tokens, GATE_WINDOW)
    if not texts.windows:
        raise BuildError("the accuracy gate has no held-out text: " + "; ".join(texts.skipped.values())
                         + ". Fix: add a domain this tokenizer can read to quantization.gate.domains, or disable "
                         "the gate")
    with PeakMemory(device) as peak:
        models = GateModels(source, recipe, checkpoint_dir, device, dtype)
        kv_cache = models.kv_scales
        with cpu_gemm.fp32_linears(device):  # float32 forwards on the CPU through oneDNN where it is faster
            scores = score_domains(models, texts.windows, gate.rtn_baseline, device)
            chat = chat_end_check(models, tokenizer, source)
        del models
        free_gpu_memory(device)
    domains = {name: gate_report.domain_metrics(by_model) for name, by_model in scores.items()}
    failures = gate_report.check_domains(domains, gate) + [f"chat end token: {f}" for f in chat["failed"]]
    report = {
        "passed": not failures,
        "failures": failures,
        "thresholds": {"max_mean_kl": gate.max_mean_kl, "max_ppl_ratio": gate.max_ppl_ratio,
                       "max_kl_vs_rtn": gate.max_kl_vs_rtn, "max_ppl_vs_rtn": gate.max_ppl_vs_rtn},
        "domains": domains,
        "skipped_domains": texts.skipped,
        "mean": gate_report.mean_over_domains(domains),
        "worst_positions": {name: gate_report.worst_positions(by_model["int4"], tokenizer)
                            for name, by_model in scores.items()},
        "special_token_check": chat,
        "kv_cache": "16-bit" if kv_cache is None else "fp8",  # what the int4 and RTN models computed with
        "device": describe_device(device),
        "dtype": str(dtype).removeprefix("torch."),
        "peak_gpu_memory_bytes": peak.bytes,
        "seconds": round(time.perf_counter() - started, 2),
    }
    (console or table_console(stderr=True)).print(gate_report.domains_table(report))
    if failures:
        worst = gate_report.worst_domain(domains)
        error = AccuracyGateError(
            "the int4 model failed the accuracy gate: " + "; ".join(failures) + f".\nWorst positions ({worst}):\n"
            + gate_report.worst_positions_text(report["worst_positions"][worst])
            + "\nFix: use quantization.method awq with exclude_special_tokens: true and rounding: gptq, a smaller "
            "group_size, more or more varied calibration samples (quantization.calibration.sources), or relax "
            "quantization.gate if this model is known to be fragile under int4"
        )
        error.report = report
        raise error
    return report


def gate_dtype(recipe: Any, device: torch.device) -> torch.dtype:
    """float32 on the CPU; on CUDA the IR dtype (``model.dtype``), the dtype the engine computes in there."""
    if device.type == "cpu":
        return torch.float32
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[recipe.model.dtype]


class GateModels:
    """One HF model on the gate's device and the weight sets the gate loads into it in turn.

    ``use(name)`` makes the model compute with weight set ``name``: "16bit" (the source), "int4" (the IR,
    dequantized) or "rtn" (the source rounded to nearest: on CUDA computed on the GPU from the 16-bit tensors
    while loading, on the CPU once). The sets are host tensors in the compute dtype; loading one copies it into
    the model's parameters.
    """

    def __init__(self, source: Any, recipe: Any, checkpoint_dir: str | Path, device: torch.device,
                 dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.ir_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                         "float32": torch.float32}[recipe.model.dtype]
        self.group_size = recipe.quantization.group_size
        model = AutoModelForCausalLM.from_pretrained(str(source.hf_dir), dtype=dtype).eval()
        self.tied = bool(source.hf_config.get("tie_word_embeddings"))
        # Host copies: on the CPU the model's own tensors are overwritten by the other sets, so clone them.
        self.sets: dict[str, tuple[dict[str, torch.Tensor], WeightFn | None]] = {
            "16bit": ({k: (v.detach().clone() if device.type == "cpu" else v.detach())
                       for k, v in model.state_dict().items()}, None),
            "int4": (ir_to_hf_state_dict(checkpoint_dir, source.hf_config, dtype), None),
        }
        self.model = model.to(device)
        reference = self.sets["16bit"][0]
        # On CUDA the twin is rounded on the GPU while loading (no host copy); on the CPU it is rounded once and
        # kept, since the CPU gate loads it once per domain.
        self.sets["rtn"] = ((reference, self._rtn) if device.type == "cuda"
                            else ({k: self._rtn(k, v) for k, v in reference.items()}, None))
        self.current = "16bit"
        # kv_cache.dtype fp8: the int4 and RTN models compute with the fp8 cache the engines will hold (the IR's
        # calibrated scales), the 16-bit reference with a 16-bit one; None: 16-bit caches throughout.
        self.kv_scales = read_kv_scales(checkpoint_dir)

    def use(self, name: str) -> torch.nn.Module:
        """The model, computing with weight set ``name``."""
        if name != self.current:
            weights, transform = self.sets[name]
            params = dict(self.model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for key, param in params.items():
                    if key not in weights:
                        assert key == names.HF_LM_HEAD and self.tied, f"weight set {name} lacks {key}"
                        continue
                    host = weights[key]
                    param.copy_(transform(key, host) if transform is not None else host)
            if self.kv_scales is not None:
                use_fp8_cache(self.model, None if name == "16bit" else self.kv_scales)
            self.current = name
        return self.model

    def _rtn(self, key: str, host: torch.Tensor) -> torch.Tensor:
        value = host.to(self.device)
        if _LINEAR_WEIGHT.match(key):
            return rtn_dequantized(value, self.group_size, self.ir_dtype).to(host.dtype)
        return value.to(self.ir_dtype).to(host.dtype)  # the RTN IR stores every other tensor in the IR dtype


def rtn_dequantized(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest int4 of ``weight`` [O, K] as ``method: rtn`` writes it, dequantized (float32 [O, K]).

    Symmetric groups of ``group_size`` inputs: scale = absmax / 7.5 rounded to ``scale_dtype`` (the library's
    min-max observer), q = round(w / scale) clamped to [-8, 7].
    """
    w = weight.float()
    groups = w.view(w.shape[0], -1, group_size)  # [O, K/g, g]
    scale = (groups.abs().amax(-1, keepdim=True) / RTN_QMAX).to(scale_dtype).float()  # [O, K/g, 1]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (groups / scale).round().clamp(-8, 7)
    return (q * scale).view_as(w)


@torch.no_grad()
def score_domains(models: GateModels, windows: dict[str, torch.Tensor], rtn: bool, device: torch.device
                  ) -> dict[str, dict[str, gate_report.Scores]]:
    """{domain: {"int4": Scores, "rtn": Scores}} of every domain's windows [W, L] against the 16-bit model.

    The 16-bit logits of a chunk of domains are kept on the device while the other weight sets are scored
    against them: on the CPU a chunk is one domain (little memory), on CUDA all domains (one copy of each set).
    """
    variants = ("int4", "rtn") if rtn else ("int4",)
    chunks = [list(windows)] if device.type == "cuda" else [[name] for name in windows]
    scores: dict[str, dict[str, gate_report.Scores]] = {name: {} for name in windows}
    for chunk in chunks:
        reference = {name: list(_logits(models.use("16bit"), windows[name], device)) for name in chunk}
        for variant in variants:
            model = models.use(variant)
            for name in chunk:
                parts = [gate_report.window_scores(ids.to(device), ref, logits)
                         for ids, ref, logits in zip(windows[name], reference[name],
                                                     _logits(model, windows[name], device))]
                scores[name][variant] = gate_report.stack_scores(windows[name], parts)
        del reference
    return scores


def _logits(model: torch.nn.Module, windows: torch.Tensor, device: torch.device) -> Iterator[torch.Tensor]:
    """Logits [L, V] of each window, GATE_BATCH windows per forward pass."""
    for start in range(0, windows.shape[0], GATE_BATCH):
        batch = windows[start:start + GATE_BATCH].to(device)  # [b, L]
        yield from model(input_ids=batch).logits  # [b, L, V]


@torch.no_grad()
def chat_end_check(models: GateModels, tokenizer: Any, source: SourceModel) -> dict[str, Any]:
    """Greedy chat answers of both models: does int4 end its turn wherever the 16-bit model does?"""
    eos = list(source.eos_token_ids)
    if not eos or source.chat_template is None:
        return {"prompts": 0, "ended_16bit": 0, "ended_int4": 0, "failed": [], "results": [],
                "skipped": "the model has no chat template or end token"}
    prompts = []
    for prompt in heldout.chat_prompts(CHAT_PROMPTS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, chat_template=source.chat_template)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    ends_16 = _greedy_ends(models.use("16bit"), prompts, eos, CHAT_BUDGET, models.device)
    ends_int4 = _greedy_ends(models.use("int4"), prompts, eos, 2 * CHAT_BUDGET, models.device)
    results, failed = [], []
    for index, (end_16, end_int4) in enumerate(zip(ends_16, ends_int4)):
        results.append({"prompt": index, "end_16bit": end_16, "end_int4": end_int4})
        if end_16 is not None and end_int4 is None:
            failed.append(f"prompt {index}: the 16-bit model ends its turn after {end_16} tokens, the int4 model "
                          f"not within {2 * CHAT_BUDGET}")
    return {
        "prompts": len(results),
        "ended_16bit": sum(r["end_16bit"] is not None for r in results),
        "ended_int4": sum(r["end_16bit"] is not None and r["end_int4"] is not None for r in results),
        "failed": failed,
        "results": results,
    }


def _greedy_ends(model: torch.nn.Module, prompts: list[list[int]], eos: list[int], budget: int,
                 device: torch.device) -> list[int | None]:
    """Per prompt, the number of tokens greedy decoding produces up to and including the first end token (None:
    not within ``budget``). One batched ``generate`` (prompts left-padded and masked): the prompts decode
    together instead of one after another."""
    from transformers import GenerationConfig

    width = max(len(ids) for ids in prompts)
    pad = eos[0]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    config = GenerationConfig(do_sample=False, max_new_tokens=budget, eos_token_id=eos, pad_token_id=pad)
    out = model.generate(input_ids, attention_mask=mask, generation_config=config)[:, width:]  # [P, generated]
    ends: list[int | None] = []
    for row in out.tolist():
        hits = [i for i, t in enumerate(row) if t in eos]
        ends.append(hits[0] + 1 if hits else None)
    return ends


def ir_to_hf_state_dict(checkpoint_dir: str | Path, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32
                        ) -> dict[str, torch.Tensor]:
    """The IR's weights as a HF Llama state dict in ``dtype`` (int4 layers dequantized, TP merged, padding
    removed)."""
    config, ranks = read_checkpoint(Path(checkpoint_dir))
    return hf_state_dict(config, ranks, hf_config, dtype)


def hf_state_dict(config: dict[str, Any], ranks: list[dict[str, torch.Tensor]], hf_config: dict[str, Any],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """:func:`ir_to_hf_state_dict` of a checkpoint already read (``config``, every rank's tensors)."""
    weights = dequantized_weights(config, ranks, dtype)
    return trtllm_to_hf({k: v.to(dtype) for k, v in weights.items()}, hf_config)
