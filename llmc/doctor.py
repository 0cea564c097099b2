"""``llmc doctor``: what this machine has (GPU, CPU, driver, CUDA, library versions) and which engine
backends are usable here, each with the reason when not; for the CPU, which kernels and which prefill precision
the torch engine uses, and where ``llmc build`` sends its float32 GEMMs.

Nothing here needs a GPU or TensorRT: every probe reports what it found or why it found nothing.
``tensorrt`` and ``tensorrt_llm`` are imported lazily, only when the report is collected.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass

import click

from llmc.engine.tensorrt_llm.checks import INT4_REFUSED_SM
from llmc.engine.tensorrt_llm.versions import PIP_SPEC, Importer, check_version, probe_module
from llmc.errors import BackendUnavailableError, LlmcError

# Distribution names read from package metadata (no import: llmcompressor takes seconds to import).
METADATA_PACKAGES = ("torch", "transformers", "triton", "tritonclient", "llmcompressor")


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as torch sees it."""

    index: int
    name: str
    compute_capability: str  # "9.0"
    memory_gib: float
    multiprocessors: int = 0

    @property
    def sm(self) -> int:
        major, minor = self.compute_capability.split(".")
        return int(major) * 10 + int(minor)


@dataclass(frozen=True)
class CpuInfo:
    """This machine's CPU as the torch engine's CPU path sees it (judged without building llmc's kernels)."""

    model: str
    cores: int
    capability: str  # PyTorch's CPU capability: AVX512, AVX2, DEFAULT
    avx512_bf16: bool
    kernels: str  # llmc's kernels, or PyTorch's ops and why
    prefill: str  # the precision of prefill steps of 16-bit and AWQ checkpoints, and why
    build_gemm: str = ""  # the library of llmc build's float32 GEMMs on the CPU (calibration passes, gate), and why


@dataclass(frozen=True)
class BackendStatus:
    """Whether an engine backend can build/run on this machine, and why not."""

    name: str
    usable: bool
    detail: str


@dataclass(frozen=True)
class DoctorReport:
    """Everything ``llmc doctor`` prints."""

    gpus: tuple[GpuInfo, ...]
    cpu: CpuInfo
    driver: str | None
    cuda: str | None
    versions: dict[str, str | None]
    notes: dict[str, str]  # package or probe -> why it is missing / failed
    backends: tuple[BackendStatus, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def cuda_gpus() -> tuple[GpuInfo, ...]:
    """Every CUDA device visible to torch (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GpuInfo(i, props.name, f"{props.major}.{props.minor}", round(props.total_memory / 2**30, 1),
                            props.multi_processor_count))
    return tuple(gpus)


def cpu_info() -> CpuInfo:
    """The CPU, and which CPU kernels and prefill precision the torch engine uses on it (no kernel build: the
    first engine load or ``llmc build`` does that, ~40 s, cached)."""
    import torch

    from llmc.engine.torch import cpu_ext

    why_not = cpu_ext.static_why_not()
    kernels = ("llmc's AVX-512 kernels (built on first use, then cached)" if why_not is None
               else f"PyTorch's ops ({why_not})")
    return CpuInfo(cpu_ext.cpu_model(), os.cpu_count() or 1, torch.backends.cpu.get_cpu_capability(),
                   cpu_ext.has_avx512_bf16(), kernels, cpu_ext.prefill_status(build=False), build_gemm())


def build_gemm() -> str:
    """Which library ``llmc build`` sends its CPU passes' float32 GEMMs to here (a ~0.2 s measurement), and why."""
    from llmc.engine.torch.cpu_gemm import choice

    found = choice()
    names = {"onednn": "oneDNN", "mkl": "MKL (PyTorch's default)"}
    rates = ", ".join(f"{names[lib].split()[0]} {rate} GFLOP/s" for lib, rate in found["gflops"].items())
    return f"{names[found['library']]} ({found['why']}{': ' + rates if rates else ''})"


def driver_version() -> tuple[str | None, str]:
    """(driver version, how it was found or why not) from nvidia-smi, else pynvml."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        result = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=False)
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip().splitlines()[0], "nvidia-smi"
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return (version.decode() if isinstance(version, bytes) else str(version)), "pynvml"
    except Exception as exc:  # noqa: BLE001 - reported in the doctor's notes
        return None, f"no NVIDIA driver found (nvidia-smi {'failed' if smi else 'not on PATH'}; pynvml: {exc})"


def package_versions() -> tuple[dict[str, str | None], dict[str, str]]:
    """Installed versions of the packages llmc cares about, from metadata; notes for the missing ones."""
    versions: dict[str, str | None] = {}
    notes: dict[str, str] = {}
    for name in METADATA_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
            notes[name] = "not installed"
    return versions, notes


def tuned_gpus(gpus: tuple[GpuInfo, ...]) -> list[str]:
    """Whose tuned int4 kernel configs the GPUs found here run: a GPU's own (its name), or those of a tuned GPU of
    the same compute capability (which one, and for which GPU here); GPUs with neither are left out."""
    from llmc.engine.torch.int4_configs import LOCAL_LABEL, config_devices, table_sources

    said = set()
    read_over = [f"{label} {path}" if label == LOCAL_LABEL else label for label, path in table_sources()]
    if read_over:  # this machine's (llmc tune) and LLMC_INT4_CONFIGS's (checked below, as loading an engine would)
        said.add(f"the shipped table with {' and '.join(read_over)} over it")
    for gpu in gpus:
        try:
            chosen = config_devices(gpu.name, gpu.compute_capability, gpu.multiprocessors)
        except LlmcError as exc:  # an unreadable LLMC_INT4_CONFIGS: what loading an int4 engine would say
            return [f"no GPU: {exc}"]
        if chosen:
            said.add(chosen[0] if chosen[0] == gpu.name else
                     f"{chosen[0]}, used on {gpu.name}: same compute capability {gpu.compute_capability}")
    return sorted(said)


def int4_cuda_path(why_not: str | None, sm: int = 0) -> str:
    """Which W4A16 kernels a CUDA GPU (of compute capability ``sm``, e.g. 90) gets: llmc's CUDA kernels (on sm_90
    with the warpgroup kernel; built here already, or what their first use compiles), how they launch and whether
    the qkv layers do RoPE + the KV write in their epilogue, or the Triton ones and why."""
    if why_not is None:
        from llmc.engine.torch.cuda_ext import PDL_ENV, PDL_MODES, build_state, pdl_mode
        from llmc.engine.torch.int4_cuda import ROPE_EPILOGUE_ENV, rope_epilogue_enabled

        try:
            mode = pdl_mode(sm // 10)
        except ValueError as exc:  # a mistyped LLMC_CUDA_PDL: the engine would stop at its first int4 launch
            launch = f"; {exc}"
        else:
            launch = (f"; programmatic dependent launch ({PDL_MODES[mode]}; {PDL_ENV}=0 turns it off)" if mode else
                      "; plain launches" + ("" if sm < 90 else f" ({PDL_ENV}=0)"))
        rope = (f"qkv layers rotate q, k and write the KV cache in their epilogue ({ROPE_EPILOGUE_ENV}=0 turns it "
                f"off)" if rope_epilogue_enabled() else f"RoPE + KV write in a Triton kernel ({ROPE_EPILOGUE_ENV}=0)")
        wgmma = ", with the warpgroup (wgmma) kernel where the tuned table picks it" if sm // 10 == 9 else ""
        return f"llmc's CUDA tensor-core kernels{wgmma} ({build_state(sm)}{launch}); {rope}; {norms()}"
    return f"llmc's Triton W4A16 kernels ({why_not})"


def norms() -> str:
    """How the int4 CUDA layers handle the residual add + RMSNorm after o and down in decode steps."""
    from llmc.engine.torch.pending_norm import NORM_EPILOGUE_ENV, norm_epilogue_rows

    try:
        rows = norm_epilogue_rows()
    except ValueError as exc:  # a mistyped value: the engine would stop at its first decode step
        return str(exc)
    if not rows:
        return f"residual add + RMSNorm in a Triton kernel ({NORM_EPILOGUE_ENV}=0)"
    return (f"o and down add to the residual stream in their epilogue and the next int4 layer finishes the norm, "
            f"up to {rows} rows ({NORM_EPILOGUE_ENV}=0 turns it off)")


def prompt_step_paths() -> str:
    """How CUDA steps with prompt tokens run besides the decode graphs: chunks that continue a cached context (one
    Triton kernel, or gather + SDPA) and a mixed-step budget's steps (CUDA graphs in pieces, or eager)."""
    from llmc.engine.torch.piece_graphs import PIECES_ENV, pieces_enabled
    from llmc.engine.torch.triton_prefill import PREFILL_KERNEL_ENV, prefill_kernel_enabled

    chunks = "one Triton paged-prefill kernel" if prefill_kernel_enabled() else "gathered from the cache for SDPA"
    budget = "CUDA graphs in pieces" if pieces_enabled() else "eager"
    return (f"; prompt chunks over a cached context: {chunks} ({PREFILL_KERNEL_ENV}=0 gathers); a mixed-step "
            f"budget's steps: {budget} ({PIECES_ENV}=0 eager)")


def triton_launch(sm: int) -> str:
    """How the CUDA step's Triton kernels launch on a GPU of compute capability ``sm``: programmatically where the
    int4 kernels do (sm_90+, ``LLMC_CUDA_PDL`` not 0) unless ``LLMC_TRITON_PDL=0`` ("" where neither applies).
    The engine also needs a Triton with the ``launch_pdl`` option (3.3+); it checks that when it runs."""
    from llmc.engine.torch.cuda_ext import pdl_mode
    from llmc.engine.torch.triton_support import PDL_ENV, pdl_switched_off

    try:
        if not pdl_mode(sm // 10):
            return ""
    except ValueError:  # said once, in the int4 path's line
        return ""
    if pdl_switched_off():
        return f" (plain launches: {PDL_ENV}=0)"
    return f" (launched programmatically; {PDL_ENV}=0 turns it off)"


def fp8_kv_cache(sm: int) -> str:
    """What ``kv_cache.dtype: fp8`` gives on a GPU of compute capability ``sm`` (with Triton)."""
    from llmc.engine.torch.kv_alloc import FP8_ENV, FP8_MIN_SM, fp8_switched_off

    if sm < FP8_MIN_SM:
        return f"; kv_cache.dtype fp8 runs as a 16-bit cache (SM{sm}: fp8 conversions need SM{FP8_MIN_SM}+)"
    if fp8_switched_off():
        return f"; kv_cache.dtype fp8 runs as a 16-bit cache ({FP8_ENV}=0)"
    return "; kv_cache.dtype fp8: an fp8 KV cache (half the bytes a token)"


def embedding_place() -> str:
    """Where a CUDA engine keeps an untied input embedding (``LLMC_EMBEDDING``), or the variable's problem."""
    from llmc.engine.torch.host_embedding import ENV, placement
    from llmc.errors import EngineError

    try:
        where = placement()
    except EngineError as exc:
        return f"; {exc}"
    if where == "host":
        return f"; untied input embeddings in page-locked host memory ({ENV}=device keeps them on the GPU)"
    return f"; input embeddings on the GPU ({ENV}=device)"


def backend_statuses(gpus: tuple[GpuInfo, ...], trtllm_version: str | None, trtllm_note: str | None,
                     triton_version: str | None = None, cuda_int4_why_not: str | None = "not checked"
                     ) -> tuple[BackendStatus, ...]:
    """Which backends are usable, from what was found (pure: tests pass the findings in).
    ``cuda_int4_why_not``: why llmc's CUDA int4 kernels cannot be built here (None: they can)."""
    torch_detail = "CPU" + (f" and CUDA ({', '.join(g.name for g in gpus)})" if gpus else "; no CUDA GPU found")
    # llmc tune times the kernels int4 engines run here: the CUDA library's where it can be built, else Triton's
    tune = "; `llmc tune BUILD` tunes a build's own shapes on this GPU" + (
        "" if cuda_int4_why_not is None else " (the Triton kernels, which int4 engines run here)")
    if gpus:  # the CUDA paths: Triton kernels + CUDA graphs, or PyTorch's ops (AWQ dequantized to 16-bit)
        torch_detail += (f"; CUDA decode steps: Triton {triton_version} paged attention and fused norm/RoPE "
                         f"kernels in CUDA graphs{triton_launch(gpus[0].sm)}{prompt_step_paths()}"
                         f"{fp8_kv_cache(gpus[0].sm)}; AWQ int4 (W4A16), "
                         f"weights kept packed: "
                         f"{int4_cuda_path(cuda_int4_why_not, gpus[0].sm)} "
                         f"(tuned for {', '.join(tuned_gpus(gpus)) or 'no GPU here: heuristic configs'}{tune})"
                         f"{embedding_place()}"
                         if triton_version else "; CUDA decode steps: eager reference attention, and AWQ int4 "
                         "(W4A16) layers dequantized to 16-bit at load (no triton; Fix: pip install triton for "
                         "llmc's int4 kernels and paged attention in CUDA graphs)")
    statuses = [BackendStatus("torch", True, torch_detail)]
    problems = []
    if trtllm_version is None:
        problems.append(f"tensorrt_llm is not importable ({trtllm_note}); it needs {PIP_SPEC} "
                        "(NVIDIA's TensorRT-LLM container or wheel index)")
    else:
        try:
            check_version(trtllm_version)
        except BackendUnavailableError as exc:
            problems.append(str(exc))
    if not gpus:
        problems.append("it needs an NVIDIA GPU and none is visible")
    if problems:
        statuses.append(BackendStatus("tensorrt_llm", False, "; ".join(problems)))
        return tuple(statuses)
    refused = [g for g in gpus if g.sm in INT4_REFUSED_SM]
    detail = f"TensorRT-LLM {trtllm_version} on {gpus[0].name} (SM{gpus[0].sm})"
    if refused:
        detail += (f"; INT4 AWQ (W4A16_AWQ) engines are refused on SM100-SM119 "
                   f"({', '.join(f'GPU {g.index} SM{g.sm}' for g in refused)}): use 16-bit or backend: torch")
    statuses.append(BackendStatus("tensorrt_llm", True, detail))
    return tuple(statuses)


def collect_report(importer: Importer = importlib.import_module) -> DoctorReport:
    """Probe this machine. ``importer`` imports tensorrt / tensorrt_llm (tests may pass a test double)."""
    import torch

    gpus = cuda_gpus()
    driver, driver_note = driver_version()
    versions, notes = package_versions()
    if driver is None:
        notes["driver"] = driver_note
    for name in ("tensorrt", "tensorrt_llm"):
        probe = probe_module(name, importer)
        versions[name] = probe.version
        if probe.error:
            notes[name] = probe.error
    from llmc.engine.torch import cuda_ext

    backends = backend_statuses(gpus, versions["tensorrt_llm"], notes.get("tensorrt_llm"), versions["triton"],
                                cuda_ext.static_why_not() if gpus else "no CUDA GPU")  # judged without a build
    return DoctorReport(gpus, cpu_info(), driver, torch.version.cuda, versions, notes, backends)


def format_report(report: DoctorReport) -> str:
    """Human-readable text of the report."""
    lines = ["GPUs:"]
    lines += [f"  {g.index}: {g.name}, compute capability {g.compute_capability}, {g.memory_gib} GiB"
              for g in report.gpus] or ["  none visible to torch (CUDA not available)"]
    cpu = report.cpu
    lines.append(f"CPU: {cpu.model}, {cpu.cores} cores, {cpu.capability}"
                 f"{' with AVX512-BF16' if cpu.avx512_bf16 else ''}")
    lines.append(f"  kernels: {cpu.kernels}")
    lines.append(f"  prefill (16-bit and AWQ checkpoints): {cpu.prefill}")
    if cpu.build_gemm:
        lines.append(f"  llmc build's float32 GEMMs (calibration, gate): {cpu.build_gemm}")
    lines.append(f"driver: {report.driver or 'none (' + report.notes.get('driver', '?') + ')'}")
    lines.append(f"CUDA (torch build): {report.cuda or 'none (CPU build of torch)'}")
    lines.append("versions:")
    for name, version in report.versions.items():
        lines.append(f"  {name}: {version or 'missing (' + report.notes.get(name, 'not installed') + ')'}")
    lines.append("backends:")
    for b in report.backends:
        lines.append(f"  {b.name}: {'usable' if b.usable else 'NOT usable'} - {b.detail}")
    return "\n".join(lines)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor_cmd(as_json: bool) -> None:
    """Show GPU, CPU, driver, CUDA and library versions, which engine backends work on this machine, and the
    CPU path (llmc's kernels, bfloat16 or float32 prefill, the library of llmc build's float32 GEMMs)."""
    report = collect_report()
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report))
