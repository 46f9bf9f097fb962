"""report.json as one typed record: what a run leaves behind, on every engine, by either method.

The producers (`tune.report`, `tune.pinned.report`) build a `RunReport` (or a `FailureReport`);
report.json is `record.model_dump(mode="json")`. What both tuning methods share is a field of
the record; what one method alone has is its `derivation`, a union told apart by `method`.
Readers (presets, report.md, report.html, `explain`, the CLI) take the record, never a dict:
`read_report` validates a report.json, and upgrades one an earlier pretuner wrote (schema 1).
Unknown keys are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from pretuner.engines.registry import engine_class
from pretuner.errors import BadInputError
from pretuner.files import MAX_INPUT_BYTES, read_bounded
from pretuner.report import SCHEMA_VERSION
from pretuner.report.schema1 import upgrade

Provenance = Literal["simulated", "measured"]
Method = Literal["r0.1", "v1-pinned-kv"]


class Record(BaseModel):
    """A frozen block of report.json that refuses keys it does not know."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# -- one launch ------------------------------------------------------------------------------


class StepSettings(Record):
    """The launch's settings, as `LaunchSettings.to_json` writes them (journal and report)."""

    purpose: str
    card_gib: int
    util: float
    model_use_gib: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    tp: int
    pp: int = 1
    kv_cache_dtype: str = "auto"
    chunked_prefill: bool = False
    kv_cache_bytes: int | None = None  # V1 engines: the pinned KV; None: the engine profiles


class V1Speed(Record):
    """A validation's speed: the max-length request alone (streamed), then the concurrent load
    (`pretuner.speed.Speed`; seconds by the client's clock, or the emulated card's)."""

    prompt_tokens: int
    ttft_s: float
    decode_tokens: int
    decode_s: float
    load_requests: int
    load_tokens: int
    load_s: float | None
    how: str
    decode_tokens_per_s: float | None
    load_tokens_per_s: float | None
    decode_chunks: int | None = None  # streamed: chunks after the first (None: emulated clock)


class Step(Record):
    """One launch as `steps[]` shows it; a launch that raised before it had an outcome has its
    settings and `outcome` "failed", and None for everything measured."""

    n: int
    purpose: str
    settings: StepSettings
    outcome: str  # an OutcomeKind value, or "failed"
    worst_peak_mib: int | None
    worst_node: str | None
    rank_peaks_mib: dict[str, int]  # rank (or process) -> its peak
    device_reader: str | None
    device_peaks_mib: dict[str, int]  # phase -> the worst device's peak
    # On a Ray cluster: node label -> the peak of its worst device, MiB (measured on the node)
    node_peaks_mib: dict[str, int] = {}
    requests_ok: int | None
    requests_total: int | None
    oom_text: str | None
    seconds: float | None
    overhead_s: float | None
    log: str | None
    # What a V1 engine's log says of its KV, and a validation's soak and speed.
    kv_tokens: int | None = None
    kv_gib: float | None = None
    device_total_mib: int | None = None
    oom_alloc_bytes: int | None = None
    device_last_mib: dict[str, int] = {}  # phase -> its last sample
    soak_requests: int = 0
    reset_status: int | None = None
    speed: V1Speed | None = None
    weights_gib: float | None = None  # the engine's "Model loading took": weights on the card
    # at launch; "off": MindSpore's cache not enabled (every start compiles)
    compile_cache: Literal["cold", "warm", "off", "n/a"] | None = None


# Decisions stay dicts: each kind carries its own fields (`tp`/`pp` for a layout, the derived
# values for a derive...) next to `decision` and `reason` (r0.1) or `detail` (V1), exactly as
# the journal records them.
Decision = dict[str, Any]

# The Ray cluster stays a dict: it is `RayCollectors.info` as the journal's `cluster` event
# records it (gcs_address, nodes with node/ranks/local); pretuner.cluster owns its shape.
Cluster = dict[str, Any]


def decision_text(d: Decision) -> str:
    """What a decision says, whichever method made it."""
    return str(d.get("reason") or d.get("detail") or "")


class Asked(Record):
    """What the user asked for, beside what the run gives (`given_up` says the difference)."""

    max_model_len: int
    # V1: --max-num-seqs; r0.1: what the method derived from the pre-run before any validation
    # taught it otherwise (None: no validation ran).
    max_num_seqs: int | None


class Final(Record):
    """What production runs with, in the engine's own flags."""

    env: dict[str, str]
    flags: list[str]  # the server's argv after the model
    serve_command: list[str]  # [*command, model, *flags]; secrets redacted (read from env)
    engine_serve_command: list[str] | None  # a simulated run: what the real engine would run
    notes: list[str]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int | None  # r0.1: derived; V1: the validation's log (None: it did not say)
    kv_gib: float


# -- r0.1 (ASCEND_TOTAL_MEMORY_GB / vLLM_MODEL_MEMORY_USE_GB) -----------------------------------


class R01Derivation(Record):
    """The pre-run method's figures, worst rank, rounded as report.md prints them."""

    method: Literal["r0.1"] = "r0.1"
    kv_prerun_gib: float
    actual_peak_mib: int
    weights_act_gib: float
    headroom_gib: float
    headroom_total_gib: float
    rounding_cost_gib: float
    final_util_source: str
    util: float  # --gpu-memory-utilization: the pool cap is card x util
    lines: list[str]  # the derivation as report.md prints it
    memory_rows: list[str]  # report.md's memory per card: "part | GiB | how"


# -- V1 (--kv-cache-memory-bytes) -------------------------------------------------------------


class V1Weights(Record):
    """Where the weights live: as loaded on each card, offloaded to the host, swap beside them.
    Sizes are predicted from the checkpoint (`plan`), except `card_weights_log_gib` (the
    engine's own "Model loading took" in the final launch's log) and the host's memory."""

    quantization: str | None  # --quantization as given; None: the checkpoint as stored
    loaded_as: str  # what the linear layers load as (bitsandbytes-nf4-dq, fp8-8bit, bf16...)
    cpu_offload_gib: float  # --cpu-offload-gb per card, as given
    swap_space_gib: float | None  # --swap-space per card, as given (None: the engine's 4)
    enforce_eager: bool
    loaded_gib_per_card: float
    offloaded_gib_per_card: float  # at most the decoder layers: embeddings stay on the card
    card_weights_gib: float
    card_weights_log_gib: float | None
    host_offload_gib: float  # pinned host memory for offloaded weights, every card together
    host_swap_gib: float  # the swap the engine checks against the host, every card together
    host_available_gib: float | None
    host_total_gib: float | None
    host_provenance: str | None  # "measured" (/proc/meminfo) or "simulated" (emulated host)


class V1Baseline(Record):
    """What the engine's own profiling gave at the pre-run util (None: it did not profile)."""

    util: float | None
    kv_tokens: int | None
    kv_tokens_gain: float | None  # pinned KV tokens / profiled ones
    # What the engine's log suggested after profiling (vLLM's `--kv-cache-memory=`): bytes to
    # fit the requested util, and to fill the device; shown beside ours, never adopted.
    advised_kv_bytes: int | None = None
    advised_full_kv_bytes: int | None = None


class V1Budget(Record):
    """The pinned KV from the sampled device peak; `lines` are the printed sums."""

    device_total_mib: int
    device_peak_mib: int
    held_kv_mib: float
    non_kv_peak_mib: float
    margin_mib: int
    pinned_kv_mib: int
    lines: list[str]


class V1Images(Record):
    """A vision-language model's images: the flags, the worst case, vLLM's encoder budget."""

    image_limit: int
    image_limit_source: str  # "--limit-mm-per-prompt" or "vLLM's default"
    max_image_px: list[int]  # the largest image, [width, height]
    tokens_per_image: int  # of the largest image
    worst_case_images: int  # images of the worst-case request
    worst_case_image_px: list[int]
    encoder_budget_tokens: int | None  # as the engine's log says; None: it did not say
    encoder_profiled_images: int | None
    mm_processor_cache_gb: float | None  # as passed (host memory); None: vLLM's default
    flags: list[str]  # the server flags these add


class V1Soak(Record):
    """The soak of the final configuration's validation: device MiB (the worst device), as
    sampled (`pretuner.tune.pinned.soak`)."""

    launch: int
    requests_asked: int | None
    minutes_asked: float | None
    requests: int  # answered
    before_mib: int  # after the worst-case burst, before the soak
    half_mib: int  # after the soak's first half
    after_mib: int  # after the soak
    after_reset_mib: int | None  # after POST /reset_mm_cache (None: not sampled)
    reset_status: int | None  # its HTTP status (404: not served; vLLM needs dev mode)
    growth_mib: int  # after - before
    reset_gave_back_mib: int | None  # after - after reset
    second_half_mib: int  # what the second half still added
    held_back_mib: int  # kept free for more growth: HOLD_DOUBLINGS x the second half's
    peak_before_mib: int  # the worst case before the soak
    peak_after_mib: int | None  # the worst case again, after the soak
    settled: bool | None = None  # the second half added at most a quarter of the growth
    # The growth rate (`tune.pinned.soak.soak_rate`): the least-squares slope of the soak's
    # device samples, derived; None: not measurable. "upper bound": too short to tell.
    rate_mib_per_h: float | None = None
    rate_bound: Literal["fit", "upper bound", "not measurable"] = "not measurable"
    rate_samples: int = 0
    rate_span_s: float = 0.0
    headroom_mib: int | None = None  # device total - after_mib
    exhaustion_h: float | None = None  # headroom / rate (None: no growth, or no rate)

    def rate_line(self, tag: str) -> str:
        """The rate and the time to exhaustion in words; `tag`: what the samples are."""
        seen = (f"{self.rate_samples} device samples over {self.rate_span_s:,.0f} s of soak, "
                f"{tag}; host RSS of the engine's processes not sampled")
        if self.rate_mib_per_h is None:
            return f"growth rate: not measurable ({seen}; at least 3 samples are needed)"
        short = self.rate_bound == "upper bound"
        rate = (f"growth rate {'at most ' if short else ''}{self.rate_mib_per_h:,.1f} MiB/h "
                f"(derived: least-squares slope of {seen}"
                + ("; too short to tell: under 10 min or 30 samples)" if short else ")"))
        room = (f"headroom {self.headroom_mib:,} MiB (device total - the soak's last level, "
                f"both {tag})")
        h = self.exhaustion_h
        if h is None:
            return f"{rate}; {room}: not used up at that rate (no growth)"
        when = f"{h:,.1f} h" if h >= 1 else f"{h * 60:,.1f} min"
        return (f"{rate}; {room}: used up in {'at least ' if short else ''}{when} at that "
                "rate (derived)")


class V1Memory(Record):
    """The final configuration's device at its worst moment, as parts that sum to the device
    (MiB): `lines` are report.md's rows, `free_mib` the remainder (computed, never read)."""

    launch: int
    device_total_mib: int
    kv_held_mib: float  # the KV the engine allocated (its token count x bytes per token)
    non_kv_peak_mib: float  # the worst case before any soak - the KV held
    soak_growth_mib: int  # how much higher the worst case peaked after the soak (>= 0)
    held_back_mib: int  # HOLD_DOUBLINGS x the soak's second-half growth, kept free for more
    pinned_kv_mib: float  # --kv-cache-memory-bytes
    free_mib: float  # device total - the four parts above
    lines: list[str]


class PinnedDerivation(Record):
    """The V1 method: a pre-run with the production shape, the device sampled, the KV pinned."""

    method: Literal["v1-pinned-kv"] = "v1-pinned-kv"
    measured_by: str
    kv_cache_memory_bytes: int | None
    baseline: V1Baseline
    budget: V1Budget | None  # None: no device memory sampled, the profiled KV pinned
    memory: V1Memory | None = None  # the final configuration's device at its worst
    images: V1Images | None = None  # a vision-language model's images
    soak: V1Soak | None = None
    weights: V1Weights | None = None
    speed: V1Speed | None = None  # the final configuration's validation
    min_tokens_per_s: float | None = None  # --min-tokens-per-s asked


Derivation = Annotated[R01Derivation | PinnedDerivation, Field(discriminator="method")]


# -- the run ------------------------------------------------------------------------------------


class ModelFolder(Record):
    """A local model folder's identity (`pretuner.models.FolderIdentity`)."""

    path: str  # absolute: what the startup files serve
    config_sha256: str
    hub_id: str | None  # the hub model its config.json names, used only for registry names


class _RunHead(Record):
    """The fields every report.json starts with, succeeded or failed, in this order."""

    schema_version: int = SCHEMA_VERSION
    pretuner_version: str
    run_id: str
    engine: str
    engine_version: str | None
    engine_reason: str
    # What the engine ran on (pretuner.engines.stack: torch, cuda, cann, mindspore...);
    # None: not recorded (the emulated engine, a --serve-cmd's container, an older run)
    stack: dict[str, str] | None = None
    device_name: str | None = None  # the first device, as its tool names it
    engine_python: str | None = None  # an engine in its own venv: its interpreter (the guard's)
    simulated: bool
    provenance: Provenance  # what every figure the engine (or its emulator) produced is
    model: str
    model_arg: str
    model_folder: ModelFolder | None = None  # a registry model's report.json has no such key
    card_gib: int
    card_source: str
    device_kind: str  # "cpu": --card is a memory budget, not a device
    tp: int
    pp: int
    nodes: int
    weights_format: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    validated: bool
    launches: int
    steps: list[Step]
    decisions: list[Decision]
    retune_command: list[str]  # `pretuner run` with this run's options: the same run again

    @model_serializer(mode="wrap")
    def _omit_no_cluster(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A single-node run's report.json has no `cluster` key at all (not a null), a
        registry model's no `model_folder`, one proven on one boot no `boots`."""
        data: dict[str, Any] = handler(self)
        for key in ("cluster", "model_folder", "boots"):
            if getattr(self, key, None) is None:
                data.pop(key, None)
        return data


class ProofPeak(Record):
    """The phase of the final configuration's proof that set its device peak (the verdict
    names it; every phase's own peak is in its step's `device_peaks_mib`)."""

    launch: int
    phase: str  # the sampled phase ("burst")
    what: str  # that phase in words
    peak_mib: int  # the worst device's peak
    device_reader: str | None


class Boots(Record):
    """The final configuration proven on several boots (--repeat-proof): each boot's proof peak
    (MiB, the worst device or rank) and their spread (max - min), which the headroom keeps."""

    peaks_mib: list[int]
    spread_mib: int
    headroom_mib: int  # what the highest peak left: device total (r0.1: the pool) - peak
    floor_mib: int  # the least headroom the run keeps (pretuner.noise)


class RunReport(_RunHead):
    """report.json of a run that finished (validated or not)."""

    final: Final
    derivation: Derivation
    asked: Asked
    given_up: list[str]  # "max_model_len 11,264 < 16,384 asked": exit 9 when not empty
    peak: ProofPeak | None = None  # None: not validated, or no device was sampled
    boots: Boots | None = None  # --repeat-proof N > 1
    cluster: Cluster | None = None  # multi-node via Ray only; last, as report.json has it


class FailureReport(_RunHead):
    """report.json of a run a `PretunerError` stopped: why, the fix, what was done."""

    method: Method
    error: str
    hint: str | None
    exit_code: int
    error_type: str
    server_log: str | None
    cluster: Cluster | None = None


AnyReport = RunReport | FailureReport


def read_report(path: Path) -> AnyReport:
    """A run folder's report.json (or the file itself) as its record."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:  # a record of hundreds of launches stays far under this
        data = json.loads(read_bounded(path, 16 * MAX_INPUT_BYTES))
    except BadInputError as err:
        err.hint = "pass a run folder that has a report.json"
        raise
    except (ValueError, RecursionError) as err:
        raise BadInputError(f"{str(path)!r} is not valid JSON: {err}",
                            hint="the file is damaged: run again, or restore it") from None
    try:
        return report_of(data)
    except ValidationError as err:  # the first problem, on one line
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadInputError(f"{str(path)!r} is not a pretuner run record: {where}: "
                            f"{first['msg']}", hint="pass a run folder written by `pretuner "
                            "run`") from None
    except (KeyError, TypeError, ValueError) as err:
        raise BadInputError(f"{str(path)!r} is not a pretuner run record: {err}",
                            hint="pass a run folder written by `pretuner run`") from None


def report_of(data: Any) -> AnyReport:
    """report.json's data as its record; an earlier pretuner's (schema 1) is upgraded."""
    if not isinstance(data, dict):
        raise ValueError("report.json is not a JSON object")
    if data.get("schema_version", 1) < 2:
        data = upgrade(data)
    return (FailureReport if "error" in data else RunReport).model_validate(data)


# -- the words every reader of a record says the same way ----------------------------------------


def device_words(rep: AnyReport) -> str:
    """The devices as the run knew them: a real device's total as its reader measured it (a CPU
    has none), else --card in the engine's words."""
    d = rep.derivation if isinstance(rep, RunReport) else None
    if (rep.device_kind != "cpu" and not rep.simulated and isinstance(d, PinnedDerivation)
            and d.budget is not None):
        return f"{d.budget.device_total_mib:,} MiB device(s) (measured)"
    return engine_class(rep.engine).card_words(rep.card_gib, rep.card_source, rep.device_kind)


def kv_words(rep: RunReport) -> str:
    """The KV cache per card, in GiB and tokens, and how each figure came about."""
    f, d = rep.final, rep.derivation
    how = ("derived" if isinstance(d, R01Derivation) else
           f"--kv-cache-memory-bytes {d.kv_cache_memory_bytes}, derived; tokens {rep.provenance}")
    return f"{f.kv_gib:.2f} GiB = {f.kv_tokens or 0:,} tokens ({how})"


def boots_words(rep: RunReport) -> str | None:
    """Each boot's proof peak and their spread (--repeat-proof), with what the headroom kept."""
    b = rep.boots
    if b is None:
        return None
    return (f"proven on {len(b.peaks_mib)} boots: peaks "
            + ", ".join(f"{p:,}" for p in b.peaks_mib)
            + f" MiB ({rep.provenance}), spread {b.spread_mib:,} MiB; headroom kept "
            f"{b.headroom_mib:,} MiB, at least {b.floor_mib:,} MiB "
            "(pretuner explain --repeat-proof)")
