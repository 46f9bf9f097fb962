#!/usr/bin/env bash
# model qwen3-8b (bf16) from Qwen/Qwen3-8B
# card 20 GiB; layout TP2 x PP1 on 1 node(s), 2 card(s) per node
# KV cache 5.43 GiB/card = 79,040 tokens at 73,728 B/token, block 32 (from the engine's own KV log line)
# figures (published): max_concurrency_x 19.3, weights_gib_logged 2.6077
# source: seed 002 (public blog, Qwen3-8B TP2 on 2 x 20 GB cards, vLLM 0.8.5.post1): `GPU KV cache size: 79,040 tokens`, `Maximum concurrency for 4,096 tokens per request: 19.30x`
# preset qwen3-8b-tp2-20g-vllm; run -; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.5
# re-tune: pretuner run --model qwen3-8b --card 20 --tp 2 --max-model-len 4096, then pretuner script RUN_DIR
# vLLM-MindSpore 0.5 ignores ASCEND_TOTAL_MEMORY_GB and vLLM_MODEL_MEMORY_USE_GB; they are not set
# KV cache pinned with --kv-cache-memory-bytes 5827461120 (5.43 GiB = 79,040 tokens per card)
# Multi-node, worker node: ./ray-worker.sh HEAD_IP (after ray-head.sh has started ray).
# The environment is exported before `ray start` so that every Ray worker inherits it.
set -euo pipefail
export GLOG_v=2
expected_npus=2
default_head=''
head_ip=${1:-${HEAD_IP:-$default_head}}
if [ -z "$head_ip" ]; then
  echo "usage: $0 HEAD_IP (or set HEAD_IP)" >&2
  exit 2
fi
wait_s=${PRETUNER_RAY_WAIT_S:-600}

count_npus() {
  ray status --address="$head_ip:"6379 2>/dev/null | grep -oE '[0-9]+(\.[0-9]+)? NPU' | head -n 1 | awk '{print int($1)}' || true
}

ray start --address="$head_ip:"6379
waited=0
until [ "$(count_npus)" = "$expected_npus" ]; do
  if [ "$waited" -ge "$wait_s" ]; then
    echo "ray status shows $(count_npus) NPU, expected $expected_npus after ${wait_s}s" >&2
    exit 1
  fi
  sleep 5
  waited=$((waited + 5))
done
echo "ray status: $expected_npus NPU; the head node starts the server"
