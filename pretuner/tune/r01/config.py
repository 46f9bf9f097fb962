"""What a tuning run is asked for and what it returns: `TuneConfig`, `TuneResult`, the loop's
constants and the small pure helpers the decision modules share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pretuner.devices.npu_smi import CardInfo as CardInfo
from pretuner.engines.base import LaunchSettings
from pretuner.engines.outcome import LaunchOutcome
from pretuner.kvmath import num_kv_blocks
from pretuner.method import Derivation
from pretuner.models.spec import ModelSpec
from pretuner.plan.layout import PlanConfig, PlanResult, layout_options
from pretuner.plan.propose import decide_layout
from pretuner.tune.r01 import budget as bud
from pretuner.units import GIB, MIB

UTIL_LADDER = (0.87, 0.85, 0.8)  # seed 003: lower util when the device refuses
VLLM_V0_WATERMARK = 0.01  # vLLM 0.6's block manager keeps 1 % of the KV blocks free
DEFAULT_CHUNK_TOKENS = 2048  # vLLM 0.6.6's budget when chunked prefill is on
CHUNK_GRID = 1024  # a larger chunk budget is a multiple of this
# A tightened configuration keeps the boot-noise floor (`pretuner.noise`) above what the
# validation measured under full load, plus this share of the activations.
TIGHTEN_MARGIN_SHARE = 0.001
LEARN_MARGIN = 0.10  # a validation OOM's per-sequence cost is inflated by this
CHUNKED_GROWING_SHARE = 0.1  # see WaModel.growing_share


@dataclass(frozen=True, slots=True)
class TuneConfig:
    model: ModelSpec
    card: CardInfo
    util: float = 0.9
    max_model_len: int = 16384
    min_model_len: int = 4096
    tp: int | None = None
    pp: int | None = None  # None: the layout chooses
    nodes: int | None = None
    cards_per_node: int = 8
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    weights_format: str | None = None
    headroom_gib: float | None = None  # base headroom; None: scaled to the measurement
    reserve_gib: float | None = None  # default: measured or scaled (pretuner.tune.r01.budget)
    # MindSpore maps its pool as it grows (MS_ALLOC_CONF enable_vmm:true): the device then shows
    # what the pool used, not its cap, and cannot tell what lies outside the pool.
    pool_on_demand: bool = False
    max_launches: int = 8
    validate: bool = True
    repeat_proof: int = 1  # boots the final configuration is proven on (--repeat-proof)
    model_use_gib: int | None = None  # pin the pre-run's model-use (the seed's 50); default: max
    watermark: float = VLLM_V0_WATERMARK
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # How the run's figures were obtained: "simulated" on the emulated card, where no figure
    # may be called measured.
    provenance: str = "measured"


@dataclass(frozen=True, slots=True)
class TuneResult:
    plan: PlanResult
    derivation: Derivation
    validated: bool
    outcomes: tuple[LaunchOutcome, ...]
    decisions: tuple[dict[str, Any], ...]
    final_util_source: str
    prerun: LaunchOutcome | None = None  # the pre-run the derivation rests on
    validation: LaunchOutcome | None = None  # the launch that proved it
    reserve_gib: float = 0.0  # what the derivation kept below the card's free memory (GiB)
    pool_on_demand: bool = False  # TuneConfig.pool_on_demand
    boot_peaks_mib: tuple[int, ...] = ()  # the final configuration's worst-rank peak per boot


def layout_of(cfg: TuneConfig) -> PlanConfig:
    return layout_options(cfg, model=cfg.model, card_gib=cfg.card.card_gib,
                          max_model_len=cfg.max_model_len, block_size=cfg.block_size)


def plan_for(cfg: TuneConfig) -> PlanResult:
    return decide_layout(layout_of(cfg))


def prerun_util(cfg: TuneConfig) -> float:
    """The method's 0.9, lowered when the card's free memory cannot give that much."""
    if cfg.card.free_mib is None:
        return cfg.util
    reserve = bud.reserve_gib(cfg.card.card_gib, measured_by_engine=False, given=cfg.reserve_gib)
    cap = bud.floor_to((cfg.card.free_mib * MIB / GIB - reserve) / cfg.card.card_gib, 2)
    return min(cfg.util, cap)


def kv_prerun_bytes(s: LaunchSettings, bpt: int) -> int:
    """The KV cache r0.1 allocated for a launch: whole blocks of card*util - model-use."""
    budget = int(s.card_gib * GIB * s.util) - s.model_use_gib * GIB
    return num_kv_blocks(budget, bpt, s.block_size) * s.block_size * bpt


def pool_on_demand(env: Mapping[str, str]) -> bool:
    """MindSpore's virtual-memory pool (`MS_ALLOC_CONF` with `enable_vmm:true`)."""
    conf = env.get("MS_ALLOC_CONF", "").replace(" ", "").lower()
    return "enable_vmm:true" in conf.split(",")
