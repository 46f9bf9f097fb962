"""One `Setup` for every engine: what a run needs before its first launch, and the tuning
method (`tune.r01`: the r0.1 pre-run loop, `tune.pinned`: the V1 pinned KV) it runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pretuner.devices.npu_smi import CardInfo
from pretuner.engines.base import LaunchSettings
from pretuner.engines.mindspore_r01 import R01Engine
from pretuner.engines.outcome import Executor, LaunchOutcome
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import Soak
from pretuner.engines.vllm_v1 import V1Engine
from pretuner.launch.images import ImageShape
from pretuner.models.spec import ModelSpec
from pretuner.report.records import Method as MethodName
from pretuner.report.records import RunReport
from pretuner.tune.execute import LaunchContext, Phase

if TYPE_CHECKING:
    from pretuner.tune.report import RunMeta

C = TypeVar("C")
OnDecision = Callable[[dict[str, Any]], object] | None


class Method(Protocol):
    """A tuning method as the pipeline drives it."""

    name: MethodName  # the report's method
    then: str  # what the run does after the pre-run, as a dry run says it

    @property
    def outcomes(self) -> Sequence[LaunchOutcome]: ...
    @property
    def decisions(self) -> Sequence[dict[str, Any]]: ...

    def begin(self) -> None:
        """What the method says and refuses before its first launch."""
        ...

    def run(self) -> Any: ...
    def first_launch(self) -> LaunchSettings: ...
    def report_json(self, result: Any, meta: RunMeta) -> RunReport: ...
    def layout(self) -> dict[str, Any]:
        """The report's model, card_gib, tp, pp, nodes, weights_format, kv_bytes_per_token."""
        ...


@dataclass(frozen=True, slots=True)
class Vision:
    """What a vision-language model adds to a V1 run."""

    images: ImageShape | None
    soak: Soak
    flags: tuple[tuple[str, str | None], ...]
    limit_given: bool
    mm_processor_cache_gb: float | None = None


@dataclass(frozen=True, slots=True)
class Setup(Generic[C]):
    choice: EngineChoice
    engine: R01Engine | V1Engine
    spec: ModelSpec
    model_arg: str  # what the server loads
    ctx: LaunchContext
    card: CardInfo
    layout_reason: str
    cfg: C  # the method's configuration
    # (execute, phase, on_decision) -> the method, ready to run
    start: Callable[[Executor, Phase, OnDecision], Method]
    vision: Vision = Vision(None, Soak(), (), False)  # a V1 vision-language model's images
