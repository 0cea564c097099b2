"""The TensorRT-LLM checkpoint ``config.json`` for Llama-family models, and the shape facts derived from it.

``trtllm_config_from_hf`` writes exactly the fields listed in shared/reference/tensorrt-llm.md; ``ModelShape``
is the frozen view of such a config that the converter, the reader and the engines share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmc.errors import CheckpointError, SourceError
from llmc.recipe.checks import (
    QK_NORM_TYPES, QWEN_TYPES, SUPPORTED_ARCHITECTURES, architecture_name, is_supported_architecture, model_family,
)

IR_DTYPES = ("float16", "bfloat16", "float32")
W4A16_AWQ = "W4A16_AWQ"
KV_FP8 = "FP8"

CONFIG_KEYS = (
    "architecture", "dtype", "logits_dtype", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_size", "intermediate_size", "hidden_act",
    "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_scaling", "max_position_embeddings",
    "tie_word_embeddings", "mlp_bias", "attn_bias", "mapping", "quantization",
)  # fmt: skip
# Written for Qwen models only (TensorRT-LLM's QWenForCausalLM reads them; tensorrt_llm/models/qwen/config.py).
QWEN_KEYS = ("qwen_type", "seq_length")
QWEN_ARCHITECTURES = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items() if kind in QWEN_TYPES}
LLAMA_ARCHITECTURE = "LlamaForCausalLM"
IR_ARCHITECTURES = (LLAMA_ARCHITECTURE, *QWEN_ARCHITECTURES.values())  # what llmc writes as ``architecture``
W4A16_KEYS = ("quant_algo", "kv_cache_quant_algo", "group_size", "has_zero_point", "pre_quant_scale", "exclude_modules")


def trtllm_config_from_hf(
    hf_config: dict[str, Any], dtype: str, tp_size: int = 1, quantization: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The IR ``config.json`` dict for a HF Llama-family config (transformers 4 or 5 field layout).

    Llama and Mistral are written as ``LlamaForCausalLM``; Qwen2 and Qwen3 as TensorRT-LLM writes them
    (``QWenConfig.from_hugging_face``): their HF architecture, ``qwen_type``, ``seq_length`` (HF's, else 8192),
    ``attn_bias`` true for Qwen2 (q, k and v have biases; the output projection none) and false for Qwen3.

    ``quantization`` is None (16-bit) or a dict with ``quant_algo`` ("W4A16_AWQ" or None), ``group_size``
    (for W4A16_AWQ) and optionally ``kv_cache_quant_algo`` ("FP8" or None); it is normalized into the exact
    documented block. Raises SourceError for an unsupported model, CheckpointError for an impossible tp_size.
    """
    _check_model_type(hf_config)
    if dtype not in IR_DTYPES:
        raise CheckpointError(f"unsupported IR dtype {dtype!r}; use one of {', '.join(IR_DTYPES)}")
    heads = _require(hf_config, "num_attention_heads")
    hidden = _require(hf_config, "hidden_size")
    rotary_base, rotary_scaling = _rope(hf_config)
    family = model_family(hf_config)
    config = {
        "architecture": QWEN_ARCHITECTURES.get(family, LLAMA_ARCHITECTURE),
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": _require(hf_config, "vocab_size"),
        "hidden_size": hidden,
        "num_hidden_layers": _require(hf_config, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": hf_config.get("num_key_value_heads") or heads,
        "head_size": hf_config.get("head_dim") or hidden // heads,
        "intermediate_size": _require(hf_config, "intermediate_size"),
        "hidden_act": hf_config.get("hidden_act", "silu"),
        "norm_epsilon": float(hf_config.get("rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "max_position_embeddings": _require(hf_config, "max_position_embeddings"),
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "mlp_bias": bool(hf_config.get("mlp_bias", False)),
        "attn_bias": family == "qwen2" or bool(hf_config.get("attention_bias", False)),
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": quantization_block(quantization),
    }
    if family in QWEN_TYPES:
        config.update(qwen_type=family, seq_length=int(hf_config.get("seq_length") or 8192))
    ModelShape.from_config(config)  # validates tp_size against the head counts
    return config


def with_tp_size(config: dict[str, Any], tp_size: int) -> dict[str, Any]:
    """A copy of an IR config with ``mapping`` set for ``tp_size`` ranks (validated)."""
    new = {**config, "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1}}
    ModelShape.from_config(new)
    return new


def quantization_block(quantization: dict[str, Any] | None) -> dict[str, Any]:
    """Normalize a caller's quantization request into the IR's ``quantization`` block."""
    request = dict(quantization or {})
    algo = request.get("quant_algo")
    kv_algo = request.get("kv_cache_quant_algo")
    if kv_algo not in (None, KV_FP8):
        raise CheckpointError(f"unsupported kv_cache_quant_algo {kv_algo!r}; use null or {KV_FP8!r}")
    if algo is None:
        return {"quant_algo": None, "kv_cache_quant_algo": kv_algo}
    if algo != W4A16_AWQ:
        raise CheckpointError(f"unsupported quant_algo {algo!r}; llmc writes null (16-bit) or {W4A16_AWQ!r}")
    group_size = request.get("group_size")
    if not isinstance(group_size, int) or group_size <= 0:
        raise CheckpointError(f"W4A16_AWQ needs a positive integer group_size, got {group_size!r}")
    return {
        "quant_algo": W4A16_AWQ,
        "kv_cache_quant_algo": kv_algo,
        "group_size": group_size,
        "has_zero_point": False,
        "pre_quant_scale": True,
        "exclude_modules": ["lm_head"],
    }


def _check_model_type(hf_config: dict[str, Any]) -> None:
    if not is_supported_architecture(hf_config):
        raise SourceError(
            f"unsupported architecture {architecture_name(hf_config)}; llmc converts Llama-family decoders "
            f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))}). Use a Llama-architecture checkpoint"
        )


def _require(hf_config: dict[str, Any], key: str) -> Any:
    if hf_config.get(key) is None:
        raise SourceError(f"the model's config.json has no {key!r}; it is required for a Llama checkpoint")
    return hf_config[key]


def _rope(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rotary_base, rotary_scaling) from transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    base = params.pop("rope_theta", None) or hf_config.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default" or not params:
        return float(base), None
    # TensorRT-LLM reads ``type`` in older releases and ``rope_type`` in newer ones: write both, as HF did.
    params["rope_type"] = rope_type
    params["type"] = rope_type
    return float(base), params


@dataclass(frozen=True)
class ModelShape:
    """The one parser of an IR ``config.json``: shape and numerics, validated, with TensorRT-LLM's defaults for
    the optional fields (``num_key_value_heads`` = heads, ``head_size`` = hidden / heads, ``norm_epsilon`` 1e-5,
    ``rotary_base`` 10000, no ``rotary_scaling``, one rank without ``mapping``); per-rank sizes for tensor
    parallelism. The converter, the checkpoint reader and both engines read configs through it."""

    dtype: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    mlp_bias: bool
    attn_bias: bool
    tp_size: int
    quant_algo: str | None
    group_size: int | None
    kv_cache_quant_algo: str | None
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rotary_scaling: dict[str, Any] | None = None  # HF-style: rope_type / type, factor, ...
    max_position_embeddings: int = 0
    architecture: str = LLAMA_ARCHITECTURE
    qwen_type: str | None = None  # "qwen2" | "qwen3" for the Qwen architectures

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Parse and validate an IR config; CheckpointError names the missing or inconsistent field."""
        try:
            quant = config.get("quantization") or {}
            mapping = config.get("mapping") or {"world_size": 1, "tp_size": 1, "pp_size": 1}
            num_heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
            shape = cls(
                dtype=config["dtype"],
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_size=int(config.get("head_size") or hidden // num_heads),
                intermediate_size=int(config["intermediate_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                attn_bias=bool(config.get("attn_bias", False)),
                tp_size=int(mapping["tp_size"]),
                quant_algo=quant.get("quant_algo"),
                group_size=quant.get("group_size"),
                kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
                norm_epsilon=float(config.get("norm_epsilon", 1e-5)),
                rotary_base=float(config.get("rotary_base") or 10000.0),
                rotary_scaling=config.get("rotary_scaling"),
                max_position_embeddings=int(config["max_position_embeddings"]),
                architecture=str(config.get("architecture") or LLAMA_ARCHITECTURE),
                qwen_type=config.get("qwen_type"),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise CheckpointError(f"checkpoint config is missing or has a bad field: {exc!r}. Fix: re-export the "
                                  f"checkpoint with `llmc build --force`") from exc
        shape._validate(mapping)
        return shape

    def _validate(self, mapping: dict[str, Any]) -> None:
        tp = self.tp_size
        expected_arch = QWEN_ARCHITECTURES.get(self.qwen_type or "", LLAMA_ARCHITECTURE)
        if self.qwen_type is not None and self.qwen_type not in QWEN_TYPES:
            raise CheckpointError(f"checkpoint qwen_type {self.qwen_type!r} is not one of {', '.join(QWEN_TYPES)}")
        qwen = self.qwen_type is not None or self.architecture in QWEN_ARCHITECTURES.values()
        if qwen and self.architecture != expected_arch:
            pairs = ", ".join(f"{arch}: {kind}" for kind, arch in QWEN_ARCHITECTURES.items())
            raise CheckpointError(f"checkpoint architecture {self.architecture} does not match qwen_type "
                                  f"{self.qwen_type!r} ({pairs}). Fix: re-export the checkpoint with "
                                  f"`llmc build --force`")
        if self.dtype not in IR_DTYPES:
            raise CheckpointError(f"checkpoint dtype {self.dtype!r} is not one of {', '.join(IR_DTYPES)}")
        if mapping.get("pp_size", 1) != 1 or mapping.get("world_size", tp) != tp:
            raise CheckpointError(f"mapping {mapping} is unsupported; llmc writes pp_size 1, world_size = tp_size")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                                  f"{self.num_kv_heads}. Fix: check the model's config.json")
        if tp < 1 or self.num_heads % tp:
            raise CheckpointError(
                f"tp_size {tp} must divide num_attention_heads {self.num_heads}; pick a divisor of it"
            )
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise CheckpointError(
                f"tp_size {tp} and num_key_value_heads {self.num_kv_heads} must divide one another"
            )
        if self.intermediate_size % tp:
            raise CheckpointError(f"tp_size {tp} must divide intermediate_size {self.intermediate_size}")
        if self.quant_algo == W4A16_AWQ:
            self._validate_groupwise()

    def _validate_groupwise(self) -> None:
        g = self.group_size
        if not isinstance(g, int) or g <= 0:
            raise CheckpointError("a W4A16_AWQ checkpoint config needs a positive quantization.group_size")
        for module, split_in in (("attention.qkv", False), ("attention.dense", True), ("mlp.proj", True)):
            in_features = self.linear_dims(module)[1] // (self.tp_size if split_in else 1)
            if in_features % g:
                raise CheckpointError(
                    f"group_size {g} does not divide the {in_features} input features per rank of {module} "
                    f"(tp_size {self.tp_size}); choose a group size that divides them (e.g. 32 or 64)"
                )

    @property
    def qk_norm(self) -> bool:
        """True when each query and key head is RMS-normed before RoPE (Qwen3: ``attention.q_layernorm`` and
        ``attention.k_layernorm``, one ``[head_size]`` weight each, shared by the heads)."""
        return self.qwen_type in QK_NORM_TYPES

    def has_bias(self, spec_trt: str) -> bool:
        """Whether the decoder linear ``spec_trt`` (``attention.qkv`` ...) has a bias: ``attn_bias`` for qkv and,
        except in Qwen models (TensorRT-LLM builds their output projection with ``dense_bias=False``), for dense;
        ``mlp_bias`` for fc, gate and proj."""
        if spec_trt == "attention.qkv":
            return self.attn_bias
        if spec_trt == "attention.dense":
            return self.attn_bias and self.qwen_type is None
        return self.mlp_bias

    @property
    def is_w4a16(self) -> bool:
        """True when the five decoder linears are stored as W4A16_AWQ packed int4."""
        return self.quant_algo == W4A16_AWQ

    @property
    def heads_per_rank(self) -> int:
        """Query heads on each rank."""
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads on each rank (1 when kv heads are duplicated because num_kv_heads < tp_size)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def qkv_out(self) -> int:
        """Unsharded qkv output features: (nh + 2 * nkv) * head_size."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    @property
    def qkv_out_per_rank(self) -> int:
        """qkv output features on each rank, including duplicated kv heads."""
        return (self.heads_per_rank + 2 * self.kv_heads_per_rank) * self.head_size

    @property
    def attn_in(self) -> int:
        """Unsharded input features of attention.dense: nh * head_size."""
        return self.num_heads * self.head_size

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary size rounded up to a multiple of tp_size (the lm_head rows before splitting)."""
        return -(-self.vocab_size // self.tp_size) * self.tp_size

    def linear_dims(self, module: str) -> tuple[int, int]:
        """Unsharded (out_features, in_features) of a decoder linear, by TensorRT-LLM module name."""
        dims = {
            "attention.qkv": (self.qkv_out, self.hidden_size),
            "attention.dense": (self.hidden_size, self.attn_in),
            "mlp.fc": (self.intermediate_size, self.hidden_size),
            "mlp.gate": (self.intermediate_size, self.hidden_size),
            "mlp.proj": (self.hidden_size, self.intermediate_size),
        }
        return dims[module]
