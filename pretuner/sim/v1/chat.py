"""`/v1/chat/completions` as the emulated vLLM 0.24 reads it: text and image parts in, a
`ChatPrompt` (length, images' positions and hashes) or a `ChatError` (vLLM's 400) out.

Pure. Qwen's chat template; an image is its tokens (from the PNG header) between
`<|vision_start|>` and `<|vision_end|>`."""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

from pretuner.launch.images import MMRequest
from pretuner.launch.png import png_size
from pretuner.models.vision import image_tokens
from pretuner.sim.http import count_tokens
from pretuner.sim.v1.mm import MMItem, VisionCard

MESSAGE_TOKENS = 5  # <|im_start|> role \n ... <|im_end|> \n
ASSISTANT_TOKENS = 3  # <|im_start|> assistant \n
IMAGE_WRAP_TOKENS = 2  # <|vision_start|> ... <|vision_end|>
TEMPLATE_TOKENS = MESSAGE_TOKENS + ASSISTANT_TOKENS  # one user message
DATA_URL_PREFIX = "data:image/"


class ChatError(Exception):
    """A request vLLM refuses with HTTP 400."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    prompt_len: int
    images: tuple[MMItem, ...]


def too_many_images(limit: int, supported: bool) -> str:
    """vLLM's text for a prompt with more images than --limit-mm-per-prompt allows."""
    text = f"At most {limit} image(s) may be provided in one prompt."
    return text + (" Set `--limit-mm-per-prompt` to increase this limit." if supported else "")


def _image(part: dict[str, Any], vision: VisionCard) -> tuple[str, int]:
    """(content hash, tokens) of one `image_url` part; only data URLs (the emulator is
    offline): a URL it cannot fetch is refused like an unreachable one."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url.startswith(DATA_URL_PREFIX) or ";base64," not in url:
        raise ChatError("Invalid image: the emulated server reads data:image/...;base64 URLs "
                        "only (it has no network)")
    try:
        data = base64.b64decode(url.partition(";base64,")[2], validate=True)
    except (binascii.Error, ValueError):
        raise ChatError("Invalid image: the base64 data does not decode") from None
    size = png_size(data)
    if size is None:
        raise ChatError("Failed to load image: cannot identify image file (the emulated "
                        "server reads PNG headers)")
    width, height = size
    return hashlib.sha256(data).hexdigest(), image_tokens(vision.vision, height, width)


def parse_chat(body: dict[str, Any], vision: VisionCard | None) -> ChatPrompt:
    """The prompt a chat request makes; ChatError for what vLLM answers 400."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    pos = 0
    images: list[MMItem] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError("each message must be an object with a role")
        pos += MESSAGE_TOKENS
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ChatError("content must be a string or a list of parts")
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pos += count_tokens(part["text"]) if part["text"] else 0
            elif kind == "image_url":
                if vision is None or vision.image_limit == 0:
                    limit = 0 if vision is None else vision.image_limit
                    raise ChatError(too_many_images(limit, vision is not None))
                key, tokens = _image(part, vision)
                images.append(MMItem(pos + 1, tokens, key))
                pos += tokens + IMAGE_WRAP_TOKENS
            else:
                raise ChatError(f"unsupported content part type {kind!r} (the emulated server "
                                "reads text and image_url)")
    if vision is not None and len(images) > vision.image_limit:
        raise ChatError(too_many_images(vision.image_limit, True))
    return ChatPrompt(pos + ASSISTANT_TOKENS, tuple(images))


def chat_max_tokens(body: dict[str, Any], max_model_len: int, prompt_len: int) -> int | None:
    """`max_completion_tokens`, else `max_tokens`, else what the context leaves (vLLM's chat
    default); None when the value given is not a positive integer."""
    raw = body.get("max_completion_tokens", body.get("max_tokens"))
    if raw is None:
        return max(1, max_model_len - prompt_len)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        return None
    return raw


def prompt_of(req: MMRequest) -> ChatPrompt:
    """The prompt a `pretuner.launch.images` request makes here as one user message (images
    first, then the text), each image's uid standing for its content hash: what the request
    rendered as PNGs would give, without rendering it (the in-process server, the truth)."""
    pos = MESSAGE_TOKENS
    items = []
    for a in req.images:
        items.append(MMItem(pos + 1, a.tokens, a.uid))
        pos += a.tokens + IMAGE_WRAP_TOKENS
    return ChatPrompt(pos + req.text_tokens + ASSISTANT_TOKENS, tuple(items))
