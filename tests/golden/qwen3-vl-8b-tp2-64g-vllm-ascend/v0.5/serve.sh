#!/usr/bin/env bash
# model qwen3-vl-8b-instruct (bf16) from Qwen/Qwen3-VL-8B-Instruct
# card 64 GiB; layout TP2 x PP1 on 1 node(s), 2 card(s) per node
# KV cache 44.30 GiB/card = 645,120 tokens at 73,728 B/token, block 128 (from the engine's own KV log line)
# figures (published): weights_gib_logged 9.19, non_kv_gib_logged 13.61, requested_gib_logged 57.91
# source: seed 000 (field notes, Qwen3-VL-8B on 64 GB Ascend cards): `Available KV cache memory: 44.30 GiB`, `GPU KV cache size: 645,120 tokens`
# preset qwen3-vl-8b-tp2-64g-vllm-ascend; run -; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.5
# re-tune: pretuner run --model qwen3-vl-8b-instruct --card 64 --tp 2 --max-model-len 65536, then pretuner script RUN_DIR
# vLLM-MindSpore 0.5 ignores ASCEND_TOTAL_MEMORY_GB and vLLM_MODEL_MEMORY_USE_GB; they are not set
# KV cache pinned with --kv-cache-memory-bytes 47563407360 (44.30 GiB = 645,120 tokens per card)
# Start: ./serve.sh [more server flags]. The environment alone is in tuned.env.
set -euo pipefail
export GLOG_v=2
exec vllm-mindspore serve Qwen/Qwen3-VL-8B-Instruct --max-model-len 65536 --max-num-seqs 8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95 --block-size 128 --tensor-parallel-size 2 --kv-cache-memory-bytes 47563407360 "$@"
