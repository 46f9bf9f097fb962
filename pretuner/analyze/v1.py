"""`analyze` on a V1 engine's log (vLLM >= 0.8 on CUDA and CPU, vllm-ascend, vLLM-MindSpore >=
0.3): what the run shows, and the `--kv-cache-memory-bytes` to try next.

With a device memory series of the run and the device total, the measured non-KV peak says
what the card could hold (`pretuner.pinned.derive_pinned`). Without one, only what the log
proves: a run that was ready holds its KV cache (pinning it keeps it), and a run that ran out
of memory needs less KV by the allocation that failed plus the margin (`back_off_bytes`).
Either way the figure is a candidate until a run under the worst-case request proves it.

Pure: lines and texts in, a typed result out; the caller reads the files.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pretuner.analyze.v1_inputs import (
    DevicePeak,
    V1Run,
)
from pretuner.analyze.v1_result import HELD_FROM_TOKENS, BackOff, Suggestion, V1Analysis
from pretuner.engines.v1_log import V1Log
from pretuner.errors import BadInputError, NothingFoundError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models.spec import ModelSpec
from pretuner.pinned import (
    MARGIN_FLOOR_MIB,
    PinnedBudget,
    back_off_bytes,
    derive_pinned,
    kv_held_bytes,
    kv_tokens_for,
    margin_mib,
)
from pretuner.units import GIB, MIB

# A KV figure from the log and tokens x bytes/token from --model further apart than this
# means the model, TP or KV dtype given is not the one that ran (the log prints 1-2 decimals).
MISMATCH_SHARE = 0.02


@dataclass(frozen=True, slots=True)
class V1Config:
    run: V1Run
    series: DevicePeak | None = None
    card_total_mib: int | None = None  # the device total, MiB as NVML counts it
    model: ModelSpec | None = None
    tp: int | None = None  # default: the log's tensor_parallel_size, else 1
    pp: int | None = None  # default: the log's pipeline_parallel_size, else 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16


def analyze_v1(cfg: V1Config) -> V1Analysis:
    """What the log shows, and the pinned KV that the measurements support."""
    run, log = cfg.run, cfg.run.log
    if log.kv_gib is None and log.kv_tokens is None and not log.failed_oom \
            and not log.no_kv_memory and log.refused_free_gib is None:
        raise NothingFoundError(
            f"the V1 log {', '.join(run.files)} shows no KV cache size and no failure",
            hint="pass the whole server log from its start (with the EngineCore/Worker lines "
            "at INFO level) up to the first requests",
        )
    warnings: list[str] = []
    notes: list[str] = []
    prov: dict[str, str] = {}
    for key, value in (("weights_gib", log.weights_gib), ("kv_gib", log.kv_gib),
                       ("kv_tokens", log.kv_tokens), ("max_concurrency", log.max_concurrency),
                       ("graphs_gib", log.graphs_gib), ("oom_alloc_bytes", log.oom_alloc_bytes),
                       ("max_model_len", run.max_model_len),
                       ("max_num_batched_tokens", log.max_num_batched_tokens)):
        if value is not None:
            prov[key] = "measured (log)"
    tp = cfg.tp if cfg.tp is not None else run.tp or 1
    pp = cfg.pp if cfg.pp is not None else run.pp or 1
    kv_mode, kv_in_log = _kv_in_log(run)
    if kv_in_log is not None:
        prov["kv_in_log_bytes"] = ("measured (log: the echoed --kv-cache-memory-bytes)"
                                   if run.pinned_kv_bytes is not None else "measured (log, GiB)")
    bpt, bpt_exact, bpt_source = _bytes_per_token(cfg, run, tp, pp, warnings)
    if bpt_source is not None:
        prov["kv_bytes_per_token"] = bpt_source
    held, held_source = _held_kv(log, kv_in_log, bpt, bpt_exact)
    if held_source is not None:
        prov["held_kv_bytes"] = held_source
    total_mib, total_source = _total(cfg, warnings)
    if total_mib is not None and cfg.series is not None and cfg.series.peak_mib > total_mib:
        raise BadInputError(
            f"the memory series peak {cfg.series.peak_mib:,} MiB is above the device total "
            f"{total_mib:,} MiB",
            hint="pass the device's own total as --card-total-mib (NVML memory.total)",
        )
    if cfg.series is not None and total_mib is None:
        raise BadInputError(
            f"--memory-series {cfg.series.file!r} gives the peak but not the device total",
            hint="pass --card-total-mib (NVML's memory.total, e.g. `nvidia-smi "
            "--query-gpu=memory.total --format=csv,noheader,nounits`: 81559 on an H100 80GB)",
        )
    if total_source is not None:
        prov["total_mib"] = total_source
    if cfg.series is not None:
        prov["device_peak_mib"] = f"measured ({cfg.series.source} series {cfg.series.file})"
        if len(cfg.series.runs) > 1:
            warnings.append(f"the memory series holds {len(cfg.series.runs)} runs "
                            f"({', '.join(cfg.series.runs)}): its peak is the highest of them; "
                            "pass the series of the run that wrote this log")
    oom_phase = _oom_phase(run)
    outcome = _outcome(run, oom_phase)

    budget: PinnedBudget | None = None
    back_off: BackOff | None = None
    suggestion: Suggestion | None = None
    kv_bytes: int | None = None
    basis: str | None = None
    device_oom = _device_oom(log)
    if device_oom and kv_in_log is not None:
        if cfg.series is not None:
            warnings.append(
                f"the memory series was not used: the run ran out of memory, so its peak "
                f"({cfg.series.peak_mib:,} MiB) is less than what the run needed"
            )
        margin_total, margin_basis = _margin_total(total_mib, log)
        back = back_off_bytes(kv_in_log, log.oom_alloc_bytes, margin_total)  # None: the margin
        back_off = BackOff(kv_in_log, log.oom_alloc_bytes, margin_mib(margin_total),
                           margin_basis, back)
        prov["back_off"] = "derived"
        if back > 0:
            kv_bytes, basis = back, "back-off"
        else:
            warnings.append(
                f"the failed allocation ({(log.oom_alloc_bytes or 0) / GIB:.2f} GiB) and the "
                f"margin leave no KV cache of the {kv_in_log / GIB:.2f} GiB the run asked for: "
                "give the engine more memory (or more devices)"
            )
        if oom_phase == "prefill" and log.max_num_batched_tokens:
            notes.append(
                f"or keep the KV and lower --max-num-batched-tokens "
                f"({log.max_num_batched_tokens:,} in this log): a prefill step's activations "
                "grow with it"
            )
    elif device_oom:
        warnings.append(f"the run ran out of memory ({log.oom_text}) before it printed its KV "
                        "cache size: nothing to back off from; pin a --kv-cache-memory-bytes "
                        "well below the free memory and measure again")
    elif log.ready and held is not None:
        if cfg.series is not None and total_mib is not None:
            budget = derive_pinned(total_mib, cfg.series.peak_mib, held, cfg.series.source)
            _check_budget(budget, log, warnings)
            kv_bytes, basis = budget.kv_bytes, "measured peak"
            prov["budget"] = "derived"
        else:
            warnings.append(
                "THE DEVICE PEAK WAS NOT MEASURED: what the card could hold beyond this run is "
                "unknown; pass --memory-series (an NVML series or repeated nvidia-smi CSV of "
                "this run) and --card-total-mib to derive it"
            )
            if kv_mode == "pinned" and kv_in_log is not None:
                kv_bytes, basis = kv_in_log, "log: ready run, pinned"
            else:
                # tokens x bytes/token is whole blocks: pinning it keeps every token; a GiB
                # figure from the log is rounded, so round it down
                exact = held_source == HELD_FROM_TOKENS
                kv_bytes = held if exact else held // MIB * MIB
                basis = "log: ready run, profiled KV pinned"
                notes.append("pinning the KV that profiling gave keeps this run's cache, and "
                             "a later start with less free memory cannot shrink it")
    elif not (log.ready or log.start_failed or log.no_kv_memory or log.estimated_max_len
              or log.refused_free_gib is not None):
        warnings.append("the log shows neither the server ready nor an out-of-memory error: "
                        "was it cut short? pass the whole log")
    if log.no_kv_memory:
        warnings.append("the engine found no memory for the KV cache blocks: the weights and "
                        "activations alone fill the device; use more devices (TP) or a "
                        "smaller model")
    if log.estimated_max_len is not None:
        notes.append(f"the KV cache holds at most {log.estimated_max_len:,} tokens of one "
                     "sequence: lower --max-model-len to it, or give the KV cache more memory")
    if log.refused_free_gib is not None:
        warnings.append(
            f"the engine refused to start: only {log.refused_free_gib:.2f} GiB was free and "
            "--gpu-memory-utilization asked more; lower it, or pin --kv-cache-memory-bytes"
        )
    if kv_bytes is not None and basis is not None:
        suggestion = _suggest(kv_bytes, basis, log, held, bpt, bpt_exact, cfg.block_size,
                              run.max_model_len)
    return V1Analysis(
        files=run.files,
        outcome=outcome,
        oom_phase=oom_phase,
        log=log,
        kv_mode=kv_mode,
        kv_in_log_bytes=kv_in_log,
        max_model_len=run.max_model_len,
        tp=tp,
        pp=pp,
        bytes_per_token=bpt,
        bytes_per_token_source=bpt_source,
        held_kv_bytes=held,
        held_kv_source=held_source,
        series=cfg.series,
        total_mib=total_mib,
        total_source=total_source,
        budget=budget,
        back_off=back_off,
        suggestion=suggestion,
        warnings=tuple(warnings),
        notes=tuple(notes),
        next_step=_next_step(cfg, run, suggestion, tp),
        provenance=prov,
    )


def _kv_in_log(run: V1Run) -> tuple[str | None, int | None]:
    """The KV cache the run asked for: the pinned bytes (exact when the arguments were echoed),
    else the KV that profiling gave it."""
    log = run.log
    if run.pinned_kv_bytes is not None:
        return "pinned", run.pinned_kv_bytes
    if log.pinned_kv_gib is not None:
        return "pinned", int(log.pinned_kv_gib * GIB)
    if log.available_kv_gib is not None:
        return "profiled", int(log.available_kv_gib * GIB)
    return None, None


def _bytes_per_token(
    cfg: V1Config, run: V1Run, tp: int, pp: int, warnings: list[str]
) -> tuple[int | None, bool, str | None]:
    """KV bytes per token on one device, whether it is exact, and where it comes from."""
    log = run.log
    _, kv_in_log = _kv_in_log(run)
    if cfg.model is not None:
        bpt = kv_bytes_per_token(cfg.model, tp=tp, pp=pp, kv_dtype=cfg.kv_cache_dtype)
        if log.kv_tokens and kv_in_log:
            share = log.kv_tokens * bpt / kv_in_log - 1
            if abs(share) > MISMATCH_SHARE:
                warnings.append(
                    f"--model {cfg.model.name} at TP{tp} gives {bpt:,} B/token, so the log's "
                    f"{log.kv_tokens:,} tokens would be {log.kv_tokens * bpt / GIB:.2f} GiB, "
                    f"{share:+.1%} off the log's {kv_in_log / GIB:.2f} GiB: check --model, "
                    "--tp and --kv-cache-dtype"
                )
        return bpt, True, (f"derived from --model {cfg.model.name} (TP{tp}, PP{pp}, "
                           f"KV dtype {cfg.kv_cache_dtype})")
    if log.kv_tokens and kv_in_log:
        return (round(kv_in_log / log.kv_tokens), False,
                "derived from the log: KV bytes / KV tokens (approximate: pass --model for the "
                "exact figure)")
    return None, False, None


def _held_kv(
    log: V1Log, kv_in_log: int | None, bpt: int | None, exact: bool
) -> tuple[int | None, str | None]:
    """The KV cache the run held, and where the figure comes from."""
    if exact and bpt is not None and log.kv_tokens is not None:
        return kv_held_bytes(log.kv_tokens, bpt, None), HELD_FROM_TOKENS
    if kv_in_log is not None:
        return kv_in_log, "measured (log: the KV size it printed)"
    return None, None


def _total(cfg: V1Config, warnings: list[str]) -> tuple[int | None, str | None]:
    series = cfg.series
    measured = series.total_mib if series is not None else None
    if cfg.card_total_mib is not None:
        if measured is not None and measured != cfg.card_total_mib:
            warnings.append(f"the memory series says the device total is {measured:,} MiB; "
                            f"using the given --card-total-mib {cfg.card_total_mib:,}")
        return cfg.card_total_mib, "given (--card-total-mib)"
    if series is not None and measured is not None:
        return measured, f"measured ({series.source} series' device total)"
    return None, None


def _margin_total(total_mib: int | None, log: V1Log) -> tuple[int, str]:
    """The device size the margin is a share of, and how it was chosen."""
    if total_mib is not None:
        return total_mib, "0.5 % of the device total"
    if log.initial_free_gib is not None:
        return (int(log.initial_free_gib * 1024),
                f"0.5 % of the initial free memory {log.initial_free_gib:.2f} GiB in the log; "
                "pass --card-total-mib for the device's")
    return 0, f"the floor {MARGIN_FLOOR_MIB} MiB; pass --card-total-mib for 0.5 % of the device"


def _device_oom(log: V1Log) -> bool:
    """An allocation the device refused (not the engine's own "does not fit" checks)."""
    if log.oom_alloc_bytes is not None:
        return True
    return log.oom_text is not None and not log.no_kv_memory and log.estimated_max_len is None


def _oom_phase(run: V1Run) -> str | None:
    log = run.log
    if not _device_oom(log):
        return None
    if log.ready:
        return "prefill" if run.prefill_died else "serving"
    return "start-up"


def _outcome(run: V1Run, oom_phase: str | None) -> str:
    log = run.log
    oom = f"out of memory ({log.oom_text})" if log.oom_text else "out of memory"
    if oom_phase == "start-up":
        when = " after the KV cache was sized" if log.kv_tokens is not None else ""
        return f"never ready: {oom} at start-up{when}"
    if oom_phase == "prefill":
        return (f"ready, then the engine died on a prefill step: {oom}; every request failed "
                "from then on")
    if oom_phase == "serving":
        dead = "the engine died" if log.engine_dead else "a request failed"
        return f"ready, then {dead} while serving: {oom}"
    if log.refused_free_gib is not None:
        return "never ready: the engine refused the --gpu-memory-utilization asked"
    if log.no_kv_memory:
        return "never ready: no memory left for the KV cache blocks"
    if log.estimated_max_len is not None:
        return (f"never ready: one max_model_len sequence does not fit the KV cache (at most "
                f"{log.estimated_max_len:,} tokens)")
    if log.start_failed:
        return "never ready: the engine failed to start (no out-of-memory error in the log)"
    if log.engine_dead:
        return "ready, then the engine died while serving (no out-of-memory error in the log)"
    if log.ready:
        return "ready; no out-of-memory error in the log"
    return "not ready in this log (cut short?)"


def _check_budget(budget: PinnedBudget, log: V1Log, warnings: list[str]) -> None:
    if budget.non_kv_mib <= 0:
        raise BadInputError(
            f"the memory series peak {budget.peak_mib:,} MiB is below the KV cache the log held "
            f"({budget.held_kv_mib:,.1f} MiB): the series is not of this run",
            hint="pass the series sampled during the run that wrote this log",
        )
    if log.weights_gib is not None and budget.non_kv_mib < log.weights_gib * 1024:
        raise BadInputError(
            f"the non-KV peak from the memory series ({budget.non_kv_mib:,.1f} MiB) is below "
            f"the weights the log loaded ({log.weights_gib:.2f} GiB): the series is not of "
            "this run",
            hint="pass the series sampled during the run that wrote this log",
        )
    if budget.kv_mib == 0:
        warnings.append("the measured non-KV peak leaves no room for a KV cache on this device")


def _suggest(
    kv_bytes: int, basis: str, log: V1Log, held: int | None, bpt: int | None, exact: bool,
    block_size: int, max_model_len: int | None,
) -> Suggestion:
    tokens = kv_tokens_for(kv_bytes, bpt, block_size) if bpt else None
    return Suggestion(
        kv_bytes=kv_bytes,
        basis=basis,
        kv_tokens=tokens,
        kv_tokens_exact=exact,
        held_kv_bytes=held,
        held_kv_tokens=log.kv_tokens,
        max_model_len=max_model_len,
    )


def _next_step(cfg: V1Config, run: V1Run, suggestion: Suggestion | None, tp: int) -> str:
    argv = ["pretuner", "run", "--engine", "vllm", "--model",
            cfg.model.name if cfg.model is not None else "MODEL"]
    if run.max_model_len is not None:
        argv += ["--max-model-len", str(run.max_model_len)]
    if run.log.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(run.log.max_num_batched_tokens)]
    if tp > 1:
        argv += ["--tp", str(tp)]
    if suggestion is None:
        return "fix what failed above, then measure on the card: " + shlex.join(argv)
    return (f"{suggestion.flag} is a candidate until a run under the worst-case request "
            "(max_model_len prompts at full concurrency) proves it; this measures and "
            f"validates the pinned KV on the card: {shlex.join(argv)}")
