#!/usr/bin/env bash
# Tune real vLLM on a lent GPU machine that has torch but no vllm and no network:
# the payload (scripts/gpu/vllm_payload.py) arrives in /tmp/stage as `vllm.part*` (a split
# tar.xz of the vllm wheel's tree) and `light/*.whl` (its pure-Python dependencies); this
# installs both under /tmp/site and runs `pretuner run --engine vllm` on a dummy-weight model
# folder. Extra arguments go to pretuner run. Made the fixtures of
# tests/fixtures/real/vllm-0.24-h200.
#   MODEL=.devq/qwen3-8b BUDGET_S=470 scripts/gpu/run_vllm_gpu.sh --max-model-len 32768
set -u
export PYTHONUNBUFFERED=1
stage=${STAGE:-/tmp/stage}
site=${SITE:-/tmp/site}
model=${MODEL:-.devq/qwen3-8b}
run=${RUN:-/tmp/run}
mkdir -p "$site/bin"
t0=$(date +%s)
cat "$stage"/vllm.part* | xz -dc -T0 | tar -x -C "$site" || { echo "untar failed" >&2; exit 11; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  "$stage"/light/*.whl 2>&1 | grep -v "already exists"
# `pip --target` writes no console script for a tree that was untarred: vllm's own, by hand.
printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > "$site/bin/vllm"
chmod +x "$site/bin/vllm"
export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
echo "install $(( $(date +%s) - t0 )) s"
python3 -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
trap 'tar -czf "${OUT:-/tmp}/run.tgz" -C "$(dirname "$run")" "$(basename "$run")" 2>/dev/null' EXIT
timeout -s INT "${BUDGET_S:-470}" python3 -m pretuner run --model "$model" --engine vllm \
  --server-arg '--load-format dummy' --out "$run" --stop-grace 30 --request-timeout 300 "$@"
echo "pretuner rc=$? after $(( $(date +%s) - t0 )) s"
