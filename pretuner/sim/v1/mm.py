"""The emulated vision tower under vLLM 0.24 (V1): its memory on the card and its caches.

Pure; bytes per rank; *simulated*, fitted to the field notes on Qwen3-VL-8B TP2
(../shared/seeds/000_*, 001_*). An image costs, in vLLM's order: profiling's dummy images, the
encoder's transient when it runs, its output in the encoder cache (whose high-water mark torch
keeps), the blocks a new image shape strands, and host memory in the processor cache, the only
thing `/reset_mm_cache` clears. `tests/test_sim_v1_vision.py` pins the soak's growth."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pretuner.models.vision import (
    VLLM_DEFAULT_MM_LIMIT,
    VisionSpec,
    encoder_cache_bytes,
    encoder_cache_tokens,
    images_per_prompt,
    max_image_tokens,
    profiled_images,
)
from pretuner.sim.memory import DEFAULT_SEED, perturb
from pretuner.sim.v1.memory import round_alloc

FRAG_CLASS_TOKENS = 512  # images whose tokens differ by less share torch's cached blocks


@dataclass(frozen=True, slots=True)
class VisionCoefficients:
    """The hidden coefficients of the vision tower (module docstring)."""

    hidden_copies: float = 10.0  # hidden-size values alive per patch in the encoder
    frag_cap_images: float = 1.14  # fragmentation ceiling, in largest-image activations
    frag_rate: float = 0.12  # share of what is left below the ceiling a new shape adds


@dataclass(frozen=True, slots=True)
class VisionCard:
    """The vision tower's memory on one rank, and vLLM's multimodal budget for a config."""

    vision: VisionSpec
    tp: int
    dtype_bytes: int
    coeffs: VisionCoefficients
    image_limit: int  # --limit-mm-per-prompt image count (vLLM's 999 when not given)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def max_item_tokens(self) -> int:
        return max_image_tokens(self.vision)

    @property
    def budget_tokens(self) -> int:
        """The encoder cache size and compute budget (0: images refused)."""
        if self.image_limit == 0:
            return 0
        return encoder_cache_tokens(self.max_num_batched_tokens, self.max_item_tokens)

    @property
    def profiled(self) -> int:
        per_prompt = images_per_prompt(self.image_limit, self.max_model_len,
                                       self.max_item_tokens)
        return profiled_images(self.budget_tokens, self.max_item_tokens, per_prompt,
                               self.max_num_seqs)

    def activation_bytes(self, tokens: int) -> int:
        """The encoder's transient for `tokens` merged tokens of images run together."""
        v = self.vision
        per_patch = self.coeffs.hidden_copies * v.hidden_size + (
            3 * v.hidden_size + v.intermediate_size) / self.tp
        return round_alloc(tokens * v.spatial_merge_size**2 * per_patch * self.dtype_bytes)

    def output_bytes(self, tokens: int) -> int:
        return encoder_cache_bytes(self.vision, tokens, self.dtype_bytes)

    def profile_bytes(self, dummy_step_bytes: int) -> int:
        """What profiling's multimodal moment adds above weights: the encoder on the dummy
        images, or their outputs beside the dummy step, whichever is larger."""
        tokens = self.profiled * self.max_item_tokens
        if tokens == 0:
            return dummy_step_bytes
        return max(self.activation_bytes(tokens), self.output_bytes(tokens) + dummy_step_bytes)


def vision_card(v: VisionSpec, *, tp: int, dtype_bytes: int, seed: int, image_limit: int | None,
                max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> VisionCard:
    limit = VLLM_DEFAULT_MM_LIMIT if image_limit is None else image_limit
    # Seed 0: exactly the calibration; else each coefficient perturbed (`pretuner.sim.memory`).
    coeffs = perturb(VisionCoefficients(), f"pretuner-sim-v1-vision-{seed}",
                     exact=seed == DEFAULT_SEED)
    return VisionCard(v, tp, dtype_bytes, coeffs, limit, max_model_len, max_num_seqs,
                      max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class MMItem:
    """One image in a prompt: where its tokens start, how many, and its content hash."""

    offset: int
    tokens: int
    key: str

    @property
    def end(self) -> int:
        return self.offset + self.tokens


class EncoderCache:
    """vLLM's EncoderCacheManager: outputs by content hash, `capacity` tokens; an entry no
    request needs is kept "freeable" and evicted (oldest first) only when space is wanted."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.entries: dict[str, int] = {}  # key -> tokens
        self.refs: dict[str, set[str]] = {}  # key -> request ids needing it
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.high_water_tokens = 0

    @property
    def used_tokens(self) -> int:
        return sum(self.entries.values())

    def room_for(self, tokens: int, pending: int) -> bool:
        """Whether `tokens` more fit beside `pending` tokens already promised this step."""
        free = self.capacity - self.used_tokens + sum(self.freeable.values())
        return tokens + pending <= free

    def hold(self, key: str, rid: str) -> None:
        self.refs.setdefault(key, set()).add(rid)
        self.freeable.pop(key, None)

    def add(self, key: str, tokens: int, rid: str) -> None:
        while self.freeable and self.capacity - self.used_tokens < tokens:
            old, _ = self.freeable.popitem(last=False)
            del self.entries[old]
            self.refs.pop(old, None)
        self.entries[key] = tokens
        self.hold(key, rid)
        self.high_water_tokens = max(self.high_water_tokens, self.used_tokens)

    def release(self, key: str, rid: str) -> None:
        users = self.refs.get(key)
        if users is None:
            return
        users.discard(rid)
        if not users and key in self.entries:
            self.freeable[key] = self.entries[key]


class MMState:
    """The multimodal state of one running engine: the encoder cache, the fragmentation it
    and the encoder left, and the host-side processor cache."""

    def __init__(self, card: VisionCard, processor_cache_bytes: int) -> None:
        self.card = card
        self.encoder = EncoderCache(card.budget_tokens)
        self.shapes: set[int] = set()
        self.frag_bytes = 0
        self.processor_capacity = processor_cache_bytes
        self.processor: OrderedDict[str, int] = OrderedDict()  # key -> host bytes

    def held_bytes(self, new_tokens: int = 0) -> int:
        """What the card keeps for images whatever runs, once `new_tokens` more outputs are in
        the encoder cache (capped at its size): its high-water mark and the stranded blocks."""
        tokens = min(self.encoder.capacity, self.encoder.used_tokens + new_tokens)
        return (self.card.output_bytes(max(self.encoder.high_water_tokens, tokens))
                + self.frag_bytes)

    def encoded(self, items: list[MMItem]) -> None:
        """Torch's cache after the encoder ran on `items`: new shapes strand blocks."""
        for item in items:
            shape = -(-item.tokens // FRAG_CLASS_TOKENS)
            if shape in self.shapes:
                continue
            self.shapes.add(shape)
            card = self.card
            cap = int(card.coeffs.frag_cap_images * card.activation_bytes(card.max_item_tokens))
            self.frag_bytes += int(card.coeffs.frag_rate * max(0, cap - self.frag_bytes))

    def processed(self, key: str, host_bytes: int) -> None:
        """The API server kept an image's processed inputs (host memory, LRU)."""
        if self.processor_capacity <= 0 or host_bytes > self.processor_capacity:
            return
        self.processor.pop(key, None)
        self.processor[key] = host_bytes
        while sum(self.processor.values()) > self.processor_capacity:
            self.processor.popitem(last=False)

    def reset(self) -> None:
        """`/reset_mm_cache`: the processor cache (host) is emptied; the card's encoder cache
        and torch's blocks are untouched."""
        self.processor.clear()


def pixel_bytes(v: VisionSpec, tokens: int) -> int:
    """Host bytes of one image's processed inputs (fp32 patches), what the processor caches."""
    patch_values = v.in_channels * v.temporal_patch_size * v.patch_size_px**2
    return tokens * v.spatial_merge_size**2 * patch_values * 4
