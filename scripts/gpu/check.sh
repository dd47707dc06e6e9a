#!/usr/bin/env bash
# Gyre's GPU checks on an offline GPU box (see docs/gpu.md). Parts, in the order given (default: all):
#   tests     every `gpu`-marked test                                   -> pytest_gpu.txt
#   inference-tests  the `gpu`-marked inference tests (engine, kernels, penalties) -> pytest_gpu_inference.txt
#   trainer   `gyre bench trainer`, packed rows of 8192 (MFU, memory)   -> bench_trainer.txt
#   weights   `gyre bench weights`, the swap of 1.19 GB to 2 replicas    -> bench_weights.txt
#   inference `gyre bench inference`: batch 64 and 256, GRPO workload, vs transformers -> bench_inference.txt
#   overlap   the engine's overlapped decode loop on vs off, batch 64 (OVERLAP_BATCHES), one repeat -> bench_overlap.txt
#   serving   the server's event-loop CPU per token, 256 concurrent chat requests over HTTP    -> bench_serving.txt
#   adapters  scripts/bench_adapter_bank.py, decode with named adapters -> bench_adapters.txt
#   loop      `gyre rl @ configs/gpu/one-gpu-torch.toml`, per-step split -> loop.txt
#   loop-backlog  the same loop with 512 requests in flight for the engine's 256 rows (by priority) -> loop_backlog.txt
#   lora-loop the same loop training rank-16 adapters, published alone  -> lora_loop.txt
# All on the Qwen3-0.6B shape, as quoted in docs/benchmarks.md.
# usage: scripts/gpu/check.sh [OUT_DIR] [PART ...]   (needs .gpu-wheels/: scripts/gpu/fetch_wheels.sh)
# Each part runs under `timeout` and writes its file as it goes, so a hang still leaves figures. The engine's
# check in one call of ~8 minutes: scripts/gpu/check.sh outputs/gpu inference-tests inference loop
# with TESTS_TIMEOUT=150 BENCH_TIMEOUT=200 LOOP_TIMEOUT=180 (seconds; the defaults are longer). LOOP_ARGS adds
# `gyre rl` flags to the loop part, e.g. LOOP_ARGS="--orchestrator.inference.max-concurrency 512".
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/gpu}
shift || true
parts=("$@")
{ [ ${#parts[@]} -eq 0 ] || [ "${parts[0]}" = all ]; } && parts=(tests trainer weights inference adapters)
mkdir -p "$out"
# shellcheck source=scripts/gpu/env.sh
source scripts/gpu/env.sh
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  df -hT /tmp . | tail -n +2
} | tee -a "$out/device.txt"
model=${GYRE_GPU_MODEL:-outputs/qwen3-shape}
[ -d "$model" ] || python3 -m gyre.cli model init --preset qwen3-0.6b --output-dir "$model"
# `gyre rl` on one GPU: the per-step split, and every traceback its services logged (a failure leaves evidence)
run_loop() {
  local name=$1 report=$2
  shift 2
  rm -rf "outputs/$name"
  timeout -k 10 "${LOOP_TIMEOUT:-240}" python3 -m gyre.cli rl @ configs/gpu/one-gpu-torch.toml \
    --inference.engine.log-stats-interval-s 5 "$@" > "outputs/$name.log" 2>&1
  { echo "rc=$?"; tail -n 5 "outputs/$name.log"; python3 scripts/gpu/step_split.py "outputs/$name"
    echo "-- the engine's own lines (docs/inference.md, 'Engine log line'): where generation's time went"
    grep -h -E "engine(: |, whole run: )" "outputs/$name"/logs/inference*.log | cut -c 25- | tail -n 20
    grep -H -A30 Traceback "outputs/$name"/logs/*.log | head -n 200; } 2>&1 | tee "$report"
}
status=0
for part in "${parts[@]}"; do
  echo "== $part ($(date -u +%T))"
  case $part in
    tests)
      # The files holding gpu-marked tests (collecting the whole suite would need the CPU-side dev tools too).
      mapfile -t files < <(grep -rl "mark.gpu" tests)
      timeout 900 python3 -m pytest -p no:cacheprovider -m gpu -v "${files[@]}" 2>&1 | tee "$out/pytest_gpu.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    inference-tests)
      # the torch engine's gpu tests: CUDA graphs vs eager, Triton kernels vs the torch path, adapters, penalised
      # steps (eager) beside graph replays
      mapfile -t files < <(grep -rl "mark.gpu" tests/unit/inference)
      timeout -k 10 "${TESTS_TIMEOUT:-150}" python3 -m pytest -p no:cacheprovider -m gpu -v "${files[@]}" 2>&1 \
        | tee "$out/pytest_gpu_inference.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    trainer)
      timeout 900 python3 -m gyre.cli bench trainer --model.name "$model" --seq-len 8192 --num-samples 64 \
        --min-len 256 --max-len 4096 --find-max-seq-len 2>&1 | grep -v "Loading weights" | tee "$out/bench_trainer.txt" ;;
    weights)
      rm -rf outputs/weights-volume
      timeout 600 python3 -m gyre.cli bench weights --model "$model" --device cuda --replicas 2 --rounds 5 --dir outputs/weights-volume 2>&1 \
        | grep -v "Loading weights" | tee "$out/bench_weights.txt" ;;
    inference)
      timeout -k 10 "${BENCH_TIMEOUT:-600}" python3 -m gyre.cli bench inference --model "$model" --batch-sizes 64,256 \
        --max-tokens 128 --http false --repeats 3 --transformers-max-batch 64 --serving-clients 0 2>&1 \
        | grep --line-buffered -v "Loading weights" | tee "$out/bench_inference.txt" ;;
    serving)
      # the event loop's CPU per generated token, 256 concurrent chat requests through real HTTP (~1.5 min)
      timeout -k 10 "${SERVING_TIMEOUT:-240}" python3 -m gyre.cli bench inference --model "$model" --http false \
        --engine false --constrained false --max-tokens 128 --serving-clients 256 2>&1 \
        | grep --line-buffered -v "Loading weights" | tee "$out/bench_serving.txt" ;;
    overlap)
      # the same bench, only the engine with engine.overlap on and off side by side (~1 min once the model exists)
      timeout -k 10 "${OVERLAP_TIMEOUT:-120}" python3 -m gyre.cli bench inference --model "$model" \
        --batch-sizes "${OVERLAP_BATCHES:-64}" --max-tokens 128 --http false --repeats 1 --grpo false \
        --constrained false --transformers-max-batch 0 --serving-clients 0 2>&1 | grep --line-buffered -v "Loading weights" \
        | tee "$out/bench_overlap.txt" ;;
    adapters)
      timeout 600 python3 scripts/bench_adapter_bank.py outputs/adapter-bench --model "$model" --device cuda \
        --sequences 64 --rounds 5 2>&1 | grep -v "Loading weights" | tee "$out/bench_adapters.txt" ;;
    # shellcheck disable=SC2086  # LOOP_ARGS: extra `gyre rl` flags, split into words on purpose
    loop) run_loop gpu-one "$out/loop.txt" ${LOOP_ARGS:-} ;;
    # a backlog beyond the engine's rows: a freed row is refilled from the engine's queue at once, oldest batch
    # first (requests carry their batch as priority); on CPU it lost (docs/benchmarks.md), on a GPU a step of 256
    # rows costs about what one of 64 does
    loop-backlog) run_loop gpu-backlog "$out/loop_backlog.txt" --run-id gpu-backlog --output-dir outputs/gpu-backlog \
      --orchestrator.inference.max-concurrency 512 ;;
    lora-loop) run_loop gpu-lora "$out/lora_loop.txt" --run-id gpu-lora --output-dir outputs/gpu-lora \
      --trainer.lora.rank 16 --trainer.lora.publish adapter --trainer.optim.lr 1e-4 ;;
    *) echo "unknown part: $part (tests, inference-tests, trainer, weights, inference, overlap, serving, adapters, loop, loop-backlog, lora-loop)" >&2
       exit 2 ;;
  esac
done
exit "$status"
