"""The input-embedding table in page-locked host memory, read by the GPU row by row (CUDA, untied models).

A step reads one row of the input embedding per token (8 KB for the 8B shape), but the table is as large as the
lm_head: 1.05 GB of the 8B shape's bf16 weights, 18 % of its int4 engine. Kept in page-locked (pinned) host memory,
which a CUDA kernel can read directly over PCIe (unified addressing), that memory goes to the KV cache instead; the
rows a step needs cross the bus inside the step's kernel: 16.8 MB for a 2,048-token prompt of the 8B shape. A tied
table is also the logits layer's weight (every row, every step) and stays on the device. llama.cpp keeps its token
embeddings in host memory for the same reason.

Measured on the H200 (docs/GPU_INT4_LOG.md, 2026-12-03): 2,048 rows of the 8B table in 335 us over PCIe (50 GB/s)
against 20 us from the device, +1.3 % TTFT p50 at concurrency 1, ITL p50 unchanged. The page-locked copy comes
from PyTorch's pinned allocator, which rounds an allocation up to a power of two (the 8B table's 1.05 GB takes
1 GiB = 1.07 GB; a 1.1 GB table would take 2 GiB of host memory).

``LLMC_EMBEDDING=device`` keeps the table on the device (for A/B measurements, or where host memory is scarce).
The gather is a Triton kernel (captured in CUDA graphs like the others); Triton's CPU interpreter runs it in the
tests on CPU tensors.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from llmc.engine.torch import triton_support
from llmc.errors import EngineError

ENV = "LLMC_EMBEDDING"  # "device": keep the input embedding on the GPU; "host" (default): page-locked host memory
BLOCK = 1024  # elements of a row per program: 2 KB of a 16-bit row, 16 bytes per thread with 4 warps


def placement() -> str:
    """``host`` or ``device`` from ``LLMC_EMBEDDING`` (EngineError naming the variable for anything else)."""
    value = os.environ.get(ENV, "host").strip().lower() or "host"
    if value not in ("host", "device"):
        raise EngineError(f"{ENV}={value!r} is not a placement; Fix: set {ENV} to host or device (or unset it)")
    return value


@functools.cache
def _kernel():
    triton, tl = triton_support.modules()

    @triton.jit
    def gather_rows(table_ptr, ids_ptr, out_ptr, V, H, stride_t, stride_i, stride_o, BLOCK: tl.constexpr):
        """Program (t, j): columns [j * BLOCK, (j + 1) * BLOCK) of row ids[t] of the table into out[t]. An id outside
        [0, V) (the runtime refuses them before they get here) reads nothing and gives zeros: a kernel reading host
        memory must never read past the table."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row = tl.load(ids_ptr + t * stride_i).to(tl.int64) + tl.zeros([BLOCK], dtype=tl.int64)  # in every lane
        ok = (cols < H) & (row >= 0) & (row < V)
        values = tl.load(table_ptr + row * stride_t + cols, mask=ok, other=0.0)
        tl.store(out_ptr + t * stride_o + cols, values, mask=cols < H)

    return gather_rows


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[t] = table[ids[t]]`` by the device of ``ids`` and ``out`` (``table`` may be pinned host memory; ``ids``
    may be a strided view, as the CUDA graphs' column of their input rows is)."""
    assert table.stride(-1) == 1 and out.stride(-1) == 1 and ids.dim() == 1 and out.shape[0] == ids.shape[0]
    if ids.shape[0]:
        v, h = table.shape
        _kernel()[(ids.shape[0], -(-h // BLOCK))](table, ids, out, v, h, table.stride(0), ids.stride(0),
                                                  out.stride(0), BLOCK=BLOCK)
    return out


class HostEmbedding(nn.Module):
    """An input embedding whose ``[V, H]`` table stays in host memory (page-locked when the activations are on
    CUDA) and is gathered by the activations' device. The table is a plain attribute, not a parameter or buffer:
    moving the module moves nothing, and the engine's device weight bytes do not count it (see
    :func:`llmc.engine.torch.loader.host_weight_bytes`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = weight

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, pin: bool) -> HostEmbedding:
        """A host copy of ``embedding``'s table (pinned when ``pin``); the caller drops the device table."""
        table = embedding.weight.detach().to("cpu").contiguous()
        return cls(table.pin_memory() if pin else table)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(input_ids.shape[0], self.embedding_dim, dtype=self.weight.dtype, device=input_ids.device)
        return gather_rows(self.weight, input_ids, out)

    def extra_repr(self) -> str:
        pinned = self.weight.is_pinned() if self.weight.device.type == "cpu" else False
        return f"{self.num_embeddings}, {self.embedding_dim}, host memory{' (page-locked)' if pinned else ''}"


def move_to_host(model: nn.Module) -> bool:
    """Put ``model.transformer.vocab_embedding`` (an untied input embedding) in host memory where :func:`placement`
    says so: page-locked when it was on CUDA (the device table is freed once nothing else holds it; the loader
    returns the allocator's cache to the device afterwards), as it is on CPU (the CUDA path run by Triton's
    interpreter in the tests). Returns whether it moved."""
    embedding = model.transformer.vocab_embedding
    if placement() != "host" or model.config.tie_word_embeddings or not isinstance(embedding, nn.Embedding):
        return False
    on_cuda = embedding.weight.device.type == "cuda"
    model.transformer.vocab_embedding = HostEmbedding.from_embedding(embedding, pin=on_cuda)
    return True

