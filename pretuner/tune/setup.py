"""One `Setup` for every engine: what a run needs before its first launch, and the tuning
method (`tune.r01`: the r0.1 pre-run loop, `tune.pinned`: the V1 pinned KV) it runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pretuner.devices import DeviceReader
from pretuner.devices.npu_smi import CardInfo
from pretuner.engines.base import Engine, LaunchCommand, LaunchSettings, Target
from pretuner.engines.outcome import BURST_OUTPUT_TOKENS, Executor, LaunchOutcome
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import Soak
from pretuner.engines.v1_launch import V1Hooks
from pretuner.errors import NotValidatedError
from pretuner.launch.command import ALL_HOSTS, PORT_SLOT, wrapped
from pretuner.launch.images import ImageShape
from pretuner.launch.process import raise_if_interrupted
from pretuner.models.spec import ModelSpec
from pretuner.report.records import Method as MethodName
from pretuner.report.records import RunReport
from pretuner.tune.execute import LaunchContext, Phase

if TYPE_CHECKING:
    from pretuner.tune.options import RunOptions
    from pretuner.tune.report import RunMeta

C = TypeVar("C")
# Both methods tighten a validated configuration only when that buys this share more KV.
TIGHTEN_MIN_GAIN = 0.02
OnDecision = Callable[[dict[str, Any]], object] | None
log = logging.getLogger(__name__)


class Method:
    """A tuning method as the pipeline drives it: the journal of its decisions and launches and
    the launch budget, written once; each method adds its arithmetic and its order of launches."""

    name: MethodName  # the report's method
    then: str  # what the run does after the pre-run, as a dry run says it
    why_key = "reason"  # what the journal calls a decision's reason ("detail" on V1)

    def __init__(self, execute: Executor, phase: Phase, on_decision: OnDecision,
                 max_launches: int) -> None:
        self.execute = execute
        self.phase = phase
        self.on_decision = on_decision
        self.max_launches = max_launches
        self.outcomes: list[LaunchOutcome] = []
        self.decisions: list[dict[str, Any]] = []

    def decide(self, what: str, why: str, **data: Any) -> None:
        entry = {"decision": what, self.why_key: why, **data}
        self.decisions.append(entry)
        if self.on_decision is not None:
            self.on_decision(entry)
        log.info("decision: %s (%s)", what, why)
        self.phase("decide", f"{what}: {why}")

    def launches_left(self) -> int:
        return self.max_launches - len(self.outcomes)

    def launch(self, settings: LaunchSettings) -> LaunchOutcome:
        raise_if_interrupted()  # a stop asked for whose first raise was swallowed
        if self.launches_left() <= 0:
            raise NotValidatedError(
                f"launch budget of {self.max_launches} used up before a configuration was "
                "validated",
                hint="raise --max-launches, or read the run record's decisions",
            )
        outcome = self.execute(settings)
        self.outcomes.append(outcome)
        return outcome

    def begin(self) -> None:
        """What the method says and refuses before its first launch."""

    def run(self) -> Any:
        raise NotImplementedError

    def first_launch(self) -> LaunchSettings:
        raise NotImplementedError

    def report_json(self, result: Any, meta: RunMeta) -> RunReport:
        raise NotImplementedError

    def layout(self) -> dict[str, Any]:
        """The report's model, card_gib, tp, pp, nodes, weights_format, kv_bytes_per_token."""
        raise NotImplementedError


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
    engine: Engine
    model_arg: str  # what the server loads
    ctx: LaunchContext
    card: CardInfo
    layout_reason: str
    cfg: C  # the method's configuration
    # (execute, phase, on_decision) -> the method, ready to run
    start: Callable[[Executor, Phase, OnDecision], Method]
    vision: Vision = Vision(None, Soak(), (), False)  # a V1 vision-language model's images


def launch_context(opts: RunOptions, engine: Engine, model_arg: str,
                   spec: ModelSpec, reader: DeviceReader | None, *, decode_tokens: int = 16,
                   hooks: V1Hooks | None = None) -> LaunchContext:
    """What every launch of a run shares, from its options, its model and its engine."""

    # A wrapper that publishes the port (`docker run -p {port}:{port}`) reaches a server
    # listening on all of its container's interfaces; pretuner still connects to opts.host.
    host = ALL_HOSTS if any(PORT_SLOT in word for word in engine.serve_cmd) else opts.host

    def build(settings: LaunchSettings, port: int) -> LaunchCommand:
        cmd = engine.command(settings, Target(model_arg, spec.name, host, port))
        return replace(cmd, argv=wrapped(cmd.argv, port, cmd.env))

    return LaunchContext(
        build=build, served_name=spec.name, host=opts.host, ready_timeout_s=opts.ready_timeout_s,
        request_timeout_s=opts.request_timeout_s, stop_grace_s=opts.stop_grace_s, seed=opts.seed,
        decode_tokens=decode_tokens, device_reader=reader, hooks=hooks,
        # A CPU engine's burst generates its few validation tokens (its runs stay short).
        burst_tokens=decode_tokens if engine.device_kind == "cpu" else BURST_OUTPUT_TOKENS,
        vocab_size=spec.vocab_size, server_in_group=not engine.serve_cmd)
