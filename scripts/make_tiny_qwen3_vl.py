"""Write a tiny Qwen3-VL model folder for vLLM on CPU: config, preprocessor, word-level tokenizer.

No weights: the server loads it with `--load-format dummy`. The language model is the tiny
Qwen3 of make_tiny_qwen3.py (2 layers, hidden 256, 2 KV heads x 64: 1,024 KV bytes per token);
the vision tower is Qwen3-VL's shape at toy size (2 blocks, hidden 64, 16 px patches merged 2x2,
so one language-model token per 32 x 32 px), images up to 1024 x 1024 px (1,024 tokens). The
tokenizer adds Qwen's chat and vision special tokens and a chat template that places
`<|vision_start|><|image_pad|><|vision_end|>` for each image. Stdlib only, deterministic:

    python scripts/make_tiny_qwen3_vl.py [OUT_DIR]   (default tests/fixtures/models/tiny-qwen3-vl)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_qwen3 as text  # noqa: E402  (the sibling script: one tokenizer recipe)

SPECIAL = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>")
VOCAB = 32768  # room for the image tokens' ids below the end-of-text token
FIRST_SPECIAL = VOCAB - 1 - len(SPECIAL)  # just below the end-of-text token
IDS = {tok: FIRST_SPECIAL + i for i, tok in enumerate(SPECIAL)}
MAX_SIDE_PX = 1024

CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": IDS["<|image_pad|>"],
    "video_token_id": IDS["<|video_pad|>"],
    "vision_start_token_id": IDS["<|vision_start|>"],
    "vision_end_token_id": IDS["<|vision_end|>"],
    "tie_word_embeddings": True,
    "text_config": {
        **{k: v for k, v in text.config(VOCAB).items()
           if k not in ("architectures", "model_type")},
        "model_type": "qwen3_vl_text",
        "dtype": "bfloat16",
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [12, 10, 10],
                         "rope_type": "default"},
    },
    "vision_config": {
        "model_type": "qwen3_vl",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text.CONFIG["hidden_size"],
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [0],
        "initializer_range": 0.02,
    },
}
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"longest_edge": MAX_SIDE_PX * MAX_SIDE_PX, "shortest_edge": 64 * 64},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }} "
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}"
    "{% if part.type == 'image' or part.type == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def tokenizer() -> dict[str, Any]:  # the tokenizer.json document
    tok = text.tokenizer(VOCAB)
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
               "special": True}
    for word, i in list(vocab.items()):
        if i in IDS.values():
            del vocab[word]
    for content, i in IDS.items():
        vocab[content] = i
        tok["added_tokens"].append({"id": i, "content": content, **special})
    return tok


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok_config = {**text.TOKENIZER_CONFIG, "chat_template": CHAT_TEMPLATE}
    files = (("config.json", CONFIG, 1), ("preprocessor_config.json", PREPROCESSOR, 1),
             ("tokenizer.json", tokenizer(), None), ("tokenizer_config.json", tok_config, 1))
    for name, data, indent in files:
        body = json.dumps(data, indent=indent, separators=None if indent else (",", ":"))
        (out / name).write_text(body + "\n", encoding="utf-8")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "tests/fixtures/models/tiny-qwen3-vl")
