#!/usr/bin/env bash
# model qwen3-8b (bf16) from Qwen/Qwen3-8B
# card 64 GiB; layout TP1 x PP1 on 1 node(s), 1 card(s) per node
# KV cache 39.71 GiB/card = 289,168 tokens at 147,456 B/token, block 16 (from card x util - model-use)
# figures (SIMULATED on the emulated card): actual_peak_mib 22329, kv_prerun_gib 2.5994, weights_act_gib 19.2063, headroom_gib 0.5
# source: pretuner 0.1.0 run 20260101-000000-qwen3-8b-64g (emulated card)
# preset qwen3-8b-tp1-64g-simulated-20260101-000000-qwen3-8b-64g; run 20260101-000000-qwen3-8b-64g; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.5
# re-tune: pretuner run --model qwen3-8b --card 64 --tp 1 --max-model-len 16384, then pretuner script RUN_DIR
# vLLM-MindSpore 0.5 ignores ASCEND_TOTAL_MEMORY_GB and vLLM_MODEL_MEMORY_USE_GB; they are not set
# KV cache pinned with --kv-cache-memory-bytes 42639556608 (39.71 GiB = 289,168 tokens per card)
# Multi-node, head node: ./ray-head.sh, then ./ray-worker.sh HEAD_IP on every other node.
# The environment is exported before `ray start` so that every Ray worker inherits it.
set -euo pipefail
export GLOG_v=2
expected_npus=1
wait_s=${PRETUNER_RAY_WAIT_S:-600}

count_npus() {
  ray status 2>/dev/null | grep -oE '[0-9]+(\.[0-9]+)? NPU' | head -n 1 | awk '{print int($1)}' || true
}

ray start --head --port=6379
waited=0
until [ "$(count_npus)" = "$expected_npus" ]; do
  if [ "$waited" -ge "$wait_s" ]; then
    echo "ray status shows $(count_npus) NPU, expected $expected_npus after ${wait_s}s; start ray-worker.sh on the other nodes" >&2
    exit 1
  fi
  sleep 5
  waited=$((waited + 5))
done
echo "ray status: $expected_npus NPU; starting the server on the head node"
exec vllm-mindspore serve Qwen/Qwen3-8B --max-model-len 16384 --max-num-seqs 17 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.933 --block-size 16 --tensor-parallel-size 1 --kv-cache-memory-bytes 42639556608 --distributed-executor-backend ray "$@"
