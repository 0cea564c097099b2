"""llmc's own CPU kernels (``csrc/*.cpp``), compiled on first use with the local C++ compiler.

- ``int4_matmul`` (``csrc/int4_matmul.cpp``): the W4A16 matmul of decode steps. PyTorch's CPU int4 op
  (``_weight_int4pack_mm_for_cpu``) rounds activations and group scales to bfloat16 and re-unpacks the weights
  for every 4 rows, so a 16-sequence decode step costs 4x a 4-row one. This kernel unpacks each 16-channel
  weight column once for up to 16 rows and keeps float32 throughout: the model computes exactly the dequantized
  weights the accuracy gate scored (up to summation order), and a row's result does not depend on the other
  rows of the call. Measured on SmolLM2's four layer shapes together (qkv, dense, fc+gate, proj; 2-core Xeon,
  hot loop, 2026-11-29 23:58, three runs), this kernel vs PyTorch's op: 1 row 162-210 vs 184-193 us (on
  par: one row is bound by the latency of its FMA chain), 4 rows 234-259 vs 304-376 us, 8 rows 365-396 vs
  559-584 us, 16 rows 652-672 vs 982-1,124 us. The kernel's previous form (unsigned nibbles, 16 row pointers
  that spilled out of the registers) took 748 us at 16 rows.
- ``dense16_matmul`` (``csrc/dense16_matmul.cpp``): the logits layer of a 16-bit checkpoint (and, unquantized,
  its decoder linears: :mod:`llmc.engine.torch.dense16_cpu`) in decode steps, over the exact float16/bfloat16
  weight in float32 math: half the bytes of the float32 copy per step. SmolLM2's 49,152 x 576 (hot loop,
  2026-11-29), against PyTorch's float32 matmul: 1 row 1.5 vs 2.2 ms, 16 rows 5.3 vs 6.8 ms.
- ``rms_norm``, ``add_rms_norm_``, ``silu_mul`` and ``rope`` (``csrc/fused_ops.cpp``): the decoder's elementwise work in
  one pass each, where PyTorch's forms dispatch 3-6 ops (an RMSNorm of one token: ~50 us as 6 ops); and
  ``argmax_rows``, the sampler's argmax over the vocabulary (16 x 49,152 logits: 52 vs 757 us for
  ``torch.argmax``; 1 row: 6 vs 87 us).
- ``bf16_gemm`` (``csrc/bf16_gemm.cpp``): the GEMMs of prefill steps on CPUs with AVX512-BF16 (steps of more than
  16 tokens of a 16-bit or AWQ checkpoint: :mod:`llmc.engine.torch.prefill_cpu`): x and W in bfloat16, products
  summed in float32 by ``vdpbf16ps``, twice the FLOPs per instruction of a float32 FMA; x is rounded inside, y
  leaves in float32. SmolLM2's four layer shapes (qkv, dense, fc+gate, proj) at 128 and 2,048 rows, one thread,
  per-thread CPU time (robust to the other processes of a shared machine), 2-core AMD EPYC (Zen 4), 2026-12-01:
  this kernel 201 GFLOP/s at both sizes, oneDNN's bfloat16 matmul through ``F.linear`` (with the casts of x and
  y) 179 / 185, float32 ``F.linear`` 86 / 88.
- ``paged_decode_attention`` (``csrc/paged_attention.cpp``): one-token queries over the paged KV cache
  (float32, float16 or bfloat16), read in place through the block tables: decode steps, and every token of
  prefill chunks of up to 128 tokens. The portable path copies every context out of the cache and pads it for
  SDPA. SmolLM2's shapes (9 query / 3 kv heads of 64, 161 cached tokens, float16 cache, one layer, hot loop,
  2026-11-29 23:58): 1 sequence 12.3 vs 91 us, 16 sequences 88 vs 587 us. Cycling through 30 layers' caches
  (as a decode step does), prefetching the rows 16 tokens ahead took 16 sequences from 114-121 to 97-100 us.

Availability: an x86-64 CPU with AVX-512 (PyTorch's CPU capability ``AVX512``), a C++ compiler and ninja.
The build takes ~13 s on 2 cores, once per checkout, Python environment and source version (cached under
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, in a folder of its own for each: see
:func:`build_directory`); ``llmc build`` starts it in the background when it begins
(:func:`load_in_background`), so it overlaps the GGUF conversion. ``LLMC_CPU_KERNELS=torch`` skips it.
Whenever it is unavailable, the engine uses PyTorch's ops (its int4 op, gathered SDPA attention), and
:func:`status` says why. The bfloat16 kernels (``bf16_gemm``, ``prefill_attention``) run only on CPUs with
AVX512-BF16 (:func:`has_avx512_bf16`); elsewhere, or with ``LLMC_CPU_PREFILL=float32``, prefill stays float32 and
:func:`prefill_status` says why.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
NAME = "llmc_cpu_v5"  # the module's name; its build folder is keyed by everything the build depends on
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
ENV = "LLMC_CPU_KERNELS"  # "torch": use PyTorch's ops instead
PREFILL_ENV = "LLMC_CPU_PREFILL"  # "float32": keep every CPU GEMM in float32, also where bfloat16 is available
TILE = 16  # output channels per int4 tile (one AVX-512 register of float32)
ATTENTION_HEAD_SIZES = (16, 32, 64, 128)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# -fopenmp: at::parallel_for runs on torch's thread pool; at run time the extension shares torch's own libgomp.
# -ffp-contract=off: a product and a sum stay two roundings unless a kernel asks for an FMA (RoPE matches
# transformers bit for bit this way).
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-ffp-contract=off", "-fopenmp"]

_why_not: str | None = None


def supports_shape(out_features: int, in_features: int, group_size: int) -> bool:
    """Whole tiles of 16 output channels and whole, even-sized groups."""
    return out_features % TILE == 0 and group_size % 2 == 0 and in_features % group_size == 0


def static_why_not() -> str | None:
    """Why llmc's kernels cannot run here, from what is visible without building them (``LLMC_CPU_KERNELS``, the
    CPU, a C++ compiler, ninja); None when a build can be tried."""
    if os.environ.get(ENV, "").lower() == "torch":
        return f"{ENV}=torch"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return f"this CPU's capability is {capability}, llmc's kernels need AVX512"
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not is_ninja_available():
        return "ninja is not installed"
    return None


_module: ModuleType | None = None
_loaded = False  # _module (and _why_not) hold the answer
_load_lock = threading.Lock()  # one build per process, whichever thread asks first
_background: threading.Thread | None = None


def load() -> ModuleType | None:
    """The compiled extension, or None (logged once, with the reason, and kept for :func:`status`).

    Thread-safe: the first caller builds (or waits for the build that :func:`load_in_background` started), and
    every caller gets that one answer."""
    global _module, _loaded
    if not _loaded:  # unlocked fast path: every kernel call asks
        with _load_lock:
            if not _loaded:
                _module = _build()
                _loaded = True
    return _module


def load_in_background() -> None:
    """Start :func:`load` in a thread and return at once; a later :func:`load` waits for it.

    The first build compiles (~13 s of g++ on 2 cores) while the caller does mostly single-threaded work (``llmc
    build``: the GGUF conversion). The thread is not a daemon: a process that ends early waits for the compile
    instead of leaving a half-written build folder behind."""
    global _background
    with _load_lock:
        if _loaded or _background is not None:
            return
        _background = threading.Thread(target=load, name="llmc-cpu-kernels")
    # torch's cpp_extension imports setuptools, whose distutils shim inserts a finder at sys.meta_path[0] and removes
    # it again: done in the thread, that removal can make an import running meanwhile in this thread skip the path
    # finder ("No module named 'transformers'", seen in CI). So the import happens here, before the thread starts.
    import torch.utils.cpp_extension  # noqa: F401
    _background.start()


def build_directory(root: Path | None = None) -> Path:
    """The extension's build folder under ``root`` (by default ``TORCH_EXTENSIONS_DIR``, else torch's
    ``~/.cache/torch_extensions``): one per source version (the .cpp and .h files' bytes, the
    flags), Python environment (torch's version and location, Python's version) and checkout (the sources' folder).

    torch writes the absolute paths of the sources and of its own headers into the folder's build.ninja and runs
    ninja at every load, so two checkouts or environments sharing one folder rebuild the library (13-30 s)
    whenever they alternate, each under the other's feet (seen on 2026-12-04 between a CI clone and a README
    check running side by side). A folder of their own keeps each one's library as it built it."""
    from torch.utils.cpp_extension import get_default_build_root

    key = hashlib.sha256()
    for part in (NAME, torch.__version__, str(Path(torch.__file__).parent), sys.version, str(SOURCES[0].parent),
                 *FLAGS):
        key.update(part.encode() + b"\0")
    for source in (*SOURCES, *HEADERS):
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    return Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / (
        f"{NAME}_{key.hexdigest()[:16]}")


def _build() -> ModuleType | None:
    global _why_not
    _why_not = static_why_not()
    if _why_not is not None:
        if "capability" not in _why_not and ENV not in _why_not:
            logger.warning("llmc's CPU kernels are unavailable, using PyTorch's ops: %s. Fix: install a C++ "
                           "compiler and ninja (pip install ninja)", _why_not)
        return None
    try:
        from torch.utils.cpp_extension import load as build

        directory = build_directory()
        with _build_lock(directory):
            module = build(name=NAME, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001 - a failed build: fall back, say why
        _why_not = f"building it failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
        logger.warning("llmc's CPU kernels are unavailable, using PyTorch's ops: %s. Fix: install a C++ "
                       "compiler and ninja (pip install ninja)", _why_not)
        return None
    return module


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock around torch's build, and clear a ``lock`` file that a killed process left behind.

    torch's ``FileBaton`` is a plain file that its owner deletes when done: a process killed with -9 while it
    loads the extension (every load takes it, even with nothing to rebuild) leaves it behind, and every later
    load waits for it forever. An flock dies with its process, so whoever holds ours knows that no live
    process is inside torch's build and that a ``lock`` file found now is stale."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "llmc.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a process that was killed while loading llmc's CPU kernels", stale)
            stale.unlink(missing_ok=True)
        yield


def status() -> str:
    """One line: which CPU kernels this process uses, and why."""
    if load() is not None:
        return "llmc AVX-512 kernels"
    return f"PyTorch's ops ({_why_not})"


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or "unknown"


def has_avx512_bf16() -> bool:
    """True when this CPU has AVX512-BF16 (``avx512_bf16`` in ``/proc/cpuinfo``; False where it is unreadable)."""
    return "avx512_bf16" in _cpu_flags()


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _cpu_flags() -> frozenset[str]:
    return frozenset(word for line in _cpuinfo_lines() if line.startswith("flags") for word in line.split())


def bf16_prefill_why_not(build: bool = True) -> str | None:
    """None when prefill GEMMs and attention of 16-bit checkpoints run in bfloat16 here (AVX512-BF16, llmc's
    kernels, not turned off), else why they stay float32. ``build``: build the kernels if needed to be sure (as
    :func:`load`); without it, judge from :func:`static_why_not` (``llmc doctor``: no build)."""
    if os.environ.get(PREFILL_ENV, "").lower() == "float32":
        return f"{PREFILL_ENV}=float32"
    if not has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    if build and load() is None:
        return f"llmc's CPU kernels are unavailable: {_why_not}"
    if not build and static_why_not() is not None:
        return f"llmc's CPU kernels are unavailable: {static_why_not()}"
    return None


def prefill_status(build: bool = True) -> str:
    """One line: the precision of this machine's CPU prefill steps for 16-bit (and AWQ) checkpoints, and why
    (:func:`bf16_prefill_why_not`; float32 checkpoints always prefill in float32)."""
    why_not = bf16_prefill_why_not(build)
    if why_not is None:
        return "bfloat16 GEMMs and attention with float32 accumulation (AVX512-BF16, llmc's kernels)"
    return f"float32 GEMMs ({why_not})"


def bf16_gemm_shape(out_features: int, in_features: int) -> bool:
    """Whole tiles of 16 output channels and whole column pairs: what :func:`pack_bf16_pairs` takes."""
    return out_features % TILE == 0 and in_features % 2 == 0


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A ``[N, K]`` weight -> ``bf16_gemm``'s bfloat16 ``[N/16, K/2, 16, 2]`` (rounded to nearest even)."""
    n, k = weight.shape
    assert bf16_gemm_shape(n, k), tuple(weight.shape)
    return weight.detach().to(torch.bfloat16).view(n // TILE, TILE, k // 2, 2).transpose(1, 2).contiguous()


def bf16_gemm(x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` times the weight packed by :func:`pack_bf16_pairs` -> float32 ``[M, N]``, with x
    rounded to bfloat16 and products summed in float32 (check :func:`bf16_prefill_why_not` first)."""
    return load().bf16_gemm(x, pairs)


def bf16_gemm_silu_mul(x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """For a stacked ``[fc; gate]`` weight ``[2I, K]`` packed by :func:`pack_bf16_pairs` (I a multiple of 16):
    ``silu(x @ fc^T) * (x @ gate^T)`` -> float32 ``[M, I]``, in :func:`bf16_gemm`'s precision, without the
    ``[M, 2I]`` intermediate."""
    return load().bf16_gemm_silu_mul(x, pairs)


def decode_attention_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when :func:`paged_decode_attention` takes these operands (CPU, float32 queries, a float32, float16 or
    bfloat16 cache, a supported head size)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES
            and q.shape[-1] in ATTENTION_HEAD_SIZES and load() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, ``q [D, nh, hd]``, over its cached context -> ``[D, nh, hd]``
    (``csrc/paged_attention.cpp``; check :func:`decode_attention_available` first)."""
    return load().paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)


PREFILL_ATTENTION_HEAD_SIZES = (32, 64, 128)


def prefill_attention_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when :func:`prefill_attention` takes these operands (CPU, float32 queries, a float32, float16 or
    bfloat16 cache, head size 32, 64 or 128) and this CPU runs it (:func:`bf16_prefill_why_not`)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES
            and q.shape[-1] in PREFILL_ATTENTION_HEAD_SIZES and bf16_prefill_why_not() is None)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      chunks: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of prefill chunks in bfloat16 products with float32 sums (``csrc/prefill_attention.cpp``):
    ``chunks`` int32 ``[P, 4]`` rows (row of ``tables``, packed index of the chunk's first token, its tokens,
    tokens cached before it); writes those tokens' rows of ``out [T, nh, hd]`` (float32, contiguous). Check
    :func:`prefill_attention_available` first."""
    load().prefill_attention(q, k_cache, v_cache, tables, chunks, scale, out)


def pack_tiles(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` int [N, K] in [-8, 7] and ``scale`` [N, K/g] -> the kernel's ``packed`` int8 [N/16, K/2, 16] and
    ``scales`` float32 [N/16, K/g, 16] (see ``csrc/int4_matmul.cpp``)."""
    n, k = q.shape
    assert supports_shape(n, k, group_size), (tuple(q.shape), group_size)
    nibbles = (q.to(torch.int16) & 0xF).view(n // TILE, TILE, k).transpose(1, 2)  # [T, K, 16], two's complement
    pairs = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [T, K/2, 16]: column 2p low, 2p + 1 high, in [0, 255]
    packed = pairs.to(torch.uint8).view(torch.int8).contiguous()
    scales = scale.to(torch.float32).view(n // TILE, TILE, k // group_size).transpose(1, 2).contiguous()
    return packed, scales


def exact_copy16(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A float32 CPU ``weight [N, K]`` in the 16-bit ``dtype`` when that loses nothing and its rows fill whole
    tiles (what :func:`pack_tiles16` takes), else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] % TILE:
        return None
    narrow = weight.detach().to(dtype)
    return narrow if torch.equal(narrow.float(), weight) else None


def pack_tiles16(weight: torch.Tensor) -> torch.Tensor:
    """A float16 or bfloat16 ``[N, K]`` weight -> ``dense16_matmul``'s tiles ``[N/16, K, 16]`` (same dtype)."""
    n, k = weight.shape
    assert n % TILE == 0 and weight.dtype in (torch.float16, torch.bfloat16), (tuple(weight.shape), weight.dtype)
    return weight.view(n // TILE, TILE, k).transpose(1, 2).contiguous()


def dense16_matmul(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` times the 16-bit weight packed by :func:`pack_tiles16` -> float32 ``[M, N]``."""
    return load().dense16_matmul(x, tiles)


def fused_available(x: torch.Tensor) -> bool:
    """True when the fused elementwise ops take ``x`` (contiguous float32 ``[T, H]`` rows on CPU)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
            and load() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row (check :func:`fused_available` first)."""
    return load().rms_norm(x, weight, eps)


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (the residual add), then the RMSNorm of ``h``, in one pass."""
    return load().add_rms_norm_(h, delta, weight, eps)


def silu_mul(a: torch.Tensor) -> torch.Tensor:
    """``silu(a[:, :I]) * a[:, I:]`` for ``a [T, 2I]`` (the stacked fc and gate outputs)."""
    return load().silu_mul(a)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its maximum, ``x`` float32 ``[R, V]`` on CPU -> int64 ``[R]``: torch.argmax's
    answer where no value is NaN (a NaN never wins here), ~15x faster over a vocabulary."""
    return load().argmax_rows(x.float().contiguous())


def rope_available(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """True when :func:`rope` takes ``x [T, heads, hd]`` (float32 CPU, contiguous heads, hd a multiple of 32)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and cos.dtype == torch.float32 and x.dim() == 3
            and x.shape[-1] % 32 == 0 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and load() is not None)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + cat(x2, x1) * sin`` in one pass (check :func:`rope_available` first)."""
    return load().rope(x, cos.contiguous(), sin.contiguous())
