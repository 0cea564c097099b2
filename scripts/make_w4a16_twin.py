#!/usr/bin/env python3
"""The W4A16_AWQ twin of a 16-bit build folder, written directly (no calibration): for GPU benchmarks of int4.

GPU speed does not depend on weight values, so an 8B-shaped int4 build needs no 8B calibration run: every decoder
linear of the 16-bit IR is divided by a random AWQ pre-quant scale (one per input feature, shared by the layers
that read the same input, as AWQ's smoothing is) and rounded to int4 per group (RTN), on the GPU in seconds. The
twin keeps the 16-bit build's embedding, norms, lm_head, tokenizer and recipe (quantization set to ``rtn`` with
``--group-size``), so the two builds differ only in their linears. Quality figures of such a build mean nothing.

    python scripts/make_w4a16_twin.py BUILD_16BIT OUT_DIR [--group-size 128] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.manifest import read_manifest, write_manifest  # noqa: E402
from llmc.checkpoint import names  # noqa: E402
from llmc.checkpoint.config import quantization_block  # noqa: E402
from llmc.checkpoint.int4 import pack_int4, quantize_rtn  # noqa: E402
from llmc.checkpoint.io import read_checkpoint, write_checkpoint  # noqa: E402
from llmc.engine.base import compile_engine  # noqa: E402
from llmc.recipe import recipe_from_dict  # noqa: E402


def quantize_ir(weights: dict[str, torch.Tensor], num_layers: int, group_size: int, device: str,
                seed: int) -> dict[str, torch.Tensor]:
    """IR tensors with every decoder linear replaced by packed int4, scales and a random pre-quant scale."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = dict(weights)
    for layer in range(num_layers):
        prequants: dict[str, torch.Tensor] = {}
        for spec in names.LINEARS:
            name = names.trt_layer(layer, spec.trt)
            w = weights[name].to(device, torch.float32)  # [O, K]
            source = "mlp.fc" if spec.trt == "mlp.gate" else spec.trt  # fc and gate read the same input
            if source not in prequants:
                prequants[source] = torch.rand(w.shape[1], generator=gen, device=device) + 0.5
            prequant = prequants[source]
            q, scales = quantize_rtn(w / prequant[None, :], group_size, scale_dtype=weights[name].dtype)
            out[name] = pack_int4(q).cpu()
            out[names.trt_layer(layer, spec.trt, names.WEIGHTS_SCALING_FACTOR)] = scales.cpu()
            out[names.trt_layer(layer, spec.trt, names.PREQUANT_SCALING_FACTOR)] = prequant.to(
                weights[name].dtype).cpu()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build", type=Path, help="a 16-bit torch build folder (llmc build with quantization none)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--group-size", type=int, default=128, choices=[64, 128])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; choose a new folder (nothing is overwritten)")
    start = time.perf_counter()
    manifest = read_manifest(args.build)
    engine = json.loads((args.build / "engine" / "engine.json").read_text())
    config, ranks = read_checkpoint(args.build / "engine" / engine["checkpoint"])
    if len(ranks) != 1 or (config.get("quantization") or {}).get("quant_algo"):
        sys.exit("error: the source build must be a 16-bit, single-rank build")
    quant = {"quant_algo": "W4A16_AWQ", "group_size": args.group_size,  # an FP8 KV cache's scales stay as they are
             "kv_cache_quant_algo": (config.get("quantization") or {}).get("kv_cache_quant_algo")}
    config = {**config, "quantization": quantization_block(quant)}
    weights = quantize_ir(ranks[0], config["num_hidden_layers"], args.group_size, args.device, args.seed)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp / "checkpoint", config, [weights])
    shutil.copytree(args.build / "tokenizer", tmp / "tokenizer")
    recipe = dict(manifest.recipe)
    recipe["name"] = f"{manifest.name}-w4a16-twin"
    recipe["quantization"] = {**recipe["quantization"], "method": "rtn", "group_size": args.group_size}
    compile_engine(recipe_from_dict(recipe, check_inputs=False), tmp / "checkpoint", tmp / "engine")
    extra = {**manifest.extra, "w4a16_twin_of": str(args.build), "random_prequant_seed": args.seed}
    write_manifest(tmp, replace(manifest, name=recipe["name"], recipe=recipe, quantization=recipe["quantization"],
                                extra=extra))
    tmp.rename(args.out)
    print(f"wrote {args.out}: W4A16_AWQ g{args.group_size} twin of {args.build}, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
