"""llmc's CUDA C++ kernels (``csrc_cuda/*.cu``), compiled on first use with nvcc and loaded with ctypes.

- ``llmc_w4a16_mma`` (``csrc_cuda/w4a16_mma.cu``): the W4A16 product of decode-sized steps on the tensor cores,
  one read of the packed weight (layout: :func:`llmc.engine.torch.int4_layout.pack_mma`), each warp streaming its
  weight tiles through a cp.async ring of ``stages`` tiles in shared memory (``stages`` 0: the register kernel,
  each warp's tiles loaded straight into registers at once; negative ``stages``, sm_90 only: the warpgroup kernel,
  Hopper's wgmma over 8-256 rows a block that share their activations); ``llmc_w4a16_mma_rope``: the same product
  for a qkv layer whose columns are interleaved per head, its epilogue rotating q and k (RoPE) and writing k and v
  to their KV-cache slots (:meth:`llmc.engine.torch.int4_cuda.Int4CudaLinear.rope_write_kv`); ``llmc_w4a16_mma_dequant``
  writes the effective 16-bit weight for prefill steps (cuBLAS multiplies it). On sm_90+ the product launches with
  programmatic dependent launch (:func:`pdl`): its first weight tiles are requested while the previous kernel of
  the step finishes, also inside CUDA graphs.

The library has a plain C interface (no PyTorch headers), so the build is nvcc alone: the source in 8 parts compiled
in parallel, then linked (:func:`build`; 3.5 minutes of compiling on one core, once per machine) for the GPU's own
architecture, cached under ``LLMC_CACHE_DIR`` (default ``~/.cache/llmc``) by source hash, flags (architecture
included) and nvcc version. Launches go to PyTorch's current stream, so
CUDA-graph capture records them like any other kernel. ``LLMC_CUDA_INT4=triton`` skips it; whenever it is
unavailable (no nvcc, a GPU older than sm_80, a failed build), the int4 layers use llmc's Triton kernels instead and
:func:`status` says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc_cuda" / "w4a16_mma.cu"
ENV = "LLMC_CUDA_INT4"  # "triton": use the Triton kernels instead
ABI_VERSION = 14
PDL_ENV = "LLMC_CUDA_PDL"  # "0": int4 kernels launch without programmatic dependent launch; see pdl()
DTYPES = {torch.bfloat16: 0, torch.float16: 1}

_why_not: str | None = None


def nvcc_path() -> str | None:
    """nvcc from ``CUDA_HOME``/``CUDA_PATH``, ``/usr/local/cuda`` or PATH."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def static_why_not(device: torch.device | int | None = None) -> str | None:
    """Why the CUDA kernels cannot run, from what is visible without building them; None when a build can be
    tried."""
    if os.environ.get(ENV, "").lower() == "triton":
        return f"{ENV}=triton"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"this GPU is sm_{major}{minor}; the kernels need sm_80 or newer (bf16 tensor cores)"
    if nvcc_path() is None:
        return "nvcc was not found (CUDA_HOME, /usr/local/cuda, PATH)"
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("LLMC_CACHE_DIR") or Path.home() / ".cache" / "llmc") / "cuda"


def arch_of(sm: int) -> str:
    """The architecture the library is built for on a GPU of compute capability ``sm`` (e.g. 90 -> "90a": Hopper's
    full instruction set)."""
    return f"{sm}" + ("a" if sm // 10 == 9 else "")


def _arch(device: torch.device | int | None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return arch_of(10 * major + minor)


PARTS = 8  # the source's parts, compiled in parallel (csrc_cuda/w4a16_mma.cu, "Parts")
JOBS_ENV = "LLMC_CUDA_BUILD_JOBS"  # nvcc processes at a time (default: one per CPU this process may use, at most 8)


def build_jobs() -> int:
    """How many parts compile at once: ``LLMC_CUDA_BUILD_JOBS``, else the CPUs this process may run on (at most
    :data:`PARTS`)."""
    value = os.environ.get(JOBS_ENV)
    if value is None:
        return max(1, min(PARTS, len(os.sched_getaffinity(0))))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{JOBS_ENV}={value!r} is not a number of processes: set it to a whole number >= 1")
    return int(value)


def build(nvcc: str, arch: str, out_dir: Path) -> Path:
    """Compile the library for ``sm_{arch}`` into ``out_dir`` (once per source, flags and nvcc; a file lock keeps
    concurrent processes from building twice; the result appears under its final name only when complete).

    The source compiles as :data:`PARTS` objects, :func:`build_jobs` nvcc processes at a time, then one link: about
    3.5 minutes of compiling in all (one 2.6 GHz core): 1 min 53 s on two cores, 76-89 s on the device tool's
    16-core H100 box, 8 at a time (measured; its cores are slower for nvcc: one call took over 5.5 minutes)."""
    target = library_path(nvcc, arch, out_dir)
    gencode, flags = _flags(arch)
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        jobs = build_jobs()
        logger.warning("Compiling llmc's CUDA int4 kernels for sm_%s with nvcc (%d parts, %d at a time; once per "
                       "machine, cached in %s)", arch, PARTS, jobs, out_dir)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            objects = [Path(tmp) / f"part{i}.o" for i in range(PARTS)]
            commands = [[nvcc, *flags, f"-DLLMC_PARTS={PARTS}", f"-DLLMC_PART={i}", "-c", "-o", str(obj),
                         str(SOURCE)] for i, obj in enumerate(objects)]
            _run_all(commands, jobs, Path(tmp))
            partial = Path(tmp) / target.name
            # --no-undefined: a unit missing from every part fails here, naming it, not when the library loads
            _run_all([[nvcc, gencode, "-shared", "-Xlinker", "--no-undefined", "-o", str(partial),
                       *map(str, objects)]], 1, Path(tmp))
            os.replace(partial, target)
    return target


def _flags(arch: str) -> tuple[str, list[str]]:
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    return gencode, ["-O3", "-std=c++17", gencode, "-Xcompiler", "-fPIC"]


def library_path(nvcc: str, arch: str, out_dir: Path) -> Path:
    """Where :func:`build` puts (or found) the library for ``sm_{arch}``: named by a hash of the source, the flags,
    the parts and nvcc's version (asked of ``nvcc --version``)."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    _, flags = _flags(arch)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags + [f"parts {PARTS}", version]).encode()).hexdigest()
    return out_dir / f"libllmc_cuda_{arch}_{key[:16]}.so"


def build_state(sm: int) -> str:
    """Whether the library for a GPU of compute capability ``sm`` is built here (its path) or what its first use
    will compile (``llmc doctor``); nvcc must be found (:func:`static_why_not`)."""
    nvcc = nvcc_path()
    if nvcc is None:
        return "nvcc was not found"
    path = library_path(nvcc, arch_of(sm), cache_dir())
    if path.exists():
        return f"built: {path}"
    try:
        jobs = f"{build_jobs()} at a time"
    except ValueError as exc:  # a mistyped LLMC_CUDA_BUILD_JOBS: the build would fall back to Triton, naming it
        jobs = str(exc)
    return (f"not built yet: the first int4 engine compiles them with nvcc ({PARTS} parts, {jobs}; about 2 minutes "
            f"on 2 cores) into {path.parent}")


def _run_all(commands: list[list[str]], jobs: int, logs: Path) -> None:
    """Run the commands, ``jobs`` at a time, each one's output to a file in ``logs``; the first to fail stops the
    others and raises, naming nvcc's error."""
    waiting, running = list(enumerate(commands)), {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                i, command = waiting.pop(0)
                with open(logs / f"nvcc{i}.log", "w") as log:
                    running[i] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            finished = [i for i, process in running.items() if process.poll() is not None]
            if not finished:
                time.sleep(0.05)
            for i in finished:
                if running.pop(i).returncode != 0:
                    output = (logs / f"nvcc{i}.log").read_text(errors="replace")
                    raise RuntimeError(f"nvcc failed: {output.strip()[-400:]}")
    finally:
        for process in running.values():
            process.kill()
            process.wait()


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library for the current GPU, or None (logged once, with the reason, and kept for
    :func:`status`)."""
    global _why_not
    _why_not = static_why_not()
    if _why_not is not None:
        if ENV not in _why_not and "visible" not in _why_not:
            logger.warning("llmc's CUDA int4 kernels are unavailable, using the Triton kernels: %s", _why_not)
        return None
    try:
        path = build(nvcc_path(), _arch(None), cache_dir())
        lib = ctypes.CDLL(str(path))
        if lib.llmc_w4a16_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI {lib.llmc_w4a16_abi_version()}, expected {ABI_VERSION}")
    except Exception as exc:  # noqa: BLE001 - a failed build: fall back, say why
        _why_not = f"building them failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]})"
        logger.warning("llmc's CUDA int4 kernels are unavailable, using the Triton kernels: %s. Fix: install the "
                       "CUDA toolkit (nvcc) matching the driver, or set %s=triton", _why_not, ENV)
        return None
    i, p, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
    split = [p, ll, p, i]  # split-K's partial sums and counters, each with its capacity
    norm = [p, i, ctypes.c_float]  # a pending input norm: sums, blocks a row, eps
    lib.llmc_w4a16_mma.argtypes = [i, i, i, i, i, p, i, p, p, p, p, i, i, i, i, i, i, i, *split, *norm, i, p]
    lib.llmc_w4a16_mma.restype = i
    lib.llmc_w4a16_mma_rope.argtypes = [i, i, i, i, i, p, i, p, p, p, i, i, i, i, i, p, p, i, p, i, p, i, p, p, i, i,
                                        *split, *norm, i, p]
    lib.llmc_w4a16_mma_rope.restype = i
    lib.llmc_w4a16_mma_dequant.argtypes = [i, p, p, p, p, i, i, i, i, i, p]
    lib.llmc_w4a16_mma_dequant.restype = i
    lib.llmc_w4a16_mma_add.argtypes = [i, i, i, i, i, p, i, p, p, p, i, i, i, i, p, i, p, i, p, p, ll, i, p]
    lib.llmc_w4a16_mma_add.restype = i
    return lib


def why_not() -> str | None:
    """Why the int4 layers of this process do not use llmc's CUDA kernels (None: they do); builds them if need be."""
    return None if load() is not None else _why_not


def status() -> str:
    """One line: which int4 kernels CUDA layers of this process use, and why."""
    why = why_not()
    return f"llmc's Triton W4A16 kernels ({why})" if why else ("llmc's CUDA tensor-core W4A16 kernels (decode) + "
                                                               "dequantize and cuBLAS (prefill)")


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: " + ("unsupported shape or config" if code == -1 else
                                                   f"CUDA error {code}"))


PDL_EARLY_MAX_ROWS = 16  # the default mode's early trigger: products of at most this many rows (see pdl_mode)


def pdl_mode(major: int) -> int:
    """How int4 kernels launch on a GPU of compute capability ``major``.x (``LLMC_CUDA_PDL``): 0 plainly (``0``, and
    before sm_90); otherwise with programmatic dependent launch, each kernel requesting its first weight tiles while
    the previous kernel of the step finishes and waiting for that kernel before it reads the activations or writes
    anything (``csrc_cuda/w4a16_mma.cu``). 2 (``late``): a kernel lets the next one start once each of its blocks
    has its loads done; 1 (``early``): at once; 3 (the default, ``auto``): early for products of at most
    :data:`PDL_EARLY_MAX_ROWS` rows, late above (:func:`launch_mode`). The 8B shape's decode-step linears on the
    H200 in step order (``bench_linears.py --step-order``, 2026-12-04 14:50): late / early 1.350 / 1.286-1.294 ms
    at 1 row, 1.410 / 1.362-1.372 at 8, 1.736 / 1.675-1.688 at 16, 2.465 / 2.465-2.489 at 32, 3.401 / 3.416-3.429
    at 64, 6.132 / 6.321-6.330 at 128."""
    value = os.environ.get(PDL_ENV, "auto")
    mode = {"0": 0, "false": 0, "off": 0, "early": 1, "late": 2, "auto": 3}.get(value.strip().lower())
    if mode is None:
        raise ValueError(f"{PDL_ENV}={value!r} is not a launch mode: set it to auto (the default), early, late or 0 "
                         f"(plain launches), or unset it")
    return 0 if major < 9 else mode


PDL_MODES = {0: "off", 1: "early", 2: "late", 3: f"early up to {PDL_EARLY_MAX_ROWS} rows, late above"}


def launch_mode(mode: int, rows: int) -> int:
    """What the library takes for a product of ``rows`` rows under :func:`pdl_mode` ``mode`` (0 plain, 1 early,
    2 late): ``auto`` (3) resolved by the row count."""
    if mode != 3:
        return mode
    return 1 if rows <= PDL_EARLY_MAX_ROWS else 2


def warpgroup_kernels(device: torch.device | int | None = None) -> bool:
    """Whether the library's warpgroup (wgmma) kernel runs on ``device``: compute capability 9.x, for which the
    library is built as sm_90a (negative-stages configs, :data:`llmc.engine.torch.int4_configs.WGMMA_STAGES`)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def pdl(device: torch.device | int | None = None) -> int:
    """:func:`pdl_mode` of ``device`` (read once per process)."""
    return pdl_mode(torch.cuda.get_device_capability(device)[0])


def _stream(device: torch.device) -> int:
    """The raw handle of PyTorch's current stream on ``device`` (what Triton's launcher asks for: a few us, where
    ``torch.cuda.current_stream(device).cuda_stream`` builds a Stream object first)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def rows_aligned(x: torch.Tensor) -> bool:
    """``x`` [T, K] as the kernels read their inputs: unit stride, rows 16-byte aligned (a strided view of such rows
    included)."""
    return x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where :func:`rows_aligned` holds, else a contiguous copy."""
    return x if rows_aligned(x) else x.contiguous()


def _check_x(x: torch.Tensor) -> ctypes.CDLL:
    lib = load()
    assert lib is not None and x.dtype in DTYPES and rows_aligned(x)
    return lib


def _split_args(partials: torch.Tensor | None, counters: torch.Tensor | None) -> tuple:
    """Split-K's buffers as the library takes them: pointer and capacity of the float32 partial sums and of the
    int32 counters (zero between launches); null and 0 where a config does not split."""
    if partials is None or counters is None:
        return None, 0, None, 0
    assert partials.dtype == torch.float32 and counters.dtype == torch.int32
    return partials.data_ptr(), partials.numel(), counters.data_ptr(), counters.numel()


def w4a16_mma(x: torch.Tensor, words: torch.Tensor, scale_pairs: torch.Tensor, prequant: torch.Tensor | None,
              y: torch.Tensor, n: int, k: int, group_size: int, silu_out: bool, m_tiles: int, n_tiles: int,
              warps: int, stages: int, period: int = 0, partials: torch.Tensor | None = None,
              counters: torch.Tensor | None = None, in_sums: torch.Tensor | None = None, in_blocks: int = 0,
              in_eps: float = 0.0) -> None:
    """``y = x @ W^T`` (``silu(fc) * gate`` with ``silu_out``) into ``y`` on the current stream; ``period``: the
    weight's columns interleaved in blocks of 8 within segments of that many columns
    (:func:`llmc.engine.torch.int4_layout.interleave_halves`), written back in their own order. ``partials``,
    ``counters``: split-K's buffers (:func:`llmc.engine.torch.int4_configs.split_buffers`), for split configs.
    ``in_sums`` (with ``in_blocks``, ``in_eps``): ``x`` is :func:`w4a16_mma_add`'s ``scaled`` rows, whose RMSNorm
    is pending (the sums it left); the kernel multiplies each row's products by the norm's factor."""
    lib = _check_x(x)
    assert y.stride(-1) == 1
    _check(lib.llmc_w4a16_mma(
        DTYPES[x.dtype], m_tiles, n_tiles, warps, stages, x.data_ptr(), x.stride(0), words.data_ptr(),
        scale_pairs.data_ptr(),
        prequant.data_ptr() if prequant is not None else None, y.data_ptr(), y.stride(0), x.shape[0], n, k,
        group_size, int(silu_out), period, *_split_args(partials, counters), *_norm_args(in_sums, in_blocks, in_eps),
        launch_mode(pdl(x.device), x.shape[0]), _stream(x.device)), "llmc_w4a16_mma")


def w4a16_mma_rope(x: torch.Tensor, words: torch.Tensor, scale_pairs: torch.Tensor, prequant: torch.Tensor | None,
                   n: int, k: int, group_size: int, config: tuple[int, int, int, int], cos: torch.Tensor,
                   sin: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, partials: torch.Tensor | None = None,
                   counters: torch.Tensor | None = None, in_sums: torch.Tensor | None = None, in_blocks: int = 0,
                   in_eps: float = 0.0) -> None:
    """A qkv layer's product with RoPE and the KV-cache write in its epilogue: the weight's columns interleaved per
    head (period = head size), ``cos, sin [T, hd]`` (the tables of :func:`llmc.engine.torch.rope.rope_cos_sin`),
    ``slots [T]`` int64, rotated queries into ``q [T, nh * hd]``, keys and values into the caches
    ``[blocks, block_size, nkv, hd]`` (x's dtype); ``partials``, ``counters``, the pending input norm: as in
    :func:`w4a16_mma`."""
    lib = _check_x(x)
    head = k_cache.shape[-1]
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0) and q.stride(-1) == 1
    assert slots.dtype == torch.int64 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.dtype == sin.dtype == q.dtype == k_cache.dtype == v_cache.dtype == x.dtype
    _check(lib.llmc_w4a16_mma_rope(
        DTYPES[x.dtype], *config, x.data_ptr(), x.stride(0), words.data_ptr(), scale_pairs.data_ptr(),
        prequant.data_ptr() if prequant is not None else None, x.shape[0], n, k, group_size, head, cos.data_ptr(),
        sin.data_ptr(), cos.stride(0), slots.data_ptr(), slots.stride(0), q.data_ptr(), q.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), num_heads, num_kv_heads, *_split_args(partials, counters),
        *_norm_args(in_sums, in_blocks, in_eps), launch_mode(pdl(x.device), x.shape[0]), _stream(x.device)),
        "llmc_w4a16_mma_rope")


def w4a16_mma_add(x: torch.Tensor, words: torch.Tensor, scale_pairs: torch.Tensor, prequant: torch.Tensor | None,
                  n: int, k: int, group_size: int, config: tuple[int, int, int, int], resid: torch.Tensor,
                  scaled: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor) -> None:
    """An o or down projection's product added to the residual stream ``resid [T, n]`` in place (rounded to its
    dtype), with ``scaled [T, n]`` the new rows times ``norm_weight [n]`` (the next RMSNorm's weight) and ``sums``
    (float32, T x n / (16 x column tiles), row-major) each block's sum of the new rows' squares: the next layer's
    input and pending norm (``in_sums`` of :func:`w4a16_mma`). A ring config (stages 2, 4)."""
    lib = _check_x(x)
    assert resid.dtype == scaled.dtype == norm_weight.dtype == x.dtype and sums.dtype == torch.float32
    assert resid.stride(-1) == 1 and scaled.stride(-1) == 1 and norm_weight.is_contiguous()
    _check(lib.llmc_w4a16_mma_add(
        DTYPES[x.dtype], *config, x.data_ptr(), x.stride(0), words.data_ptr(), scale_pairs.data_ptr(),
        prequant.data_ptr() if prequant is not None else None, x.shape[0], n, k, group_size, resid.data_ptr(),
        resid.stride(0), scaled.data_ptr(), scaled.stride(0), norm_weight.data_ptr(), sums.data_ptr(), sums.numel(),
        launch_mode(pdl(x.device), x.shape[0]), _stream(x.device)), "llmc_w4a16_mma_add")


def _norm_args(in_sums: torch.Tensor | None, in_blocks: int, in_eps: float) -> tuple:
    """A pending input norm as the library takes it (null, 0, 0 for none)."""
    if in_sums is None:
        return None, 0, 0.0
    assert in_sums.dtype == torch.float32 and in_blocks > 0
    return in_sums.data_ptr(), in_blocks, in_eps


def w4a16_mma_dequant(words: torch.Tensor, scale_pairs: torch.Tensor, prequant: torch.Tensor | None,
                      out: torch.Tensor, n: int, k: int, group_size: int, period: int) -> None:
    """The effective weight ``[K, N]`` into ``out``, columns in their own order (``period``: as in
    :func:`w4a16_mma`; fc + gate tiles, period N, come out as ``[fc | gate]``); with programmatic dependent launch
    where :func:`pdl` is on (the blocks read their tiles while the previous kernel finishes, and write only once it
    has)."""
    lib = load()
    assert lib is not None and out.dtype in DTYPES and out.is_contiguous()
    _check(lib.llmc_w4a16_mma_dequant(
        DTYPES[out.dtype], words.data_ptr(), scale_pairs.data_ptr(),
        prequant.data_ptr() if prequant is not None else None, out.data_ptr(), n, k, group_size, period,
        int(pdl(out.device) > 0), _stream(out.device)), "llmc_w4a16_mma_dequant")
