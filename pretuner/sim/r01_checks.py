"""The emulated r0.1 server's start-up checks: vLLM 0.6's and vLLM-MindSpore's refusals with
their real messages and the traceback each one prints. Pure: no I/O."""

from __future__ import annotations

from pretuner.models import ModelSpec
from pretuner.sim import memory as mem
from pretuner.sim.argv import Refused
from pretuner.sim.r01_config import ServeConfig

_TRACE_HEAD = (
    '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '  File "<frozen runpy>", line 88, in _run_code\n'
    '  File "/usr/local/lib/python3.10/site-packages/vllm/entrypoints/openai/api_server.py", '
    "line 774, in <module>\n"
    "    uvloop.run(run_server(args))\n"
)


def traceback_text(exc_type: str, message: str, where: str) -> str:
    return f"Traceback (most recent call last):\n{_TRACE_HEAD}{where}{exc_type}: {message}\n"


WHERE_PLATFORM = ('  File "/usr/local/lib/python3.10/site-packages/vllm_mindspore/platforms/'
                   'ascend.py", line 104, in check_and_update_config\n'
                   '    total_device_memory = int(os.environ["ASCEND_TOTAL_MEMORY_GB"])\n')
WHERE_BLOCKS = ('  File "/usr/local/lib/python3.10/site-packages/vllm_mindspore/utils.py", '
                 "line 238, in calc_block_num\n"
                 '    model_use_memory_b = int(os.getenv("vLLM_MODEL_MEMORY_USE_GB")) * 1024 * '
                 "1024 * 1024\n")
WHERE_CACHE = ('  File "/usr/local/lib/python3.10/site-packages/vllm/worker/worker.py", '
                "line 494, in raise_if_cache_size_invalid\n")
WHERE_CONFIG = ('  File "/usr/local/lib/python3.10/site-packages/vllm/config.py", line 1141, '
                 "in _verify_args\n")
WHERE_MS = ('  File "/usr/local/lib/python3.10/site-packages/mindspore/common/api.py", '
             "line 1031, in __call__\n")
WHERE_RAY = ('  File "/usr/local/lib/python3.10/site-packages/vllm/executor/ray_utils.py", '
              "line 286, in initialize_ray_cluster\n")
WHERE_MODEL = ('  File "/usr/local/lib/python3.10/site-packages/transformers/utils/hub.py", '
                "line 426, in cached_file\n")


def int_env(env: dict[str, str], name: str, where: str | None = None) -> int:
    """`int(os.environ[name])` as r0.1 does it, including its failure."""
    raw = env.get(name)
    if where is None:
        where = WHERE_PLATFORM if name == "ASCEND_TOTAL_MEMORY_GB" else WHERE_BLOCKS
    if raw is None:
        raise Refused("TypeError", "int() argument must be a string, a bytes-like object "
                      "or a real number, not 'NoneType'", where)
    try:
        return int(raw)
    except ValueError:
        raise Refused("ValueError", f"invalid literal for int() with base 10: {raw!r}",
                      where) from None


def check_kv_blocks(blocks: int, block_size: int, mml: int, where: str) -> int:
    """vLLM's checks on the KV blocks r0.1 computed; returns the tokens they hold."""
    if blocks <= 0:
        raise Refused("ValueError", "No available memory for the cache blocks. Try "
                      "increasing `gpu_memory_utilization` when initializing the "
                      "engine.", where)
    max_seq = blocks * block_size
    if mml > max_seq:
        raise Refused(
            "ValueError",
            f"The model's max seq len ({mml}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({max_seq}). Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
            "engine.", where)
    return max_seq


def chunked_prefill(cfg: ServeConfig, max_model_len: int) -> bool:
    """vLLM 0.6.6 turns chunked prefill on by default for max_model_len above 32K."""
    if cfg.chunked_prefill is not None:
        return cfg.chunked_prefill
    return max_model_len > mem.CHUNKED_PREFILL_ABOVE


def verify_vllm_config(cfg: ServeConfig, spec: ModelSpec) -> tuple[int, int]:
    """vLLM 0.6's own argument checks; returns (max_model_len, max_num_batched_tokens)."""
    derived = spec.max_position_embeddings
    mml = cfg.max_model_len or derived
    if mml > derived:
        raise Refused(
            "ValueError",
            f"User-specified max_model_len ({mml}) is greater than the derived max_model_len "
            f"(max_position_embeddings={derived} or model_max_length=None in model's "
            "config.json). This may lead to incorrect model outputs or CUDA errors. To allow "
            "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
            WHERE_CONFIG)
    if not 0 < cfg.util <= 1:
        raise Refused("ValueError", "GPU memory utilization must be less than 1.0. Got "
                      f"{cfg.util}.", WHERE_CONFIG)
    if spec.num_heads % cfg.tp:
        raise Refused("ValueError", f"Total number of attention heads ({spec.num_heads}) "
                      "must be divisible by tensor parallel size "
                      f"({cfg.tp}).", WHERE_CONFIG)
    chunked = chunked_prefill(cfg, mml)
    default = mem.DEFAULT_CHUNK_TOKENS if chunked else max(mml, 2048)
    batched = cfg.max_num_batched_tokens or default
    if batched < mml and not chunked:
        raise Refused(
            "ValueError",
            f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({mml}). This "
            "effectively limits the maximum sequence length to max_num_batched_tokens and "
            "makes vLLM reject longer sequences. Please increase max_num_batched_tokens or "
            "decrease max_model_len.", WHERE_CONFIG)
    if batched < cfg.max_num_seqs:
        raise Refused("ValueError", f"max_num_batched_tokens ({batched}) must be greater "
                      f"than or equal to max_num_seqs ({cfg.max_num_seqs}).",
                      WHERE_CONFIG)
    return mml, batched
