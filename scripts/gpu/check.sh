#!/usr/bin/env bash
# Gyre's GPU checks on an offline GPU box (see docs/gpu.md):
#   1. every `gpu`-marked test,
#   2. `gyre bench trainer` on the Qwen3-0.6B shape (packed rows of 8192, ceiling, memory, MFU,
#      longest row), as quoted in docs/benchmarks.md.
# usage: scripts/gpu/check.sh [OUT_DIR] [tests|bench|all]   (needs .gpu-wheels/: scripts/gpu/fetch_wheels.sh)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/gpu}
what=${2:-all}
mkdir -p "$out"
# shellcheck source=scripts/gpu/env.sh
source scripts/gpu/env.sh
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} | tee "$out/device.txt"
model=${GYRE_GPU_MODEL:-outputs/qwen3-shape}
[ -d "$model" ] || python3 -m gyre.cli model init --preset qwen3-0.6b --output-dir "$model"
status=0
if [ "$what" != bench ]; then
  # The files holding gpu-marked tests (collecting the whole suite would need the CPU-side dev tools too).
  mapfile -t files < <(grep -rl "mark.gpu" tests)
  timeout 900 python3 -m pytest -p no:cacheprovider -m gpu -v "${files[@]}" 2>&1 | tee "$out/pytest_gpu.txt"
  status=${PIPESTATUS[0]}
fi
if [ "$what" != tests ]; then
  timeout 900 python3 -m gyre.cli bench trainer --model.name "$model" --seq-len 8192 --num-samples 64 \
    --min-len 256 --max-len 4096 --find-max-seq-len 2>&1 | grep -v "Loading weights" | tee "$out/bench_trainer.txt"
fi
exit "$status"
