"""The image requests a tuning sends a vision-language model, as data (pure, seeded): the worst
case (its encoder step, encoder cache and prefill are the largest a request can ask) and the
soak (every image distinct, so that the caches that grow with distinct images fill as
production traffic fills them). `pretuner.launch.chat` sends them; the emulator's truth
(`pretuner.sim.v1.truth`) replays the same requests in process.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pretuner.models.vision import VisionSpec, image_tokens, max_image_tokens

# Tokens the chat template adds around each image (Qwen-VL: <|vision_start|> ... <|vision_end|>)
# and around the whole prompt (<|im_start|>user ... <|im_end|> <|im_start|>assistant): what a
# request plans for before the server's own count is known (`chat.calibrate`).
IMAGE_WRAP_TOKENS = 2
TEMPLATE_TOKENS_GUESS = 16
# The soak's image sides (px): a palette, so that a size's PNG is compressed once per process;
# weights lean to the photo sizes of chat traffic, with the largest kept in.
SOAK_SIDES_PX = (448, 672, 896, 1120, 1344, 1792, 2240, 2688, 3584, 4096)
SOAK_SIDE_WEIGHTS = (8, 10, 10, 9, 8, 6, 4, 3, 2, 2)
SOAK_TEXT_TOKENS = (32, 1024)  # the text of a soak request: a uniform draw in this range
SOAK_MAX_TOKENS = 8  # generated per soak request: the soak is about prefill and images
SOAK_CONCURRENCY_CAP = 16  # soak requests in flight, at most (and at most max-num-seqs)


@dataclass(frozen=True, slots=True)
class ImageAsk:
    """One image of a request: its size, the uid its content derives from, its tokens."""

    width_px: int
    height_px: int
    uid: str
    tokens: int


@dataclass(frozen=True, slots=True)
class MMRequest:
    """One chat request: its images (in order, before the text) and its text's token count."""

    images: tuple[ImageAsk, ...]
    text_tokens: int
    max_tokens: int

    @property
    def image_tokens(self) -> int:
        return sum(i.tokens + IMAGE_WRAP_TOKENS for i in self.images)


@dataclass(frozen=True, slots=True)
class ImageShape:
    """What a launch knows of the model's images: the largest, and how many a prompt takes."""

    vision: VisionSpec
    image_limit: int  # --limit-mm-per-prompt's image count (vLLM's 999 when not given)
    max_side_px: int
    tokens_per_image: int  # of the largest image

    @property
    def is_text_only(self) -> bool:
        return self.image_limit == 0


def image_shape(v: VisionSpec, image_limit: int) -> ImageShape:
    return ImageShape(v, image_limit, v.max_image_side_px, max_image_tokens(v))


def worst_case_images(shape: ImageShape, max_model_len: int, max_tokens: int,
                      template_tokens: int = TEMPLATE_TOKENS_GUESS) -> tuple[int, int]:
    """(count, side px) of the worst case's square images: as many of the largest as fit (at
    most the limit), else one as large as fits."""
    room = max_model_len - max_tokens - template_tokens - 1
    per = shape.tokens_per_image + IMAGE_WRAP_TOKENS
    count = min(shape.image_limit, max(0, room // per))
    if count or shape.image_limit == 0:
        return count, shape.max_side_px
    side = shape.max_side_px
    step = shape.vision.merge_factor_px
    while side > step and image_tokens(shape.vision, side, side) + IMAGE_WRAP_TOKENS > room:
        side -= step
    fits = image_tokens(shape.vision, side, side) + IMAGE_WRAP_TOKENS <= room
    return (1, side) if fits else (0, side)


def worst_case(shape: ImageShape, max_model_len: int, max_tokens: int, uid: str,
               template_tokens: int = TEMPLATE_TOKENS_GUESS) -> MMRequest:
    """The worst-case request: its images, and text that fills the rest of max_model_len."""
    count, side = worst_case_images(shape, max_model_len, max_tokens, template_tokens)
    tokens = image_tokens(shape.vision, side, side)
    images = tuple(ImageAsk(side, side, f"{uid}/{k}", tokens) for k in range(count))
    text = max_model_len - max_tokens - template_tokens - count * (tokens + IMAGE_WRAP_TOKENS)
    return MMRequest(images, max(1, text), max_tokens)


def soak_request(shape: ImageShape, max_model_len: int, seed: int, i: int,
                 template_tokens: int = TEMPLATE_TOKENS_GUESS) -> MMRequest:
    """The soak's `i`-th request (deterministic in seed and i); what would not fit in
    max_model_len is dropped, largest image first."""
    rng = random.Random(f"pretuner-soak/{seed}/{i}")  # noqa: S311 - test data, not crypto
    most, _ = worst_case_images(shape, max_model_len, SOAK_MAX_TOKENS, template_tokens)
    most = max(1, most) if shape.image_limit else 0
    count = rng.choices(range(most + 1), weights=[1] + [6 // (k + 1) + 1 for k in range(most)])[0]
    sides = [tuple(rng.choices(SOAK_SIDES_PX, weights=SOAK_SIDE_WEIGHTS, k=2))
             for _ in range(count)]
    text = rng.randint(*SOAK_TEXT_TOKENS)
    room = max_model_len - SOAK_MAX_TOKENS - template_tokens - 1
    images = [ImageAsk(w, h, f"soak/{seed}/{i}/{k}", image_tokens(shape.vision, h, w))
              for k, (w, h) in enumerate(sides)]
    while images and sum(a.tokens + IMAGE_WRAP_TOKENS for a in images) + text > room:
        images.remove(max(images, key=lambda a: a.tokens))
    text = max(1, min(text, room - sum(a.tokens + IMAGE_WRAP_TOKENS for a in images)))
    return MMRequest(tuple(images), text, SOAK_MAX_TOKENS)


@dataclass(frozen=True, slots=True)
class TextRequest:
    """A completion of `prompt_len` token ids (no template): the text-only worst case."""

    prompt_len: int
    max_tokens: int


Request = TextRequest | MMRequest


@dataclass(frozen=True, slots=True)
class LoadPhase:
    """Requests sent in one sampled phase: all at once, or `concurrency` in flight; `reset`
    drops the server's multimodal caches once they are answered."""

    name: str
    requests: tuple[Request, ...]
    concurrency: int | None = None
    reset: bool = False


def validation_phases(shape: ImageShape, max_model_len: int, decode: int, count: int,
                      soak: int, seed: int,
                      template_tokens: int = TEMPLATE_TOKENS_GUESS) -> list[LoadPhase]:
    """A vision-language model's validation phases, worst first (`engines.v1_images`)."""

    def burst(tag: str) -> tuple[MMRequest, ...]:  # `count` at once, every image distinct
        return tuple(worst_case(shape, max_model_len, decode, f"worst/{seed}/{tag}/{i}",
                                template_tokens) for i in range(count))

    phases = [LoadPhase("worst", (TextRequest(max_model_len - decode, decode),)),
              LoadPhase("images", burst("a"))]
    if soak <= 0:
        return phases
    # Two halves: the second one's growth says whether memory still grows.
    first = math.ceil(soak / 2)
    # In flight: the burst's count (what the KV cache and max-num-seqs allow for the longest
    # requests), at most SOAK_CONCURRENCY_CAP.
    c = max(1, min(count, SOAK_CONCURRENCY_CAP))
    mix = [soak_request(shape, max_model_len, seed, i, template_tokens) for i in range(soak)]
    phases += [LoadPhase("soak-1", tuple(mix[:first]), c),
               LoadPhase("soak-2", tuple(mix[first:]), c, reset=True),
               LoadPhase("after-soak", burst("b"))]
    return phases
