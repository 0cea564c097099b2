#!/usr/bin/env bash
# GPU acceptance for the torch engine (run on an NVIDIA GPU box, e.g. through the device tool's H200):
#   1. a Llama-3.1-8B-shaped model with random bf16 weights (speed does not depend on weight values),
#   2. `llmc build` with the torch backend,
#   3. the `gpu`-marked tests,
#   4. greedy tokens of llmc vs transformers on the same random model (16 tokens),
#   5. `llmc bench` at concurrency 1, 8, 64 (ISL 2048 / OSL 128) with transformers generate as the baseline:
#      prefix reuse off (transformers recomputes every prompt) and pairwise distinct prompts (random token ids:
#      the random model's word-level tokenizer cannot encode text), checked by the report's zero cache hits,
#   6. decode-step times with and without CUDA graphs (scripts/decode_steps.py; skip with SKIP_DECODE_STEPS).
# A failing check (gpu tests, a greedy check, the bench, zero cache hits, decode steps) does not stop the later
# steps, but the script then ends with "FAILED: ..." and exit status 1.
# Usage: scripts/gpu_acceptance.sh [OUT_DIR]; env: SHAPE (llama3.1-8b | tiny), DEVICE (cuda | cpu), ISL, OSL,
#        LEVELS (e.g. 1,8,64), NUM_PROMPTS (per level, at least the concurrency), SKIP_GPU_TESTS,
#        SKIP_FP32_TWIN (no float32 greedy check), SKIP_BENCH. Needs torch + transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/llmc-gpu-out}}"
work="${LLMC_GPU_WORK:-/tmp/llmc-gpu-work}"
shape="${SHAPE:-llama3.1-8b}"
device="${DEVICE:-cuda}"
mkdir -p "$out/plots" "$work"
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

failed=()
check() {  # check NAME COMMAND...: run a check; when it fails, say so, remember NAME and go on
  local name="$1"
  shift
  if ! "$@"; then
    printf '!!! check failed: %s\n' "$name" >&2
    failed+=("$name")
  fi
}
finish() {  # exit 1 when any check failed, naming them all
  if [ "${#failed[@]}" -gt 0 ]; then
    printf '\nFAILED: %s\n' "$(IFS=';'; echo "${failed[*]}")"
    exit 1
  fi
  printf '\nall checks passed\n'
  exit 0
}

step "environment"
$py -m llmc.cli doctor

step "random Llama-3.1-8B-shaped model"
if [ ! -f "$work/hf/config.json" ]; then
  $py scripts/make_random_llama.py --shape "$shape" --out "$work/hf" --device "$device"
fi

cat >"$work/recipe.yaml" <<YAML
name: llama31-8b-random
model:
  source: $work/hf
  dtype: bfloat16
  eos_token_ids: auto
quantization:
  method: none
engine:
  max_batch_size: 64
  max_input_len: 2048
  max_seq_len: 2304
  max_num_tokens: 8192
kv_cache:
  tokens_per_block: 32
  memory_fraction: 0.4
backend: torch
YAML

step "llmc build"
$py -m llmc.cli build "$work/recipe.yaml" -o "$work/build"

if [ "$device" = cuda ] && [ -z "${SKIP_GPU_TESTS:-}" ]; then
  step "gpu tests"
  # Only the folders with gpu tests: the serving tests import tritonclient, which GPU images may lack.
  check "gpu tests" "$py" -m pytest -q -m gpu tests/engine tests/runtime -p no:cacheprovider >"$out/gpu_tests.txt" 2>&1
  tail -n 15 "$out/gpu_tests.txt"
fi

step "greedy check vs transformers (16 tokens, bfloat16)"
check "greedy check (bfloat16)" "$py" scripts/greedy_check.py "$work/build" "$work/hf" --tokens 16 --device "$device" \
  >"$out/greedy.json"
cat "$out/greedy.json"

# bf16 logits are spaced ~0.25 apart near the top of a random model's distribution, so exact ties decide
# many bf16 argmaxes; the same weights in float32 give a tie-free token-by-token comparison.
if [ -z "${SKIP_FP32_TWIN:-}" ]; then
  step "greedy check vs transformers (16 tokens, float32 twin of the same weights)"
  if [ -n "${SKIP_BENCH:-}" ]; then rm -rf "$work/build"; fi  # disk: the float32 IR alone is 32 GB
  sed -e 's/^name: .*/name: llama31-8b-random-fp32/' -e 's/dtype: bfloat16/dtype: float32/' \
    "$work/recipe.yaml" >"$work/recipe-fp32.yaml"
  $py -m llmc.cli build "$work/recipe-fp32.yaml" -o "$work/build-fp32"
  check "greedy check (float32)" "$py" scripts/greedy_check.py "$work/build-fp32" "$work/hf" --tokens 16 \
    --device "$device" >"$out/greedy_fp32.json"
  cat "$out/greedy_fp32.json"
  rm -rf "$work/build-fp32"
fi

if [ -n "${SKIP_BENCH:-}" ]; then finish; fi

step "llmc bench (ISL ${ISL:-2048} / OSL ${OSL:-128}; concurrency ${LEVELS:-1,8,64}; baseline transformers; prefix reuse off)"
check "llmc bench" "$py" -m llmc.cli bench "$work/build" --device "$device" --isl "${ISL:-2048}" --osl "${OSL:-128}" \
  --concurrency "${LEVELS:-1,8,64}" --num-prompts "${NUM_PROMPTS:-4}" --temperature 0 --warmup 2 --baseline hf \
  --prefix-caching off --json "$out/bench.json" --plots "$out/plots"
# Distinct prompts and reuse off: not one prompt token may come from the prefix cache.
check "bench: no prefix-cache hits" "$py" -c '
import json, sys
report = json.load(open(sys.argv[1]))
hits = {lv["concurrency"]: lv["prefix_cache"]["hit_tokens"] for lv in report["levels"]}
print("workload:", report["workload"]["source"], "| prefix-cache hit tokens per level:", hits)
sys.exit(1 if any(hits.values()) else 0)' "$out/bench.json"

if [ "$device" = cuda ] && [ -z "${SKIP_DECODE_STEPS:-}" ]; then
  step "decode steps: CUDA graphs vs eager (batch 1, 8, 64 at 2,048 cached tokens)"
  check "decode steps" "$py" scripts/decode_steps.py "$work/build" --batch 1,8,64 --context 2048 --device "$device" \
    >"$out/decode_steps.json"
  cat "$out/decode_steps.json"
fi
finish
