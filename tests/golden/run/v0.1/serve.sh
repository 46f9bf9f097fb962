#!/usr/bin/env bash
# model qwen3-8b (bf16) from Qwen/Qwen3-8B
# card 64 GiB; layout TP1 x PP1 on 1 node(s), 1 card(s) per node
# KV cache 39.71 GiB/card = 289,168 tokens at 147,456 B/token, block 16 (from card x util - model-use)
# figures (SIMULATED on the emulated card): actual_peak_mib 22329, kv_prerun_gib 2.5994, weights_act_gib 19.2063, headroom_gib 0.5
# source: pretuner 0.1.0 run 20260101-000000-qwen3-8b-64g (emulated card)
# preset qwen3-8b-tp1-64g-simulated-20260101-000000-qwen3-8b-64g; run 20260101-000000-qwen3-8b-64g; rendered by pretuner 0.1.0 for vLLM-MindSpore 0.1
# re-tune: pretuner run --model qwen3-8b --card 64 --tp 1 --max-model-len 16384, then pretuner script RUN_DIR
# Start: ./serve.sh [more server flags]. The environment alone is in tuned.env.
set -euo pipefail
export GLOG_v=2
export ASCEND_TOTAL_MEMORY_GB=64
export vLLM_MODEL_MEMORY_USE_GB=20
exec python3 -m vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server --model Qwen/Qwen3-8B --max-model-len 16384 --max-num-seqs 17 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.933 --block-size 16 --tensor-parallel-size 1 "$@"
