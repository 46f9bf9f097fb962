"""report.json as typed records: what a run, r0.1 or V1, succeeded or failed, leaves behind.

The producers (`tune.report`, `tune.v1.report`) build these; report.json is
`record.model_dump(mode="json")`, and a report.json read back validates into the same record.
Field order is report.json's key order: presets, `pretuner script` and `--resume` read those
files, so a field is renamed or moved only together with them. Unknown keys are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

Provenance = Literal["simulated", "measured"]
# The shape of every JSON object pretuner prints or writes; raised when a key changes meaning or
# goes away (a new key does not raise it). A report.json without it predates it: version 1.
SCHEMA_VERSION = 1


class Record(BaseModel):
    """A frozen block of report.json that refuses keys it does not know."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# -- one launch (both methods) --------------------------------------------------------------


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
    requests_ok: int | None
    requests_total: int | None
    oom_text: str | None
    seconds: float | None
    overhead_s: float | None
    log: str | None


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


class V1Step(Step):
    """One launch of a V1 engine: the r0.1 fields and what the engine's log says of its KV."""

    kv_tokens: int | None
    kv_gib: float | None
    device_total_mib: int | None
    oom_alloc_bytes: int | None
    # Since issue 18: each phase's last sample, and a vision-language validation's soak.
    device_last_mib: dict[str, int] = {}
    soak_requests: int = 0
    reset_status: int | None = None
    speed: V1Speed | None = None  # validations since the small-GPU issue
    weights_gib: float | None = None  # the engine's "Model loading took": weights on the card


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


# Decisions stay dicts: each kind carries its own fields (`tp`/`pp` for a layout, the derived
# values for a derive...) next to `decision` and `reason` (r0.1) or `detail` (V1), exactly as
# the journal records them.
Decision = dict[str, Any]

# The Ray cluster stays a dict: it is `RayCollectors.info` as the journal's `cluster` event
# records it (gcs_address, nodes with node/ranks/local); pretuner.cluster owns its shape.
Cluster = dict[str, Any]


# -- r0.1 (ASCEND_TOTAL_MEMORY_GB / vLLM_MODEL_MEMORY_USE_GB) -----------------------------------


class Derivation(Record):
    """The method's figures, worst rank, rounded as report.md prints them."""

    kv_prerun_gib: float
    actual_peak_mib: int
    weights_act_gib: float
    headroom_gib: float
    headroom_total_gib: float
    rounding_cost_gib: float
    final_util_source: str


class Final(Record):
    """What production runs with."""

    env: dict[str, str]
    # Server flags by vLLM's long name (underscores): ints, a float util, bools, a dtype; which
    # flags appear depends on the run (pipeline_parallel_size only above PP1...).
    flags: dict[str, Any]
    serve_command: list[str]  # secrets redacted: serve.sh reads them from the environment


class ReportProvenance(Record):
    actual_peak_mib: Provenance
    final: Literal["derived"]


class _OmitNoCluster(Record):
    """A single-node run's report.json has no `cluster` key at all (not a null).

    The field itself is each subclass's last one: a field declared here would come first.
    """

    @model_serializer(mode="wrap")
    def _omit_no_cluster(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if getattr(self, "cluster", None) is None:
            data.pop("cluster", None)
        return data


class Asked(Record):
    """What the user asked for, beside what the run gives (`given_up` says the difference)."""

    max_model_len: int
    # V1: --max-num-seqs; r0.1: what the method derived from the pre-run before any validation
    # taught it otherwise (None: no validation ran).
    max_num_seqs: int | None


class _RunHead(_OmitNoCluster):
    """The fields every r0.1 report.json starts with, succeeded or failed, in this order."""

    schema_version: int = SCHEMA_VERSION
    pretuner_version: str
    run_id: str
    backend: str
    simulated: bool
    model: str
    model_arg: str
    card_gib: int
    card_source: str
    tp: int
    pp: int
    nodes: int
    weights_format: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    launches: int
    steps: list[Step]
    decisions: list[Decision]


class RunReport(_RunHead):
    """report.json of an r0.1 run that finished (validated or not)."""

    validated: bool
    derivation: Derivation
    final: Final
    max_kv_tokens: int
    max_kv_gib: float
    provenance: ReportProvenance
    # Since pretuner 0.1 of 2026-11-25: an earlier report.json lacks them and still reads.
    asked: Asked | None = None
    given_up: list[str] = []  # "max_model_len 11,264 < 16,384 asked": exit 9 when not empty
    retune_command: list[str] = []  # `pretuner run` with this run's options: the same run again
    cluster: Cluster | None = None  # multi-node via Ray only; last, as report.json has it


class FailureReport(_RunHead):
    """report.json of an r0.1 run a `PretunerError` stopped: why, the fix, what was done."""

    validated: Literal[False] = False
    error: str
    hint: str | None
    exit_code: int
    error_type: str
    server_log: str | None
    cluster: Cluster | None = None


# -- V1 (--kv-cache-memory-bytes) -------------------------------------------------------------


class V1Final(Record):
    """What production runs with, in the engine's own flags."""

    kv_cache_memory_bytes: int | None
    kv_cache_gib: float
    kv_tokens: int | None
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    flags: list[str]  # the server's argv after the model
    env: dict[str, str]
    notes: list[str]
    serve_command: list[str]
    engine_serve_command: list[str] | None  # a simulated run: what the real engine would run


class V1Baseline(Record):
    """What the engine's own profiling gave at the pre-run util (None: it did not profile)."""

    util: float | None
    kv_tokens: int | None
    kv_tokens_gain: float | None  # pinned KV tokens / profiled ones


class V1Derivation(Record):
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
    sampled (`pretuner.tune.v1.soak`)."""

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


class V1Report(Record):
    """report.json of a V1 run that finished (validated or not)."""

    schema_version: int = SCHEMA_VERSION
    pretuner_version: str
    run_id: str
    method: Literal["v1-pinned-kv"] = "v1-pinned-kv"
    engine: str
    engine_version: str | None
    engine_reason: str
    simulated: bool
    model: str
    model_arg: str
    card_gib: int
    device_kind: str  # "cpu": --card is a memory budget, not a device
    tp: int
    pp: int
    validated: bool
    launches: int
    measured_by: str
    provenance: Provenance
    final: V1Final
    baseline: V1Baseline
    derivation: V1Derivation | None  # None: no device memory sampled, the profiled KV pinned
    decisions: list[Decision]
    steps: list[V1Step]
    asked: Asked | None = None  # the three: an earlier report.json lacks them and still reads
    given_up: list[str] = []  # exit 9 when not empty
    retune_command: list[str] = []  # `pretuner run` with this run's options: the same run again
    # Since issue 18: a vision-language model's images and soak; every run's final memory.
    images: V1Images | None = None
    soak: V1Soak | None = None
    memory: V1Memory | None = None
    # Since the small-GPU issue (an earlier report.json lacks them and still reads):
    weights: V1Weights | None = None
    speed: V1Speed | None = None  # the final configuration's validation
    min_tokens_per_s: float | None = None  # --min-tokens-per-s asked


class V1FailureReport(Record):
    """report.json of a V1 run a `PretunerError` stopped."""

    schema_version: int = SCHEMA_VERSION
    pretuner_version: str
    run_id: str
    method: Literal["v1-pinned-kv"] = "v1-pinned-kv"
    engine: str
    engine_reason: str
    simulated: bool
    model: str
    model_arg: str
    card_gib: int
    validated: Literal[False] = False
    launches: int
    error: str
    hint: str | None
    exit_code: int
    error_type: str
    server_log: str | None
    decisions: list[Decision]
    steps: list[V1Step]
