#!/usr/bin/env bash
# Shared set-up of the GPU-box scripts (gpu_acceptance.sh, gpu_awq_build.sh); sourced, not run.
# Sets out (the first argument, else $OUT, else /tmp/llmc-gpu-out), work ($LLMC_GPU_WORK), shape ($SHAPE) and
# py ($PYTHON); makes both folders, copies all output to "$out/LOG_NAME", puts this checkout on PYTHONPATH.
# Usage (from the repository root): . scripts/gpu_common.sh LOG_NAME [OUT_DIR]
# shellcheck disable=SC2034  # the variables are read by the scripts that source this file
log_name="$1"
out="${2:-${OUT:-/tmp/llmc-gpu-out}}"
work="${LLMC_GPU_WORK:-/tmp/llmc-gpu-work}"
shape="${SHAPE:-llama3.1-8b}"
mkdir -p "$out" "$work"
exec > >(tee -a "$out/$log_name") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
