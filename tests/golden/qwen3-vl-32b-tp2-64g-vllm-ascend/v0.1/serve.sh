#!/usr/bin/env bash
# model qwen3-vl-32b-instruct (bf16) from Qwen/Qwen3-VL-32B-Instruct
# card 64 GiB; layout TP2 x PP1 on 1 node(s), 2 card(s) per node
# KV cache 20.06 GiB/card = 164,224 tokens at 131,072 B/token, block 128 (from the engine's own KV log line)
# figures (published): kv_bytes_logged 2.15405e+10, weights_gib_logged 31.4592
# source: seed 001 (field notes, Qwen3-VL-32B TP2 on 64 GB Ascend cards): `Loading model weights took 31.4592 GB`, `Available memory: 21540531712`, total memory 65452113920
# preset qwen3-vl-32b-tp2-64g-vllm-ascend; run -; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.1
# re-tune: pretuner run --model qwen3-vl-32b-instruct --card 64 --tp 2 --max-model-len 16384, then pretuner script RUN_DIR
# model-use re-expressed from the source's KV figure: ceil(64 x 0.97 - 20.06) = 43 GiB
# Start: ./serve.sh [more server flags]. The environment alone is in tuned.env.
set -euo pipefail
export GLOG_v=2
export ASCEND_TOTAL_MEMORY_GB=64
export vLLM_MODEL_MEMORY_USE_GB=43
exec python3 -m vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server --model Qwen/Qwen3-VL-32B-Instruct --max-model-len 16384 --max-num-seqs 4 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.97 --block-size 128 --tensor-parallel-size 2 "$@"
