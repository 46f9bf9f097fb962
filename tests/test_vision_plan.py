"""Vision-language models: the vision spec, its derived figures, and plan's images block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretuner.errors import BadInputError
from pretuner.models import lookup, resolve
from pretuner.models.registry import spec_from_dict
from pretuner.models.vision import (
    VisionSpec,
    encoder_activation_bytes,
    encoder_cache_bytes,
    encoder_cache_tokens,
    image_tokens,
    images_per_prompt,
    max_image_tokens,
    parse_limit_mm_per_prompt,
    profiled_images,
    smart_resize,
    vision_bytes_per_card,
    vision_params,
)
from pretuner.plan.layout import PlanConfig, plan
from pretuner.units import GIB
from tests.helpers import CONFIGS, invoke

VL8 = lookup("qwen3-vl-8b-instruct").vision
VL32 = lookup("qwen3-vl-32b-instruct").vision
assert VL8 is not None
assert VL32 is not None


def test_registry_vl_entries_carry_the_vision_block() -> None:
    assert VL8 is not None
    assert VL32 is not None
    assert (VL8.depth, VL8.hidden_size, VL8.intermediate_size, VL8.num_heads) == (
        27, 1152, 4304, 16,
    )  # fmt: skip
    assert (VL8.patch_size_px, VL8.spatial_merge_size, VL8.temporal_patch_size) == (16, 2, 2)
    assert VL8.deepstack_visual_indexes == (8, 16, 24)
    assert (VL8.out_hidden_size, VL32.out_hidden_size) == (4096, 5120)
    assert VL8.max_image_side_px == 4096
    assert lookup("qwen3-8b").vision is None


def test_every_text_model_keeps_loading_without_vision() -> None:
    from pretuner.models import builtin_specs

    with_vision = {s.name for s in builtin_specs() if s.vision is not None}
    assert with_vision == {"qwen3-vl-8b-instruct", "qwen3-vl-32b-instruct"}


def test_unknown_vision_key_is_refused() -> None:
    data = json.loads(json.dumps(_registry_json("qwen3-vl-8b-instruct")))
    data["vision"]["patch_px"] = 16
    with pytest.raises(BadInputError, match="unknown vision key"):
        spec_from_dict(data, "x.json")


def _registry_json(name: str) -> dict[str, object]:
    path = Path(__file__).parents[1] / "pretuner" / "models" / "data" / f"{name}.json"
    data: dict[str, object] = json.loads(path.read_text("utf-8"))
    return data


@pytest.mark.parametrize(
    ("height", "width", "resized", "tokens"),
    [
        (4096, 4096, (4096, 4096), 16_384),  # the max-size dummy image vLLM profiles with
        (8192, 8192, (4096, 4096), 16_384),  # scaled down into max pixels
        (1080, 1920, (1088, 1920), 2_040),  # sides rounded to 32 px
        (100, 100, (256, 256), 64),  # scaled up to min pixels
        (512, 512, (512, 512), 256),
    ],
)
def test_image_tokens(height: int, width: int, resized: tuple[int, int], tokens: int) -> None:
    assert VL8 is not None
    assert smart_resize(height, width, VL8) == resized
    assert image_tokens(VL8, height, width) == tokens


def test_max_image_tokens_follows_max_pixels() -> None:
    small = VisionSpec(27, 1152, 4304, 16, 14, 2, 2, 3584, max_image_pixels=1280 * 28 * 28)
    assert max_image_tokens(small) == 1_225  # Qwen2.5-VL's 1280 x 28 x 28 px (35 x 35 tokens)
    assert VL8 is not None
    assert max_image_tokens(VL8) == 16_384


@pytest.mark.parametrize(
    ("which", "params", "tp", "gib_per_card"),
    [
        ("8b", 576_388_336, 1, 1.0736),  # the registry notes' count, from the checkpoint
        ("8b", 576_388_336, 2, 0.5414),  # 571,502,592 in linear layers, split
        ("32b", 595_266_800, 1, 1.1088),
        ("32b", 595_266_800, 4, 0.2840),
    ],
)
def test_vision_params_and_bytes(which: str, params: int, tp: int, gib_per_card: float) -> None:
    v = VL8 if which == "8b" else VL32
    assert v is not None
    total, matrices = vision_params(v)
    assert total == params
    assert 0.95 * total < matrices < total
    assert vision_bytes_per_card(v, tp, 2) / GIB == pytest.approx(gib_per_card, abs=1e-3)


@pytest.mark.parametrize(
    ("batched", "item", "cache"),
    [
        (32_768, 16_384, 32_768),
        (8_192, 16_384, 16_384),
        (2_048, 16_384, 16_384),
        (16_384, 256, 16_384),
    ],
)
def test_encoder_cache_tokens(batched: int, item: int, cache: int) -> None:
    assert encoder_cache_tokens(batched, item) == cache


def test_encoder_cache_bytes_count_deepstack_features() -> None:
    assert VL8 is not None
    # seed 000: "image_cache: 1 G" for the 32,768-token budget, 4 x 4096 values per token
    assert encoder_cache_bytes(VL8, 32_768, 2) == 1 * GIB
    assert encoder_cache_bytes(VL8, 0, 2) == 0


@pytest.mark.parametrize(
    ("limit", "length", "item", "per_prompt"),
    [
        (999, 65_536, 16_384, 4),
        (2, 65_536, 16_384, 2),
        (999, 8_192, 16_384, 1),  # vLLM still plans one item, which cannot fit
        (0, 65_536, 16_384, 0),
    ],
)
def test_images_per_prompt(limit: int, length: int, item: int, per_prompt: int) -> None:
    assert images_per_prompt(limit, length, item) == per_prompt


@pytest.mark.parametrize(
    ("cache", "item", "per_prompt", "seqs", "profiled"),
    [(32_768, 16_384, 4, 256, 2), (16_384, 16_384, 1, 256, 1), (65_536, 16_384, 1, 2, 2),
     (0, 16_384, 0, 256, 0)],
)  # fmt: skip
def test_profiled_images(cache: int, item: int, per_prompt: int, seqs: int, profiled: int) -> None:
    assert profiled_images(cache, item, per_prompt, seqs) == profiled


def test_encoder_activation_estimate_matches_the_field_note() -> None:
    assert VL8 is not None
    two = encoder_activation_bytes(VL8, 2, 2, 2)
    assert two / GIB == pytest.approx(3.76, abs=0.01)  # seed 000: 3.8 G for 2 images, TP2
    assert encoder_activation_bytes(VL8, 1, 2, 2) * 2 == two
    assert encoder_activation_bytes(VL8, 1, 4, 2) < encoder_activation_bytes(VL8, 1, 2, 2)


@pytest.mark.parametrize(
    ("text", "limits"),
    [
        ("image=2", {"image": 2}),
        ("image=2,video=0", {"image": 2, "video": 0}),
        ('{"image": 2}', {"image": 2}),
        ('{"video": 0}', {"video": 0}),
    ],
)
def test_parse_limit_mm_per_prompt(text: str, limits: dict[str, int]) -> None:
    assert parse_limit_mm_per_prompt(text) == limits


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("image", "not MODALITY=COUNT"),
        ("image=-1", "not MODALITY=COUNT"),
        ("picture=2", "unknown modality"),
        ('{"image": "two"}', "must be a count"),
        ('{"image": 2', "not valid JSON"),
        ("", "names no modality"),
    ],
)
def test_parse_limit_mm_per_prompt_refuses(text: str, fragment: str) -> None:
    with pytest.raises(BadInputError, match=fragment):
        parse_limit_mm_per_prompt(text)


def test_plan_reproduces_the_field_note_budgets() -> None:
    # seed 000: Qwen3-VL-8B TP2, --max-num-batched-tokens 32768 -> budget 32768, 2 images
    r = plan(
        PlanConfig(
            model=lookup("qwen3-vl-8b"), card_gib=64, util=0.95, tp=2,
            max_model_len=65_536, max_num_batched_tokens=32_768,
        )
    )  # fmt: skip
    assert r.vision is not None
    assert (r.vision.encoder_cache_tokens, r.vision.profiled_images) == (32_768, 2)
    assert r.vision.images_per_prompt == 4
    # seed 004: Qwen3-VL-32B TP2 with vLLM's defaults -> budget 16384, 1 image
    r32 = plan(PlanConfig(model=lookup("qwen3-vl-32b"), card_gib=64, tp=2))
    assert r32.vision is not None
    assert (r32.vision.encoder_cache_tokens, r32.vision.profiled_images) == (16_384, 1)
    assert 0 < r32.vision.image_share < 1


def test_image_limit_zero_disables_the_encoder_cache() -> None:
    r = plan(PlanConfig(model=lookup("qwen3-vl-8b"), card_gib=64, tp=2, image_limit=0))
    assert r.vision is not None
    assert (r.vision.encoder_cache_bytes, r.vision.activation_bytes) == (0, 0)
    assert r.vision.weights_bytes_per_card > 0  # the tower is still loaded


def test_text_model_refuses_an_image_limit() -> None:
    """Refused as `run` refuses it (tests/test_input_validation.py holds the two to one line)."""
    proc = invoke("plan", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "64",
                  "--limit-mm-per-prompt", "image=2")  # fmt: skip
    assert proc.returncode == 2
    assert "qwen3-8b is a text model" in proc.stderr


def test_cli_plan_vl_text_shows_images_block() -> None:
    proc = invoke(
        "plan", "--model", "qwen3-vl-8b", "--engine", "vllm", "--emulate", "--card", "64", "--tp", "2",
        "--limit-mm-per-prompt", "image=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "images (predicted, max-size images):" in out
    assert "tokens per image: 16,384 tokens at 4096 x 4096 px" in out
    assert "limit 2 (--limit-mm-per-prompt); 1 fits in max_model_len 16,384" in out
    assert "encoder cache budget: 16,384 tokens" in out
    assert "image share:" in out
    assert "of card*util" in out
    assert "GiB of host memory per API server" in out


def test_cli_plan_vl_json_has_vision_key() -> None:
    proc = invoke(
        "plan", "--model", "qwen3-vl-8b", "--engine", "vllm", "--emulate", "--card", "64", "--tp", "2",
        "--limit-mm-per-prompt", '{"image": 2}', "--max-num-batched-tokens", "32K",
        "--max-model-len", "65536", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    vision = json.loads(proc.stdout)["vision"]
    assert vision["tokens_per_image"] == 16_384
    assert vision["images_per_prompt"] == 2
    assert vision["prompt_image_tokens"] == 32_768
    assert vision["encoder_cache_tokens"] == 32_768
    assert vision["encoder_cache_gib"] == 1.0
    assert vision["vision_params"] == 576_388_336
    assert vision["mm_processor_cache_gib_host"] == 4.0
    assert vision["provenance"] == "predicted"


def test_cli_plan_text_model_has_no_images_block() -> None:
    proc = invoke("plan", "--model", "qwen3-8b", "--card", "64")
    assert proc.returncode == 0, proc.stderr
    assert "images" not in proc.stdout
    proc = invoke("plan", "--model", "qwen3-8b", "--card", "64", "--json")
    assert json.loads(proc.stdout)["vision"] is None


def test_cli_plan_bad_limit_is_exit_2() -> None:
    proc = invoke("plan", "--model", "qwen3-vl-8b", "--card", "64", "--limit-mm-per-prompt", "x")
    assert proc.returncode == 2
    assert "MODALITY=COUNT" in proc.stderr


def test_hf_folder_reads_vision_config(tmp_path: Path) -> None:
    shutil.copy(CONFIGS / "Qwen--Qwen3-VL-8B-Instruct.json", tmp_path / "config.json")
    spec = resolve(str(tmp_path))
    assert spec.vision is not None
    assert spec.vision == VisionSpec(**{
        **{f: getattr(VL8, f) for f in VisionSpec.__slots__},
        "pixels_source": spec.vision.pixels_source,
    })  # fmt: skip
    assert spec.vision.pixels_source.startswith("assumed")
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"longest_edge": 1024 * 1024, "shortest_edge": 4096}})
    )
    v = resolve(str(tmp_path)).vision
    assert v is not None
    assert (v.max_image_pixels, v.min_image_pixels) == (1024 * 1024, 4096)
    assert max_image_tokens(v) == 1_024
    assert v.pixels_source.endswith("preprocessor_config.json")


def test_hf_folder_partial_vision_config_still_loads(tmp_path: Path) -> None:
    cfg = json.loads((CONFIGS / "Qwen--Qwen3-VL-8B-Instruct.json").read_text("utf-8"))
    cfg["vision_config"] = {"depth": 27, "hidden_size": 1152}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve(str(tmp_path))
    assert spec.vision is None
    assert "image figures are not predicted" in spec.notes
