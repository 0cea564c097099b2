"""Where the torch engine's Triton kernels come from: the lazy import, and the interpreter switch of the tests.

Triton is optional (CPU builds of PyTorch ship without it). Every kernel module asks :func:`modules` for
``(triton, tl)`` and builds its kernels on first use, so importing llmc never imports Triton.

``TRITON_INTERPRET=1`` makes ``triton.jit`` return interpreted kernels that run on CPU tensors with NumPy: the
CPU tests use it to check the kernels' indexing, packing and masking in CI. The interpreter's ``tl.dot`` gives
wrong results for bfloat16 operands (measured: Triton 3.6), so kernels widen their dot operands to float32 when
:func:`interpreting` is true (``DOT_F32``); the arithmetic on the GPU is then checked by the ``gpu`` tests.
"""

from __future__ import annotations

import functools
import os

INTERPRET_ENV = "TRITON_INTERPRET"
PDL_ENV = "LLMC_TRITON_PDL"  # "0": the step's Triton kernels launch plainly (see pdl_launch)


@functools.cache
def modules():
    """``(triton, triton.language)``, or None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def version() -> str | None:
    """The installed Triton version, or None."""
    found = modules()
    return None if found is None else found[0].__version__


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    n = max(n, floor)
    return 1 << (n - 1).bit_length()


@functools.cache
def early_launch(device) -> bool:
    """Whether the Triton kernels that come right before an int4 CUDA kernel in a step (the norms, the attention
    merge) let it start its blocks early (``griddepcontrol.launch_dependents``, sm_90+): where llmc's CUDA int4
    kernels launch with programmatic dependent launch (:func:`llmc.engine.torch.cuda_ext.pdl`) and this Triton has
    the instruction. The int4 kernel waits for them before it reads their output, so the result is the same."""
    if interpreting() or modules() is None or getattr(device, "type", device) != "cuda":
        return False
    from llmc.engine.torch import cuda_ext  # a leaf module of the same package, imported only on CUDA

    cuda = getattr(getattr(modules()[1], "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_launch_dependents") and cuda_ext.pdl(device) > 0


@functools.cache
def pdl_launch(device) -> bool:
    """Whether the Triton kernels of a CUDA step (the norms, RoPE + KV write, decode attention and its merge, SiLU x
    gate) launch with programmatic dependent launch: each is launched while the kernel before it runs, lets the next
    one launch at its own start (``gdc_launch_dependents``) and waits for the previous one to finish (``gdc_wait``)
    before it reads or writes anything, so its launch latency hides behind its predecessor and the results are
    unchanged.
    Where :func:`early_launch` holds (sm_90+, llmc's int4 kernels launch so), this Triton has ``gdc_wait`` and the
    ``launch_pdl`` option, and ``LLMC_TRITON_PDL`` is not ``0``."""
    if not early_launch(device) or pdl_switched_off():
        return False
    _, tl = modules()
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in fields


def switched_off(env: str) -> bool:
    """The environment variable ``env`` says ``0`` (or false / off): a switch of the CUDA step that is on unless
    said so (``LLMC_TRITON_PDL``, ``LLMC_ROPE_EPILOGUE``)."""
    return os.environ.get(env, "1").strip().lower() in ("0", "false", "off")


def pdl_switched_off() -> bool:
    """``LLMC_TRITON_PDL`` is ``0`` (or false / off): the step's Triton kernels launch plainly."""
    return switched_off(PDL_ENV)


def launch_options(device) -> dict:
    """Keyword arguments of a step kernel's launch: ``{"launch_pdl": True}`` where :func:`pdl_launch` holds (the
    kernel must then execute ``gdc_wait`` before touching memory), else nothing."""
    return {"launch_pdl": True} if pdl_launch(device) else {}


_PDL_ON, _PDL_OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # read-only: callers unpack them


def pdl_kwargs(device) -> dict:
    """A step kernel's ``PDL`` constexpr and launch options in one lookup: ``{"PDL": True, "launch_pdl": True}``
    where :func:`pdl_launch` holds, else ``{"PDL": False}`` (no dict built per launch)."""
    return _PDL_ON if pdl_launch(device) else _PDL_OFF
