"""The decoder's RMSNorm and SiLU-gated MLP (IR names: ``mlp.fc`` = HF gate_proj, ``mlp.gate`` = HF up_proj,
``mlp.proj`` = down_proj), shared by :mod:`llmc.engine.torch.model`'s layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmc.engine.torch import cpu_ext
from llmc.engine.torch.prefill_cpu import SplitLinear


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as transformers does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if cpu_ext.fused_available(x):
                return cpu_ext.rms_norm(x, self.weight, self.eps)  # one pass, one op
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # the same math
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """proj(silu(fc(x)) * gate(x)) with the IR's names (fc = HF gate_proj, gate = HF up_proj).

    After :meth:`fuse_fc_gate`, fc and gate run as one GEMM over their stacked weights.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.fc = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.fc_gate: torch.Tensor | None = None  # [2I, H] once fused
        self.fc_gate_kernel: nn.Module | None = None  # a kernel's module over [fc; gate], see use_fc_gate_kernel
        self.cuda_fused = False  # SiLU x gate as one Triton kernel (set by LlamaForCausalLM.use_cuda_fused)

    def fuse_fc_gate(self) -> bool:
        """Stack the fc and gate weights into one ``[2I, H]`` tensor; both Linear weights become views of it, so
        the state dict and memory stay the same. Only plain Linear layers fuse (int4 ones fuse through
        :meth:`use_fc_gate_kernel`). Returns whether fc and gate are fused (also when they already were)."""
        if self.fc_gate is not None:
            return True
        if type(self.fc) is not nn.Linear or type(self.gate) is not nn.Linear:
            return False
        fused = torch.cat([self.fc.weight.detach(), self.gate.weight.detach()])
        size = self.fc.out_features
        self.fc.weight = nn.Parameter(fused[:size], requires_grad=False)
        self.gate.weight = nn.Parameter(fused[size:], requires_grad=False)
        self.fc_gate = fused
        return True

    def use_fc_gate_kernel(self, fused: nn.Module) -> None:
        """Run fc and gate as one kernel module over the stacked rows ``[fc; gate]``: on CPU a
        :class:`~llmc.engine.torch.prefill_cpu.SplitLinear` (``Int4Linear``, ``Dense16Linear`` or ``MixedLinear``)
        built over :attr:`fc_gate`, whose ``silu_mul(x)`` gives ``silu(fc) * gate`` (fc and gate stay plain Linear
        views of the stacked weight until :meth:`drop_float_fc_gate`); on CUDA an ``Int4CudaLinear`` over the
        stacked packed weights (fc and gate are then removed by the loader: the model holds no float copy)."""
        assert self.fc_gate is not None or (self.fc is None and self.gate is None), \
            "fuse_fc_gate() first: a CPU kernel's module shares the stacked float weight"
        self.fc_gate_kernel = fused

    def drop_float_fc_gate(self) -> None:
        """Free the stacked float weight and its fc / gate views (which become None) once :attr:`fc_gate_kernel`
        keeps every form of the weight it multiplies itself (CPU, prefill in bfloat16): a third of the MLP's
        memory. Only :meth:`forward` runs the MLP after that."""
        assert self.fc_gate_kernel is not None, "use_fc_gate_kernel() first"
        self.fc_gate, self.fc, self.gate = None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.fc_gate_kernel, "silu_output", False):
            return self.proj(self.fc_gate_kernel(x))  # an int4 CUDA layer whose epilogue gives silu(fc) * gate
        if isinstance(self.fc_gate_kernel, SplitLinear):  # CPU: silu(fc) * gate by the kernel's module
            return self.proj(self.fc_gate_kernel.silu_mul(x))  # (fused into the bfloat16 prefill GEMM)
        if self.fc_gate_kernel is not None or self.fc_gate is not None:
            both = self.fc_gate_kernel(x) if self.fc_gate_kernel is not None else F.linear(x, self.fc_gate)  # [T, 2I]
            if self.cuda_fused:
                from llmc.engine.torch.int4_cuda import silu_mul  # optional dependency: Triton

                return self.proj(silu_mul(both))
            if cpu_ext.fused_available(both):
                return self.proj(cpu_ext.silu_mul(both))
            fc, gate = both.chunk(2, dim=-1)  # [T, I] each
        else:
            fc, gate = self.fc(x), self.gate(x)
        return self.proj(F.silu(fc) * gate)
