#!/usr/bin/env bash
# `llmc build` with AWQ + GPTQ + the accuracy gate of an 8B model on the GPU (issue 20), on a random
# Llama-3.1-8B-shaped Hugging Face folder: random weights exercise every step, but their quality figures
# (KL, perplexity) mean nothing and must not be reported as quality.
#   1. the random model (scripts/make_random_llama.py; reused when present),
#   2. a recipe with recipes/llama3-8b-awq-torch.yaml's settings pointed at it (AWQ g128 + GPTQ, 128 x 512
#      calibration tokens, quantization.device: cuda; no chat template in the random model, so calibration
#      is raw text; gate bounds relaxed for random weights),
#   3. `llmc build` (timed), then the build report's device, passes, seconds and peak GPU memory against the
#      targets (whole build <= 20 min, peak GPU memory <= 40 GB),
#   4. the IR's conformance checks (tests/checkpoint), a short greedy run of the engine on the build and (CUDA)
#      its greedy tokens vs its own IR dequantized to bf16 (equal except at reported near-ties).
# Usage: scripts/gpu_awq_build.sh [OUT_DIR]; env: SHAPE (llama3.1-8b | tiny), DEVICE (cuda | cpu: a CPU rehearsal
#        of the script on SHAPE=tiny), LLMC_GPU_WORK (work folder).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_common.sh
. scripts/gpu_common.sh awq_log.txt "${1:-}"
device="${DEVICE:-cuda}"

step "random Llama-3.1-8B-shaped model"
if [ ! -f "$work/hf/config.json" ]; then
  $py scripts/make_random_llama.py --shape "$shape" --out "$work/hf" --device "$device"
fi

step "recipe (llama3-8b-awq-torch.yaml settings, random model)"
$py - "$work" "$device" <<'PY'
import sys
from pathlib import Path
import yaml
work = Path(sys.argv[1])
recipe = yaml.safe_load(Path("recipes/llama3-8b-awq-torch.yaml").read_text())
recipe["name"] = "llama31-8b-random-awq"
recipe["model"].update(source=str(work / "hf"), chat_template="auto", eos_token_ids="auto")
quant = recipe["quantization"]
quant["device"] = sys.argv[2]
quant["calibration"]["chat_template"] = False  # the random model's word-level tokenizer has no chat template
quant["gate"] = {**quant.get("gate", {}), "max_mean_kl": 10, "max_ppl_ratio": None, "max_kl_vs_rtn": None,
                 "max_ppl_vs_rtn": None}  # random weights: the figures are recorded, not judged
(work / "recipe-awq.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
print(yaml.safe_dump(recipe["quantization"], sort_keys=False))
PY

step "llmc build (AWQ + GPTQ + gate on $device)"
start=$(date +%s)
$py -m llmc.cli build "$work/recipe-awq.yaml" -o "$work/build-awq" --force
echo "build wall: $(( $(date +%s) - start )) s"
cp "$work/build-awq/build_report.json" "$out/awq_build_report.json"

step "build report: device, passes, peak GPU memory (targets: <= 1200 s, <= 40 GB)"
$py - "$work/build-awq" "$start" <<'PY'
import json, sys, time
from pathlib import Path
build = Path(sys.argv[1])
report = json.loads((build / "build_report.json").read_text())
manifest = json.loads((build / "manifest.json").read_text())
q, g = report["quantize"], report["gate"]
print("device:", q["device"])
for p in q["passes"]:
    peak = p["peak_gpu_memory_bytes"]
    print(f"  {p['name']:17s} {p['seconds']:8.1f} s   peak GPU {peak / 2**30 if peak else 0:6.2f} GiB")
print(f"  {'gate':17s} {g['seconds']:8.1f} s   peak GPU {(g['peak_gpu_memory_bytes'] or 0) / 2**30:6.2f} GiB"
      f"   ({g['dtype']}, domains {sorted(g['domains'])}, skipped {g['skipped_domains']})")
sg = q.get("self_generation")
if sg:
    print(f"  self-generation   {sg['seconds']:8.1f} s   {sg['tokens']} tokens, {sg['tokens_per_s']} tok/s")
total = manifest["timings"]["total"]
peak = max(q["peak_gpu_memory_bytes"] or 0, g["peak_gpu_memory_bytes"] or 0)
print(f"build total {total:.0f} s (target <= 1200), peak GPU memory {peak / 1e9:.1f} GB (target <= 40)")
print("TARGETS", "MET" if total <= 1200 and peak <= 40e9 else "NOT MET")
PY

step "IR conformance (W4A16_AWQ checkpoint) and a greedy run of the engine"
$py - "$work/build-awq" "$device" <<'PY'
import json, sys, time
from pathlib import Path
from llmc.manifest import read_manifest
from llmc.engine.tensorrt_llm.ir import check_ir
from llmc import Engine, SamplingParams
build = Path(sys.argv[1])
config = json.loads((build / "checkpoint" / "config.json").read_text())
assert config["quantization"]["quant_algo"] == "W4A16_AWQ" and config["quantization"]["group_size"] == 128
names = check_ir(read_manifest(build).recipe_obj(), build / "checkpoint", config)  # raises on any violation
print(f"IR conformance: ok ({len(names[0])} tensors in rank 0)")
engine = Engine.from_dir(build, device=sys.argv[2])
t = time.perf_counter()
out = engine.generate(["t1 t2 t3 t4"] * 8, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
print(f"8 x 32 greedy tokens in {time.perf_counter() - t:.2f} s; first: {out[0].token_ids[:8]}")
PY
if [ "$device" = cuda ]; then
  step "greedy tokens: the build's int4 kernels vs its own IR dequantized to bf16 (16 tokens)"
  $py scripts/greedy_check.py "$work/build-awq" --reference dequantized --tokens 16 --device cuda \
    | tee "$out/awq_greedy.json"
fi
echo "then: AWQ_BUILD=$work/build-awq scripts/gpu_acceptance.sh benchmarks it beside the bf16 build"
