#!/usr/bin/env bash
# Tune real vLLM on a lent GPU machine that has torch but no vllm and no network:
# install_vllm.sh installs the payload; this runs `pretuner run --engine vllm` on a
# dummy-weight model folder. Extra arguments go to pretuner run. Made the fixtures of
# tests/fixtures/real/vllm-0.24-h200.
#   MODEL=.devq/qwen3-8b BUDGET_S=470 scripts/gpu/run_vllm_gpu.sh --max-model-len 32768
set -u
model=${MODEL:-.devq/qwen3-8b}
run=${RUN:-/tmp/run}
. "$(dirname "$0")/install_vllm.sh"
trap 'tar -czf "${OUT:-/tmp}/run.tgz" -C "$(dirname "$run")" "$(basename "$run")" 2>/dev/null' EXIT
timeout -s INT "${BUDGET_S:-470}" python3 -m pretuner run --model "$model" --engine vllm \
  --server-arg '--load-format dummy' --out "$run" --stop-grace 30 --request-timeout 300 "$@"
echo "pretuner rc=$? after $(( $(date +%s) - t0 )) s"
