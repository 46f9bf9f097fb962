#!/usr/bin/env bash
# model qwen3-vl-32b-instruct (bf16) from Qwen/Qwen3-VL-32B-Instruct
# card 64 GiB; layout TP2 x PP1 on 1 node(s), 2 card(s) per node
# KV cache 20.06 GiB/card = 164,224 tokens at 131,072 B/token, block 128 (from the engine's own KV log line)
# figures (published): kv_bytes_logged 2.15405e+10, weights_gib_logged 31.4592
# source: seed 001 (field notes, Qwen3-VL-32B TP2 on 64 GB Ascend cards): `Loading model weights took 31.4592 GB`, `Available memory: 21540531712`, total memory 65452113920
# preset qwen3-vl-32b-tp2-64g-vllm-ascend; run -; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.5
# re-tune: pretuner run --model qwen3-vl-32b-instruct --card 64 --tp 2 --max-model-len 16384, then pretuner script RUN_DIR
# vLLM-MindSpore 0.5 ignores ASCEND_TOTAL_MEMORY_GB and vLLM_MODEL_MEMORY_USE_GB; they are not set
# KV cache pinned with --kv-cache-memory-bytes 21525168128 (20.05 GiB = 164,224 tokens per card)
# Multi-node, head node: ./ray-head.sh, then ./ray-worker.sh HEAD_IP on every other node.
# The environment is exported before `ray start` so that every Ray worker inherits it.
set -euo pipefail
export GLOG_v=2
expected_npus=2
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
exec vllm-mindspore serve Qwen/Qwen3-VL-32B-Instruct --max-model-len 16384 --max-num-seqs 4 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.97 --block-size 128 --tensor-parallel-size 2 --kv-cache-memory-bytes 21525168128 --distributed-executor-backend ray "$@"
