"""``llmc tune``: tune the int4 kernels an engine runs here for a W4A16 build's layer shapes, on the GPU this runs on.

The shipped config table covers the GPUs and shapes llmc was tuned on; any other GPU borrows the configs of a tuned
GPU of its compute capability, any other shape those of the nearest tuned shape (the CUDA library's) or the
heuristics (``llmc bench`` names which in its report). This command times every config of the build's own shapes
here, of llmc's CUDA library where it runs (:mod:`llmc.engine.torch.int4_tune`: a few minutes for a 7B-8B model),
else of the Triton kernels an int4 engine then runs (:mod:`llmc.engine.torch.int4_tune_triton`; ``--kernels``
chooses), and writes them into this machine's table (``$LLMC_CACHE_DIR/cuda/int4_cuda_configs.json``, read over the
shipped one by every llmc engine here) or ``--out`` (serve with ``LLMC_INT4_CONFIGS=<it>`` on machines with the same
GPU). Nothing is tuned while serving.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from llmc.errors import LlmcError


def bucket_lines(report: dict, prefix: str = "mma_") -> list[str]:
    """Per tuned row count: the 32-layer sum over the shapes of what ran before (the configs the build's layers
    were given then) and of the tuned configs; shapes whose earlier config failed are left out of both sums.
    ``prefix``: the kernel family's report keys (``mma_`` or ``triton_``)."""
    per_m: dict[int, list[float]] = {}
    for shape in report.values():
        for key, cell in shape.items():
            rows = key[len(prefix):]
            if key.startswith(prefix) and rows.isdigit() and isinstance(cell["before"]["us_32_layers"], float):
                sums = per_m.setdefault(int(rows), [0.0, 0.0, 0.0])
                sums[0] += cell["before"]["us_32_layers"]
                sums[1] += cell["us_32_layers"]
                sums[2] += cell["cublas_bf16_us_32_layers"]
    return [f"  M={m:4d}: before {b / 1e3:7.3f} ms  tuned {t / 1e3:7.3f} ms ({b / t:.2f}x faster)  "
            f"bf16 cuBLAS {c / 1e3:7.3f} ms" for m, (b, t, c) in sorted(per_m.items())]


def choose_kernels(kernels: str) -> str:
    """``"cuda"`` (llmc's CUDA library) or ``"triton"``: the kernels to tune, ``kernels`` ``auto``: those an int4
    engine runs here (the CUDA library where it loads, else Triton, said so); LlmcError naming the fix where the
    chosen ones cannot run."""
    from llmc.engine.torch import cuda_ext, triton_support

    why = cuda_ext.static_why_not() if kernels == "triton" else cuda_ext.why_not()
    if why is None and kernels != "triton":
        return "cuda"
    where = "run it on the GPU the engine will serve on"
    if kernels == "cuda":
        raise LlmcError(f"llmc tune --kernels cuda times llmc's int4 CUDA kernels on this machine's GPU, and they "
                        f"cannot run here: {why}. Fix: {where} (an NVIDIA GPU of sm_80 or newer, with the CUDA "
                        "toolkit's nvcc), or tune the Triton kernels int4 engines run here instead: --kernels triton")
    triton_why = ("no CUDA GPU is visible" if not torch_cuda() else
                  "Triton is not installed" if triton_support.modules() is None else None)
    if triton_why:
        raise LlmcError(f"llmc tune times the int4 kernels on this machine's GPU, and none can run here: "
                        f"{triton_why}. Fix: {where} (an NVIDIA GPU with Triton installed: `pip install "
                        "'llmc[quant]'`)")
    if kernels == "auto":
        click.echo(f"llmc's int4 CUDA kernels are not used here ({why}): tuning the Triton kernels, which int4 engines "
                   "run here")
    return "triton"


def torch_cuda() -> bool:
    """Whether PyTorch sees a CUDA GPU (imported here: the CLI starts without torch)."""
    import torch

    return torch.cuda.is_available()


@click.command()
@click.argument("build", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Table to merge the configs into (default: this machine's, which every llmc engine here reads).")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every timing (each config tried, per shape and row count) here as JSON.")
@click.option("--kernels", type=click.Choice(["auto", "cuda", "triton"]), default="auto", show_default=True,
              help="Which int4 kernels to tune: auto, those int4 engines run here (llmc's CUDA library where it "
                   "can be built, else Triton's); cuda; triton (what runs where there is no nvcc, or with "
                   "LLMC_CUDA_INT4=triton).")
def tune_cmd(build: Path, out: Path | None, report: Path | None, kernels: str) -> None:
    """Tune the int4 kernels' configs for BUILD's layer shapes (an AWQ build or its W4A16 IR) on this GPU."""
    from llmc.engine.torch import int4_configs
    from llmc.engine.torch.int4_tune import build_shapes, save_table, tune_build

    shapes = build_shapes(build)
    kind = choose_kernels(kernels)
    target = out or int4_configs.local_table_path()
    if target.exists():  # an unreadable table stops here, before minutes of timing
        int4_configs.user_table(target, int4_configs.LOCAL_LABEL if out is None else f"--out {target}")
    which = "llmc's CUDA" if kind == "cuda" else "the Triton"
    click.echo(f"tuning {which} int4 kernels for {len(shapes)} layer shapes of {build}: " + ", ".join(
        f"{s[0]} {s[1]} x {s[2]}" for s in shapes))
    if kind == "cuda":
        table, timings = tune_build(shapes, log=click.echo)
    else:
        from llmc.engine.torch.int4_tune_triton import tune_build_triton

        table, timings = tune_build_triton(shapes, log=click.echo)
    save_table(target, table)
    int4_configs._tuned_table.cache_clear()  # noqa: SLF001 - this process's engines read the new table
    click.echo("\neach shape alone, summed over 32 layers:")
    for line in bucket_lines(timings["shapes"], "mma_" if kind == "cuda" else "triton_"):
        click.echo(line)
    if timings.get("step_order"):
        click.echo("a decode step's linears in step order, 32 layers (what the engine runs):")
    for m, cell in sorted(timings.get("step_order", {}).items()):
        click.echo(f"  M={m:4d}: before {cell['before_ms']:7.3f} ms  tuned {cell['chosen_ms']:7.3f} ms "
                   f"({cell['before_ms'] / cell['chosen_ms']:.2f}x faster)")
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(timings, indent=1) + "\n")
    gpu = timings["device"]
    click.echo(f"\nwrote {gpu}'s {'CUDA' if kind == 'cuda' else 'Triton'} int4 kernel configs to {target}: " + (
        "llmc engines on this machine run them from now on (llmc doctor says so)" if out is None else
        f"serve with {int4_configs.CONFIGS_ENV}={target} on a machine with this GPU to run them"))
