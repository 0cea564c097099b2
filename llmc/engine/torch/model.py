"""A Llama-family decoder over a paged KV cache, laid out exactly like the TensorRT-LLM checkpoint IR.

Module names equal the IR tensor names (``transformer.layers.N.attention.qkv.weight`` ...), so a merged,
dequantized IR state dict loads with ``load_state_dict(strict=True)`` (the qkv bias: :func:`state_dict_name`). The
fused layouts are used as-is:
``attention.qkv`` stacks q, k, v rows; ``mlp.fc`` is the SiLU branch (HF gate_proj), ``mlp.gate`` the linear
branch (HF up_proj) and ``mlp.proj`` the down projection.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmc.checkpoint.config import IR_ARCHITECTURES, ModelShape
from llmc.engine.torch import cpu_ext
from llmc.engine.torch.attention import AttentionMetadata, decode_attention, paged_attention, planless_sdpa
from llmc.engine.torch.kv_store import FP8
from llmc.engine.torch.layers import MLP, RMSNorm
from llmc.engine.torch.pending_norm import PendingNorm, materialized
from llmc.engine.torch.rope import RopeScaling, apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq
from llmc.errors import CheckpointError

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, num_kv_heads, head_size]


@dataclass(frozen=True)
class ModelConfig:
    """Model shape and numerics, read from the checkpoint IR's config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the IR's storage dtype: float16 | bfloat16 | float32
    qkv_bias: bool = False  # Qwen2: q, k and v have biases (the IR's attention.qkv.bias)
    qk_norm: bool = False  # Qwen3: each query and key head RMS-normed before RoPE (attention.q/k_layernorm)

    @classmethod
    def from_checkpoint_config(cls, cfg: dict) -> ModelConfig:
        """Read an IR config dict through the one parser (:class:`~llmc.checkpoint.config.ModelShape`, whose
        defaults apply); CheckpointError for a bad config or a feature this engine does not implement."""
        shape = ModelShape.from_config(cfg)
        _check_supported(cfg, shape)
        return cls(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            intermediate_size=shape.intermediate_size,
            norm_epsilon=shape.norm_epsilon,
            rotary_base=shape.rotary_base,
            rope_scaling=RopeScaling.from_config(shape.rotary_scaling),
            max_position_embeddings=shape.max_position_embeddings,
            tie_word_embeddings=shape.tie_word_embeddings,
            dtype=shape.dtype,
            qkv_bias=shape.has_bias("attention.qkv"),
            qk_norm=shape.qk_norm,
        )

    @property
    def qkv_size(self) -> int:
        """Rows of the stacked qkv weight: (nh + 2 * nkv) * hd."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size


def _check_supported(cfg: dict, shape: ModelShape) -> None:
    """CheckpointError unless the config describes what this engine implements: a SiLU Llama with NeoX RoPE, or
    Qwen2 (q, k, v biases) / Qwen3 (q, k head norms); no bias on the output projection or the MLP."""
    supported = {
        "architecture": IR_ARCHITECTURES,
        "hidden_act": ("silu",),
        "position_embedding_type": ("rope_gpt_neox",),
    }
    for key, expected in supported.items():
        if cfg.get(key, expected[0]) not in expected:
            raise CheckpointError(
                f"checkpoint config {key}={cfg.get(key)!r} is not supported by the torch engine (expects "
                f"{' or '.join(expected)}). Fix: use a Llama-family model"
            )
    for label, biased in (("attention.dense", shape.has_bias("attention.dense")), ("the MLP", shape.mlp_bias)):
        if biased:
            raise CheckpointError(f"checkpoint config gives {label} a bias (attn_bias / mlp_bias), which the torch "
                                  f"engine does not implement. Fix: use a model without those biases (Llama, "
                                  f"Qwen2, Qwen3)")


def state_dict_name(ir_name: str) -> str:
    """The model's state-dict name of an IR tensor: the IR's names, except that the qkv bias is the attention's
    ``qkv_bias`` (added after the qkv product, whatever kernel module replaces ``attention.qkv``)."""
    return ir_name[: -len("qkv.bias")] + "qkv_bias" if ir_name.endswith("attention.qkv.bias") else ir_name


class Attention(nn.Module):
    """GQA self-attention with fused qkv, NeoX RoPE and the paged reference attention; Qwen2's q, k, v biases
    (``qkv_bias``) and Qwen3's per-head q, k norms (``q_layernorm``, ``k_layernorm``) where the config has them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = config.num_heads, config.num_kv_heads, config.head_size
        self.scale = config.head_size**-0.5
        self.qkv = nn.Linear(config.hidden_size, config.qkv_size, bias=False, dtype=dtype)
        # Kept apart from the qkv layer, so every kernel module that replaces it (int4, 16-bit) stays bias-free.
        self.qkv_bias = nn.Parameter(torch.zeros(config.qkv_size, dtype=dtype)) if config.qkv_bias else None
        norm = (lambda: RMSNorm(config.head_size, config.norm_epsilon, dtype)) if config.qk_norm else (lambda: None)
        self.q_layernorm, self.k_layernorm = norm(), norm()
        self.dense = nn.Linear(config.num_heads * config.head_size, config.hidden_size, bias=False, dtype=dtype)
        self.bf16_prefill = False  # CPU: prefill chunks attend in bfloat16 products (see use_bf16_prefill)
        self.kv_scale = 1.0  # an fp8 cache holds k / kv_scale and v / kv_scale (the IR's kv_cache_scaling_factor)

    def use_bf16_prefill(self) -> None:
        """CPU, with the model's prefill GEMMs in bfloat16: attend prefill chunks in bfloat16 products with float32
        sums too (llmc's kernel, :func:`~llmc.engine.torch.attention.paged_attention`); decodes stay float32."""
        self.bf16_prefill = True

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """The reference path; the fused decoder (CUDA with Triton, :attr:`LlamaForCausalLM.cuda_fused`) calls
        :meth:`project` and :meth:`attend` instead, then the dense layer."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        qkv = self._qkv_for_rope(x)  # [T, q_size + 2 * kv_size]
        qk = apply_rope(qkv[:, : q_size + kv_size].view(t, -1, self.head_size), cos, sin)  # q and k heads at once
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)  # [T, nh, hd], [T, nkv, hd]
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_size)  # [T, nkv, hd]
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn, self.scale, self.bf16_prefill,
                              kv_scale=self.kv_scale)  # [T, nh, hd]
        return self.dense(out.reshape(t, q_size))

    def _qkv_for_rope(self, x: torch.Tensor) -> torch.Tensor:
        """The qkv product ``[T, (nh + 2 nkv) hd]`` with Qwen2's bias added and Qwen3's q, k heads normed (in place:
        the product is this step's own), ready for RoPE; the plain product for Llama."""
        qkv = self.qkv(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_layernorm is not None and self.k_layernorm is not None:
            nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_size
            heads = qkv[:, : (nh + nkv) * hd].view(qkv.shape[0], nh + nkv, hd)
            heads[:, :nh] = self.q_layernorm(heads[:, :nh].contiguous())
            heads[:, nh:] = self.k_layernorm(heads[:, nh:].contiguous())
        return qkv

    def _rope_extras(self) -> dict:
        """The fused rope kernel's bias and head-norm arguments (``fused_triton.rope_write_kv``)."""
        if self.q_layernorm is None or self.k_layernorm is None:
            return {"bias": self.qkv_bias}
        return {"bias": self.qkv_bias, "q_norm": self.q_layernorm.weight, "k_norm": self.k_layernorm.weight,
                "eps": self.q_layernorm.eps}

    def project(self, x: torch.Tensor | PendingNorm, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                slot_mapping: torch.Tensor, decode: bool) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None]:
        """CUDA with Triton: qkv, then one kernel rotates q and k and writes k, v to the cache at ``slot_mapping``
        (every step: a prefill's elementwise RoPE ops and cache write cost ~8 % of its step on an H200); in
        ``decode`` steps an int4 qkv layer does it in its own epilogue where it can
        (:meth:`~llmc.engine.torch.int4_cuda.Int4CudaLinear.rope_write_kv`; 16-bit caches only: staging an fp8
        cache's keys for the decode kernel to store was measured and dropped, docs/GPU_INT4_LOG.md 2026-12-06
        23:10). Returns q ``[T, nh, hd]`` and, for prompt steps, k and v ``[T, nkv, hd]`` (None in decode steps: they
        are read back from the cache)."""
        from llmc.engine.torch import fused_triton  # optional dependency: Triton (checked by the loader)

        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_size
        if not getattr(self.qkv, "takes_pending_norm", False):
            x = materialized(x)  # an int4 layer takes the norm pending (and finishes it) where it can
        if decode:
            plain = self.qkv_bias is None and self.q_layernorm is None  # the epilogue adds no bias, norms no head
            asked = plain and kv_cache[0].dtype != FP8  # the epilogue writes 16 bits
            rope = getattr(self.qkv, "rope_write_kv", None) if asked else None
            q = None if rope is None else rope(x, cos, sin, kv_cache[0], kv_cache[1], slot_mapping, nh, nkv)
            if q is None:  # the layer has no epilogue, or it does not apply: the rope kernel adds the bias, norms
                q = fused_triton.rope_write_kv(self.qkv(x), cos, sin, kv_cache[0], kv_cache[1], slot_mapping, nh,
                                               nkv, hd, kv_scale=self.kv_scale, **self._rope_extras())  # one kernel
            return q, None, None
        qkv = self._qkv_for_rope(x)  # [T, (nh + 2 nkv) hd]
        q, k = fused_triton.rope_write_kv(qkv, cos, sin, kv_cache[0], kv_cache[1], slot_mapping, nh, nkv, hd,
                                          return_k=True, kv_scale=self.kv_scale)
        return q, k, qkv[:, (nh + nkv) * hd :].view(x.shape[0], nkv, hd)

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, attn: AttentionMetadata,
               kv_cache: KVCache) -> torch.Tensor:
        """Attention of :meth:`project`'s outputs (their keys and values already in the cache) -> ``[T, nh, hd]``."""
        if attn.all_decode:
            return decode_attention(q, kv_cache[0], kv_cache[1], attn, self.scale, self.kv_scale)
        return paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn, self.scale, kv_written=True,
                               kv_scale=self.kv_scale)


def _linear_add_norm(linear: nn.Module, x: torch.Tensor, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor | PendingNorm:
    """``h += linear(x)`` in place, then ``norm(h)``: left pending where the linear can add in its epilogue (an int4
    CUDA layer's ``add_residual``: the next int4 layer finishes the norm, :mod:`llmc.engine.torch.pending_norm`),
    else the product and llmc's fused add + RMSNorm kernel."""
    add = getattr(linear, "add_residual", None)
    pending = add(x, h, norm.weight, norm.eps) if add is not None else None
    if pending is None:
        from llmc.engine.torch import fused_triton  # optional dependency: Triton (the fused decoder's caller checks)

        return fused_triton.add_rms_norm_(h, linear(x), norm.weight, norm.eps)
    return pending


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.attention = Attention(config, dtype)
        self.post_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        a = self.attention(self.input_layernorm(h), cos, sin, attn, kv_cache)
        norm = self.post_layernorm
        if cpu_ext.fused_available(h) and cpu_ext.fused_available(a) and norm.weight.dtype == torch.float32:
            normed = cpu_ext.add_rms_norm_(h, a, norm.weight, norm.eps)  # h += a in place: h is this step's own
        else:
            h = h + a
            normed = norm(h)
        return h + self.mlp(normed)


class Transformer(nn.Module):
    """Embedding, decoder layers and final norm (the IR's ``transformer.*`` tensors)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_embedding = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.norm_epsilon, dtype)


class LlamaForCausalLM(nn.Module):
    """The portable engine's model. Runs packed batches (no padding) over a paged KV cache.

    After loading weights into a model built on the meta device, call :meth:`reset_buffers` (the RoPE
    frequencies are a non-persistent buffer, not part of the checkpoint).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.transformer = Transformer(config, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        self.register_buffer("inv_freq", torch.empty(config.head_size // 2, dtype=torch.float32), persistent=False)
        self.logits_tiles: torch.Tensor | None = None  # see use_16bit_logits
        self.cuda_fused = False  # see use_cuda_fused
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the RoPE inverse frequencies in float32 on the model's device."""
        inv_freq = rope_inv_freq(self.config.head_size, self.config.rotary_base, self.config.rope_scaling)
        if self.inv_freq.device.type != "meta":
            self.inv_freq.copy_(inv_freq)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, hd]`` of ``positions`` (:func:`~llmc.engine.torch.rope.rope_cos_sin`, with YaRN's
        attention factor where the config scales RoPE that way)."""
        return rope_cos_sin(self.inv_freq, positions, dtype, rope_attention_factor(self.config.rope_scaling))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Packed tokens ``input_ids [T]`` at ``positions [T]`` -> final-normed hidden states ``[T, H]``.

        Writes this step's keys and values into ``kv_caches`` (one ``(k, v)`` pair per layer).
        """
        h = self.transformer.vocab_embedding(input_ids)  # [T, H]
        cos, sin = self.rope_tables(positions, h.dtype)  # [T, 1, hd] each, shared by all layers
        # prompt chunks attend through SDPA: never through a backend that plans per shape (planless_sdpa)
        with contextlib.nullcontext() if attn.all_decode else planless_sdpa():
            if self.cuda_fused:
                return self._forward_fused(h, cos, sin, attn, kv_caches)
            for layer, kv_cache in zip(self.transformer.layers, kv_caches, strict=True):
                h = layer(h, cos, sin, attn, kv_cache)
            return self.transformer.ln_f(h)

    def use_cuda_fused(self, enabled: bool = True) -> None:
        """CUDA with Triton: every residual add joins the next RMSNorm in one kernel, decode steps rotate q, k and
        write the cache in one kernel, SiLU x gate is one kernel (:mod:`llmc.engine.torch.fused_triton`). Set by
        the loader on CUDA (on CPU only under Triton's interpreter, by the tests)."""
        self.cuda_fused = enabled
        for layer in self.transformer.layers:
            layer.mlp.cuda_fused = enabled

    def _forward_fused(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                       kv_caches: list[KVCache]) -> torch.Tensor:
        """The decoder with the residual add of each sub-layer fused into the following norm (``h`` is this
        step's own residual stream and is updated in place). Its pieces between attentions are what
        :mod:`llmc.engine.torch.piece_graphs` captures."""
        normed = self.fused_first_norm(h)
        for i, (layer, kv_cache) in enumerate(zip(self.transformer.layers, kv_caches, strict=True)):
            q, k, v = layer.attention.project(normed, cos, sin, kv_cache, attn.slot_mapping, attn.all_decode)
            normed = self.fused_after_attention(i, h, layer.attention.attend(q, k, v, attn, kv_cache))
        return normed

    def fused_first_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The first layer's input norm of the fused decoder (:meth:`_forward_fused`)."""
        from llmc.engine.torch import fused_triton  # optional dependency: Triton (checked by use_cuda_fused's caller)

        first = self.transformer.layers[0].input_layernorm
        return fused_triton.rms_norm(h, first.weight, first.eps)  # [T, H]

    def fused_after_attention(self, i: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` of the fused decoder after its attention (``attended [T, nh, hd]``): the dense layer, the
        residual add joined to the post-attention norm, the MLP, its residual add joined to the next layer's input
        norm (the final norm after the last layer). Updates ``h`` in place; returns the normed input of what
        follows ``[T, H]``, before a next layer possibly as a :class:`~llmc.engine.torch.pending_norm.PendingNorm`
        (which its int4 qkv layer finishes, or :meth:`~llmc.engine.torch.pending_norm.PendingNorm.materialize`)."""
        from llmc.engine.torch import fused_triton  # optional dependency: Triton (checked by use_cuda_fused's caller)

        layers = self.transformer.layers
        layer = layers[i]
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.transformer.ln_f
        mlp = layer.mlp
        normed = _linear_add_norm(layer.attention.dense, attended.reshape(h.shape[0], -1), h, layer.post_layernorm)
        if getattr(mlp.fc_gate_kernel, "silu_output", False):  # int4 on CUDA: both layers may take a pending norm
            normed = _linear_add_norm(mlp.proj, mlp.fc_gate_kernel(normed), h, after)
            return normed if i + 1 < len(layers) else materialized(normed)  # the logits' norm: computed here
        return fused_triton.add_rms_norm_(h, mlp(materialized(normed)), after.weight, after.eps)

    def logits_weight(self) -> torch.Tensor:
        """``[V, H]``: the lm_head's weight, or the embedding's when they are tied."""
        return self.transformer.vocab_embedding.weight if self.lm_head is None else self.lm_head.weight

    def use_16bit_logits(self, dtype: torch.dtype) -> bool:
        """CPU, float32 compute: multiply the logits layer with llmc's kernel over a ``dtype`` copy of its weight
        (``csrc/dense16_matmul.cpp``), half the bytes of the float32 weight read per step (SmolLM2: 57 of its
        113 MB). Only when that copy is exact (a 16-bit checkpoint's weight widened to float32), so the logits
        stay float32 products of the same weights. Returns whether the kernel is in use."""
        narrow = cpu_ext.exact_copy16(self.logits_weight(), dtype)
        if narrow is None or cpu_ext.load() is None:
            return False
        self.logits_tiles = cpu_ext.pack_tiles16(narrow)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, V]`` float32 for the hidden states of the sampled positions only."""
        if self.logits_tiles is not None and hidden.dtype == torch.float32:
            return cpu_ext.dense16_matmul(hidden.contiguous(), self.logits_tiles)
        return F.linear(hidden, self.logits_weight()).float()
