#!/usr/bin/env bash
# model qwen3-vl-8b-instruct (bf16) from Qwen/Qwen3-VL-8B-Instruct
# card 64 GiB; layout TP2 x PP1 on 1 node(s), 2 card(s) per node
# KV cache 44.30 GiB/card = 645,120 tokens at 73,728 B/token, block 128 (from the engine's own KV log line)
# figures (published): weights_gib_logged 9.19, non_kv_gib_logged 13.61, requested_gib_logged 57.91
# source: seed 000 (field notes, Qwen3-VL-8B on 64 GB Ascend cards): `Available KV cache memory: 44.30 GiB`, `GPU KV cache size: 645,120 tokens`
# preset qwen3-vl-8b-tp2-64g-vllm-ascend; run -; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.1
# re-tune: pretuner run --model qwen3-vl-8b-instruct --card 64 --tp 2 --max-model-len 65536, then pretuner script RUN_DIR
# model-use re-expressed from the source's KV figure: ceil(64 x 0.95 - 44.30) = 17 GiB
# Start: ./serve.sh [more server flags]. The environment alone is in tuned.env.
set -euo pipefail
export GLOG_v=2
export ASCEND_TOTAL_MEMORY_GB=64
export vLLM_MODEL_MEMORY_USE_GB=17
exec python3 -m vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server --model Qwen/Qwen3-VL-8B-Instruct --max-model-len 65536 --max-num-seqs 8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95 --block-size 128 --tensor-parallel-size 2 --enable-chunked-prefill "$@"
