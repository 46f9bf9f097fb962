"""A vision-language model's vision tower, and the image figures `plan` derives from it.

Qwen-VL layout (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a ViT over `patch_size_px` square patches
whose outputs are merged `spatial_merge_size`^2 to one language-model token. Everything here is
pure arithmetic on the config; a run measures what it predicts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from pretuner.errors import BadInputError
from pretuner.models.checkpoint import config_int, reject_unknown
from pretuner.units import GIB

# Qwen3-VL's preprocessor_config.json: size.longest_edge 16,777,216 px (= 4096 x 4096, the
# dummy image vLLM profiles with, seed 000) and size.shortest_edge 65,536 px (256 x 256).
QWEN3_VL_MAX_PIXELS = 4096 * 4096
QWEN3_VL_MIN_PIXELS = 256 * 256
# vLLM MultiModalConfig.get_limit_per_prompt: a modality not named in --limit-mm-per-prompt
# allows 999 items; vLLM then profiles min(limit, max_model_len // tokens per item) of them.
VLLM_DEFAULT_MM_LIMIT = 999
VLLM_MM_MODALITIES = ("image", "video", "audio")
# vLLM MultiModalConfig.mm_processor_cache_gb: host memory, per API-server process, not card.
DEFAULT_MM_PROCESSOR_CACHE_GIB = 4.0
# vLLM's max_num_batched_tokens when not set (`vllm serve` on large cards, 2048 on small ones)
# and max_num_seqs (SchedulerConfig). Either is below one 4096 x 4096 Qwen3-VL image (16,384).
VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
VLLM_DEFAULT_MAX_NUM_SEQS = 256
# Encoder activation estimate, per patch: this many hidden-size vectors alive on every card
# (residual, norms, rotary tables, attention output, the gathered result) plus the sharded qkv
# and MLP intermediates (3 x hidden + intermediate) / tp. 10 reproduces the one field note we
# have: Qwen3-VL-8B TP2 profiling 2 max-size images peaked 3.8 G in the encoder attention
# (seed 000), i.e. ~1.9 G per image; our formula gives 1.88 GiB. An estimate, not a law.
ENCODER_HIDDEN_COPIES = 10


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """The vision tower's dimensions and the image size limits of its preprocessor."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size_px: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0
    in_channels: int = 3
    max_image_pixels: int = QWEN3_VL_MAX_PIXELS
    min_image_pixels: int = QWEN3_VL_MIN_PIXELS
    pixels_source: str = "assumed: Qwen3-VL's preprocessor_config.json"

    @property
    def merge_factor_px(self) -> int:
        """Image sides are rounded to multiples of this (one merged token's side)."""
        return self.patch_size_px * self.spatial_merge_size

    @property
    def max_image_side_px(self) -> int:
        """The side of the largest square image the preprocessor keeps (4096 for Qwen3-VL)."""
        return math.isqrt(self.max_image_pixels)


_VISION_KEYS = {f.name for f in fields(VisionSpec)}


def vision_from_dict(data: Any, origin: str) -> VisionSpec:
    """A registry entry's "vision" block, rejecting unknown keys."""
    if not isinstance(data, dict):
        raise BadInputError(f"{origin}: vision must be a JSON object")
    reject_unknown(data, _VISION_KEYS, f"{origin}: unknown vision key(s)")
    values = {"pixels_source": "registry", **data,
              "deepstack_visual_indexes": tuple(data.get("deepstack_visual_indexes", ()))}
    try:
        return VisionSpec(**values)
    except TypeError as err:
        raise BadInputError(f"{origin}: vision: {err}") from None


def _pixel_limits(preproc: dict[str, Any] | None, origin: str) -> tuple[int, int, str]:
    """(max, min) pixels from preprocessor_config.json: Qwen3-VL's size.longest_edge /
    shortest_edge (pixel counts despite the names), or Qwen2-VL's max_pixels / min_pixels."""
    if preproc is None:
        return QWEN3_VL_MAX_PIXELS, QWEN3_VL_MIN_PIXELS, "assumed: Qwen3-VL's preprocessor_config"
    size = preproc.get("size")
    size = size if isinstance(size, dict) else {}
    most = (config_int(size, origin, "longest_edge", "max_pixels")
            or config_int(preproc, origin, "max_pixels"))
    least = (config_int(size, origin, "shortest_edge", "min_pixels")
             or config_int(preproc, origin, "min_pixels"))
    if most is None:
        why = f"assumed: {origin} names no max pixels; Qwen3-VL's 4096 x 4096"
        return QWEN3_VL_MAX_PIXELS, least or QWEN3_VL_MIN_PIXELS, why
    return most, least or 0, origin


def vision_from_config(
    cfg: dict[str, Any], preproc: dict[str, Any] | None, origin: str, preproc_origin: str
) -> tuple[VisionSpec | None, str]:
    """The VisionSpec of a config.json's `vision_config`, and a note when it has none we read
    (CLIP/SigLIP towers of other families: the text figures still hold)."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        return None, ""
    depth = config_int(vc, origin, "depth", "num_hidden_layers")
    hidden = config_int(vc, origin, "hidden_size", "embed_dim")
    inter = config_int(vc, origin, "intermediate_size")
    heads = config_int(vc, origin, "num_heads", "num_attention_heads")
    patch = config_int(vc, origin, "patch_size")
    if not depth or not hidden or not inter or not heads or not patch:
        return None, (
            "vision_config lacks the Qwen-VL keys (depth, hidden_size, intermediate_size, "
            "num_heads, patch_size): image figures are not predicted."
        )
    deepstack = vc.get("deepstack_visual_indexes") or []
    if not isinstance(deepstack, list) or not all(isinstance(i, int) for i in deepstack):
        raise BadInputError(f"{origin}: deepstack_visual_indexes must be a list of integers")
    most, least, source = _pixel_limits(preproc, preproc_origin)
    spec = VisionSpec(
        depth=depth, hidden_size=hidden, intermediate_size=inter, num_heads=heads,
        patch_size_px=patch, spatial_merge_size=config_int(vc, origin, "spatial_merge_size") or 2,
        temporal_patch_size=config_int(vc, origin, "temporal_patch_size") or 2,
        out_hidden_size=config_int(vc, origin, "out_hidden_size") or hidden,
        deepstack_visual_indexes=tuple(deepstack),
        num_position_embeddings=config_int(vc, origin, "num_position_embeddings") or 0,
        in_channels=config_int(vc, origin, "in_channels", "in_chans") or 3,
        max_image_pixels=most, min_image_pixels=least, pixels_source=source,
    )  # fmt: skip
    return spec, ""


# --- derived figures (pure) ---------------------------------------------------------------


def smart_resize(height_px: int, width_px: int, v: VisionSpec) -> tuple[int, int]:
    """The (height, width) the Qwen-VL preprocessor resizes an image to: sides rounded to the
    merge factor, the area scaled into [min_image_pixels, max_image_pixels]."""
    factor = v.merge_factor_px
    h = max(factor, round(height_px / factor) * factor)
    w = max(factor, round(width_px / factor) * factor)
    if h * w > v.max_image_pixels:
        beta = math.sqrt(height_px * width_px / v.max_image_pixels)
        h = max(factor, math.floor(height_px / beta / factor) * factor)
        w = max(factor, math.floor(width_px / beta / factor) * factor)
    elif h * w < v.min_image_pixels:
        beta = math.sqrt(v.min_image_pixels / (height_px * width_px))
        h = math.ceil(height_px * beta / factor) * factor
        w = math.ceil(width_px * beta / factor) * factor
    return h, w


def image_tokens(v: VisionSpec, height_px: int, width_px: int) -> int:
    """Language-model tokens of one image: (H / patch) x (W / patch) / merge^2 after resizing."""
    h, w = smart_resize(height_px, width_px, v)
    return (h // v.patch_size_px) * (w // v.patch_size_px) // v.spatial_merge_size**2


def max_image_tokens(v: VisionSpec) -> int:
    """Tokens of the largest image (4096 x 4096, patch 16, merge 2 -> 16,384 for Qwen3-VL)."""
    side = v.max_image_side_px
    return image_tokens(v, side, side)


def _merger_params(v: VisionSpec, postshuffle_norm: bool) -> tuple[int, int]:
    """(all, matrix) parameters of one patch merger: norm, fc1 (4h -> 4h), fc2 (4h -> out)."""
    wide = v.hidden_size * v.spatial_merge_size**2
    norm = 2 * (wide if postshuffle_norm else v.hidden_size)
    matrices = wide * wide + wide * v.out_hidden_size
    return norm + matrices + wide + v.out_hidden_size, matrices


def vision_params(v: VisionSpec) -> tuple[int, int]:
    """(all, matrix) parameters of the tower: patch embedding, position table, blocks, mergers;
    matrix parameters are the linear layers', which tensor parallelism splits."""
    h, i = v.hidden_size, v.intermediate_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size_px**2 * h + h
    block_matrices = 4 * h * h + 2 * h * i  # qkv (3h^2) + proj (h^2) + fc1 + fc2
    block = block_matrices + 4 * h + 3 * h + h + i + h  # + 2 LayerNorms + biases
    main_all, main_mat = _merger_params(v, postshuffle_norm=False)
    deep_all, deep_mat = _merger_params(v, postshuffle_norm=True)
    n_deep = len(v.deepstack_visual_indexes)
    total = patch + v.num_position_embeddings * h + v.depth * block + main_all + n_deep * deep_all
    matrices = v.depth * block_matrices + main_mat + n_deep * deep_mat
    return total, matrices


def vision_bytes_per_card(v: VisionSpec, tp: int, dtype_bytes: int) -> int:
    """The tower's weights on one card: linear matrices / tp, the rest on every card."""
    # vLLM's default --mm-encoder-tp-mode "weights" shards the tower's linear layers like the
    # language model's; "data" (opt-in, per model) would replicate all of it.
    total, matrices = vision_params(v)
    return (matrices // tp + (total - matrices)) * dtype_bytes


def encoder_activation_bytes(v: VisionSpec, images: int, tp: int, dtype_bytes: int) -> int:
    """Estimated encoder activation peak for `images` max-size images run together."""
    # Attention over one image's patches is assumed flash-style (linear in patches), so
    # images add up.
    patches = images * max_image_tokens(v) * v.spatial_merge_size**2
    per_patch = (
        ENCODER_HIDDEN_COPIES * v.hidden_size + (3 * v.hidden_size + v.intermediate_size) // tp
    )
    return patches * per_patch * dtype_bytes


def encoder_cache_tokens(max_num_batched_tokens: int, item_tokens: int) -> int:
    """vLLM's encoder cache size, and compute budget (vllm/v1/core/encoder_cache_manager.py
    compute_mm_encoder_budget, no encoder_cache_size set)."""
    return max(max_num_batched_tokens, item_tokens)


def encoder_cache_bytes(v: VisionSpec, tokens: int, dtype_bytes: int) -> int:
    """Card bytes of `tokens` cached encoder outputs (with Qwen3-VL's deepstack features)."""
    # Not divided by TP: every rank keeps the whole encoder output.
    return tokens * v.out_hidden_size * (1 + len(v.deepstack_visual_indexes)) * dtype_bytes


def images_per_prompt(limit: int, max_model_len: int, item_tokens: int) -> int:
    """Max-size images vLLM plans into one prompt: max(1, min(limit, len // tokens)), 0 when
    the limit is 0 (vllm/multimodal/budget.py MultiModalBudget._get_max_items)."""
    if limit == 0:
        return 0
    return max(1, min(limit, max_model_len // item_tokens))


def profiled_images(cache_tokens: int, item_tokens: int, per_prompt: int, max_num_seqs: int) -> int:
    """Max-size images vLLM's memory profile runs through the encoder at once (same function):
    max(1, min(budget // tokens per item, max_num_seqs x images per prompt))."""
    if per_prompt == 0 or cache_tokens == 0:
        return 0
    return max(1, min(cache_tokens // item_tokens, max_num_seqs * per_prompt))


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt forms: `image=2`, `image=2,video=0`, `{"image": 2}`."""
    flag = "--limit-mm-per-prompt"
    hint = f"use e.g. {flag} image=2 or {flag} '{{\"image\": 2}}'"
    raw = text.strip()
    pairs: dict[str, Any]
    if raw.startswith("{"):
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError as err:
            why = f"{flag} {text!r} is not valid JSON ({err.msg})"
            raise BadInputError(why, hint=hint) from None
        pairs = loaded if isinstance(loaded, dict) else {}
    else:
        pairs = {}
        for part in filter(None, (p.strip() for p in raw.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not value.strip().isdigit():
                raise BadInputError(f"{flag} {text!r}: {part!r} is not MODALITY=COUNT", hint=hint)
            pairs[key.strip()] = int(value)
    if not pairs:
        raise BadInputError(f"{flag} {text!r} names no modality", hint=hint)
    for key, value in pairs.items():
        if key not in VLLM_MM_MODALITIES:
            raise BadInputError(f"{flag}: unknown modality {key!r}",
                                hint=f"choose from {', '.join(VLLM_MM_MODALITIES)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            # vLLM also takes {"count": N, "width": ..}: plan sizes images at the maximum.
            raise BadInputError(f"{flag}: {key} must be a count of 0 or more, got {value!r}",
                                hint=hint)
    return pairs  # every value checked to be a count


@dataclass(frozen=True, slots=True)
class VisionPlan:
    """The image figures of one plan, per card; every one predicted."""

    max_image_side_px: int
    tokens_per_image: int
    image_limit: int
    image_limit_source: str
    images_per_prompt: int
    prompt_image_tokens: int
    max_model_len: int
    max_num_batched_tokens: int
    encoder_cache_tokens: int
    encoder_cache_bytes: int
    profiled_images: int
    vision_params: int
    weights_bytes_per_card: int
    activation_bytes: int
    mm_processor_cache_gib: float
    budget_bytes: int  # card x util

    @property
    def card_bytes(self) -> int:
        return self.weights_bytes_per_card + self.activation_bytes + self.encoder_cache_bytes

    @property
    def image_share(self) -> float:
        return self.card_bytes / self.budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "max_image_px": [self.max_image_side_px, self.max_image_side_px],
            "tokens_per_image": self.tokens_per_image, "image_limit": self.image_limit,
            "image_limit_source": self.image_limit_source,
            "images_per_prompt": self.images_per_prompt,
            "prompt_image_tokens": self.prompt_image_tokens, "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "encoder_cache_tokens": self.encoder_cache_tokens,
            "encoder_cache_gib": round(self.encoder_cache_bytes / GIB, 3),
            "profiled_images": self.profiled_images, "vision_params": self.vision_params,
            "vision_weights_gib_per_card": round(self.weights_bytes_per_card / GIB, 3),
            "encoder_activation_gib": round(self.activation_bytes / GIB, 3),
            "mm_processor_cache_gib_host": self.mm_processor_cache_gib,
            "image_gib_per_card": round(self.card_bytes / GIB, 3),
            "image_share": round(self.image_share, 4), "provenance": "predicted",
        }  # fmt: skip


def plan_images(
    v: VisionSpec, *, dtype_bytes: int, tp: int, budget_bytes: int, max_model_len: int,
    image_limit: int | None, max_num_batched_tokens: int | None, mm_processor_cache_gib: float,
) -> VisionPlan:
    """The images block of `plan`: what max-size images take of the prompt and of the card."""
    tokens = max_image_tokens(v)
    limit = VLLM_DEFAULT_MM_LIMIT if image_limit is None else image_limit
    batched = max_num_batched_tokens or VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS
    per_prompt = images_per_prompt(limit, max_model_len, tokens)
    cache_tokens = encoder_cache_tokens(batched, tokens) if limit else 0
    profiled = profiled_images(cache_tokens, tokens, per_prompt, VLLM_DEFAULT_MAX_NUM_SEQS)
    return VisionPlan(
        max_image_side_px=v.max_image_side_px, tokens_per_image=tokens, image_limit=limit,
        image_limit_source=("vLLM's default" if image_limit is None else "--limit-mm-per-prompt"),
        images_per_prompt=per_prompt, prompt_image_tokens=per_prompt * tokens,
        max_model_len=max_model_len, max_num_batched_tokens=batched,
        encoder_cache_tokens=cache_tokens,
        encoder_cache_bytes=encoder_cache_bytes(v, cache_tokens, dtype_bytes),
        profiled_images=profiled, vision_params=vision_params(v)[0],
        weights_bytes_per_card=vision_bytes_per_card(v, tp, dtype_bytes),
        activation_bytes=encoder_activation_bytes(v, profiled, tp, dtype_bytes),
        mm_processor_cache_gib=mm_processor_cache_gib, budget_bytes=budget_bytes,
    )  # fmt: skip
