#!/usr/bin/env bash
# model deepseek-r1 (w8a8) from deepseek-ai/DeepSeek-R1
# card 64 GiB; layout TP16 x PP1 on 2 node(s), 8 card(s) per node
# KV cache 6.52 GiB/card = 99,616 tokens at 70,272 B/token, block 32 (from card x util - model-use)
# figures (published): none beyond the KV cache
# source: openEuler vLLM-MindSpore deployment scripts for DeepSeek-R1 W8A8 (2 nodes x 8 x 64 GB); KV sizing per vLLM-MindSpore r0.1 docs/kvcache_config.md
# preset deepseek-r1-w8a8-tp16-2x8x64g; run -; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.1
# re-tune: pretuner run --model deepseek-r1 --card 64 --tp 16 --max-model-len 32768 --ray-address auto, then pretuner script RUN_DIR
# Multi-node, worker node: ./ray-worker.sh HEAD_IP (after ray-head.sh has started ray).
# The environment is exported before `ray start` so that every Ray worker inherits it.
set -euo pipefail
export GLOG_v=2
export ASCEND_TOTAL_MEMORY_GB=64
export vLLM_MODEL_MEMORY_USE_GB=53
export vLLM_MODEL_BACKEND=MindFormers
export GLOO_SOCKET_IFNAME=eth0
export HCCL_SOCKET_IFNAME=eth0
export TP_SOCKET_IFNAME=eth0
export MS_ENABLE_LCCL=off
export HCCL_OP_EXPANSION_MODE=AIV
export MS_ALLOC_CONF=enable_vmm:true
export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7
expected_npus=16
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
