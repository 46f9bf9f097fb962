"""`analyze`: the manual pre-run method applied to logs a user already has."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretuner.analyze.v1 import V1Config, analyze_v1
from pretuner.analyze.v1_inputs import read_memory_series, read_v1_run
from pretuner.analyze.v1_result import V1Analysis
from pretuner.errors import BadInputError, InfeasibleError, NothingFoundError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.logscan import RankSummary, ScanResult, scan_paths
from pretuner.logscan.files import iter_log_files
from pretuner.logscan.summary import truncated_json
from pretuner.method import (
    DEFAULT_HEADROOM_GIB,
    Derivation,
    PrerunInputs,
    derive,
    per_sequence_bytes,
)
from pretuner.models.spec import ModelSpec
from pretuner.units import GIB, MIB

NO_PEAK_HINT = (
    "likely causes: the server ran without GLOG_v=1 (MindSpore prints the pool dump at INFO "
    "level only), it was killed with SIGKILL or crashed before exit (the dump is printed at "
    "teardown), or this is not the MindSpore log (with GLOG_logtostderr=0 look in "
    "GLOG_log_dir/rank_*/logs/)"
)


@dataclass(frozen=True, slots=True)
class AnalyzeConfig:
    paths: tuple[Path, ...]
    model: ModelSpec | None  # the r0.1 method needs it; a V1 log can derive bytes/token
    card_gib: int | None = None  # default: the card size the log printed
    # The r0.1 pre-run's settings: a log does not say them; None: the method's defaults, said
    # as assumed in every output (`ASSUMED`).
    util: float | None = None
    model_use_gib: int | None = None
    max_model_len: int | None = None
    tp: int | None = None  # default: the number of ranks found in the logs
    pp: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    max_num_batched_tokens: int | None = None
    memory_series: Path | None = None  # V1: an NVML series or nvidia-smi CSV of the run
    card_total_mib: int | None = None  # V1: the device total (default: the nvidia-smi CSV's)


# The seed's pre-run settings, used where the user gave none: (flag, field, value).
ASSUMED = (("--util", "util", 0.9), ("--model-use-gb", "model_use_gib", 50),
           ("--max-model-len", "max_model_len", 16384))


def assumed_settings(cfg: AnalyzeConfig) -> dict[str, float]:
    """The pre-run settings not given, as `flag -> the method's default` it takes for them."""
    return {flag: value for flag, name, value in ASSUMED if getattr(cfg, name) is None}


def prerun_settings(cfg: AnalyzeConfig) -> dict[str, float]:
    """The pre-run's util, model-use and max_model_len: as given, else the method's."""
    return {name: value if getattr(cfg, name) is None else getattr(cfg, name)
            for _, name, value in ASSUMED}


def assumed_line(assumed: dict[str, float]) -> str | None:
    if not assumed:
        return None
    given = ", ".join(f"{flag} {value:g}" for flag, value in assumed.items())
    return (f"assumed, not given: {given} (the method's pre-run; the log does not say them): "
            "if the pre-run used others, pass them, the derivation depends on them")


@dataclass(frozen=True, slots=True)
class AnalyzeResult:
    model: str
    scan: ScanResult
    worst: RankSummary  # the rank whose peak decides
    card_gib: int
    card_source: str  # "given" or "measured"
    tp: int
    tp_source: str  # "given" or "derived" (ranks with a pool dump, truncated ones included)
    kv_bytes_per_token: int
    derivation: Derivation
    assumed: dict[str, float] = field(default_factory=dict)  # flag -> value not given

    def to_json(self) -> dict[str, Any]:
        d = self.derivation
        worst = self.worst
        return {
            "model": self.model,
            "card_gib": self.card_gib,
            "card_source": self.card_source,
            "tp": self.tp,
            "tp_source": self.tp_source,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "actual_peak_mib": worst.actual_peak_mib,
            "worst_rank": {
                "rank": worst.rank,
                "pid": worst.pid,
                "file": worst.file,
                "line": worst.line,
                "actual_peak_mib": worst.actual_peak_mib,
            },
            "ranks": [
                {
                    "rank": r.rank,
                    "pid": r.pid,
                    "actual_peak_mib": r.actual_peak_mib,
                    "truncated_dumps": r.truncated_dumps,
                    "file": r.file,
                }
                for r in dumped_ranks(self.scan)
            ],
            "truncated": [truncated_json(t) for t in self.scan.truncated],
            "kv_prerun_gib": round(d.kv_prerun_gib, 4),
            "weights_act_gib": round(d.weights_act_gib, 4),
            "max_kv_gib": round(d.max_kv_gib, 4),
            "max_kv_tokens": d.max_kv_tokens,
            "max_num_seqs_method": d.max_num_seqs_method,
            "max_num_seqs": d.final.max_num_seqs,
            "headroom_gib": d.inputs.headroom_gib,
            "headroom_total_gib": round(d.headroom_total_gib, 4),
            "model_use_exact_gib": round(d.model_use_exact_gib, 4),
            "rounding_cost_gib": round(d.rounding_cost_bytes / GIB, 4),
            "final_kv_gib": round(d.final.kv_bytes / GIB, 4),
            "final_kv_tokens": d.final.kv_tokens,
            "env": d.final.env,
            "flags": d.final.flags,
            "assumed": self.assumed,
            "provenance": {
                "prerun_settings": "assumed" if self.assumed else "given",
                "actual_peak_mib": (
                    "measured, without the truncated dumps" if self.scan.truncated else "measured"
                ),
                "derivation": "derived",
            },
        }


def dumped_ranks(scan: ScanResult) -> list[RankSummary]:
    """The ranks that wrote a pool dump, complete or truncated: each is one rank of the TP."""
    return [r for r in scan.ranks if r.actual_peak_mib is not None or r.truncated_dumps]


def analyze_logs(cfg: AnalyzeConfig) -> AnalyzeResult | V1Analysis:
    """The analysis the logs call for: a V1 engine's log (its KV lines and no MindSpore pool
    dump) gets `analyze_v1`, any other the r0.1 method."""
    _check_paths(cfg.paths)
    if cfg.memory_series is not None and not cfg.memory_series.is_file():
        raise BadInputError(
            f"--memory-series {str(cfg.memory_series)!r} is not a file",
            hint="pass the NVML series (TSV) or nvidia-smi CSV sampled during the run",
        )
    scan = scan_paths(cfg.paths)
    if not dumped_ranks(scan):
        files = tuple(f for f, problem in iter_log_files(cfg.paths) if problem is None)
        run = read_v1_run(_log_lines(files), files)
        if run.is_v1:
            series = None
            if cfg.memory_series is not None:
                series = read_memory_series(_series_text(cfg.memory_series),
                                            str(cfg.memory_series))
            return analyze_v1(V1Config(
                run=run, series=series, card_total_mib=cfg.card_total_mib, model=cfg.model,
                # --pp defaults to 1: a V1 log that says otherwise is believed
                tp=cfg.tp, pp=cfg.pp if cfg.pp != 1 else None, kv_cache_dtype=cfg.kv_cache_dtype,
                block_size=cfg.block_size,
            ))
    return _method(cfg, scan)


def _check_paths(paths: tuple[Path, ...]) -> None:
    for path in paths:
        if not path.exists():
            raise BadInputError(f"log path {str(path)!r} does not exist", hint="check the path")


def _log_lines(files: tuple[str, ...]) -> Iterator[str]:
    """Every line of the files in order, gzip or plain, streamed."""
    for file in files:
        try:
            with open(file, "rb") as probe:
                gz = probe.read(2) == b"\x1f\x8b"
            opener = gzip.open if gz else open
            with opener(file, "rt", encoding="utf-8", errors="replace") as stream:
                yield from stream
        except EOFError:  # a gzip cut short: its lines so far are what there is
            continue
        except OSError as err:
            raise BadInputError(
                f"log file {file!r} cannot be read: {err}", hint="check its permissions"
            ) from None


def _series_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise BadInputError(
            f"--memory-series {str(path)!r} cannot be read: {err.strerror or err}",
            hint="pass the NVML series (TSV) or nvidia-smi CSV sampled during the run",
        ) from None


def analyze(cfg: AnalyzeConfig) -> AnalyzeResult:
    """Scan the logs, take the worst rank's peak, and apply the method."""
    _check_paths(cfg.paths)
    return _method(cfg, scan_paths(cfg.paths))


def _method(cfg: AnalyzeConfig, scan: ScanResult) -> AnalyzeResult:
    """The r0.1 method on scanned logs."""
    if cfg.model is None:
        raise BadInputError(
            "--model is required for a MindSpore r0.1 log (the method needs the model's KV "
            "bytes per token)",
            hint="pass --model NAME (see `pretuner models`) or a local HF folder",
        )
    if scan.oom:
        first = scan.oom[0]
        raise InfeasibleError(
            f"the log records {scan.oom_total} out-of-memory event(s), first {first.kind.value} "
            f"at {first.file}:{first.line}: the pre-run did not complete, so its peak is not "
            "the requirement",
            hint="follow the method: raise vLLM_MODEL_MEMORY_USE_GB, lower --util if the device "
            "refused, or shorten --max-model-len, then pre-run again (pretuner run does this)",
        )
    worst = scan.worst
    if (worst is None or worst.actual_peak_mib is None) and scan.truncated:
        raise NothingFoundError(
            f"no complete pool dump in {', '.join(str(p) for p in cfg.paths)}: "
            f"{scan.truncated_total} truncated, first: {scan.truncated[0].describe()}",
            hint="stop the server gracefully (SIGTERM to its process group, then wait for it to "
            "exit) so that every rank finishes its dump, and analyze that run's logs",
        )
    if worst is None or worst.actual_peak_mib is None:
        raise NothingFoundError(
            f"no `actual peak used` line in {', '.join(str(p) for p in cfg.paths)}",
            hint=NO_PEAK_HINT,
        )
    above = [t for t in scan.truncated if (t.peak_used_mib or 0) > worst.actual_peak_mib]
    if above:
        raise InfeasibleError(
            f"the worst complete pool dump says {worst.actual_peak_mib:,} MiB, but "
            f"{above[0].describe()}: the worst rank's peak is unknown and higher",
            hint="pre-run again and stop the server gracefully (SIGTERM to its process group, "
            "then wait) so that every rank finishes its dump",
        )
    if cfg.card_gib is not None:
        card, card_source = cfg.card_gib, "given"
    elif scan.card_mib:
        card, card_source = round(scan.card_mib * MIB / GIB), "measured"
    else:
        raise BadInputError(
            "the log does not say the card size", hint="pass --card (e.g. --card 64)"
        )
    if cfg.tp is not None:
        tp, tp_source = cfg.tp, "given"
    else:
        tp, tp_source = max(1, len(dumped_ranks(scan))), "derived"
    bpt = kv_bytes_per_token(cfg.model, tp=tp, pp=cfg.pp, kv_dtype=cfg.kv_cache_dtype)
    prerun = prerun_settings(cfg)
    derivation = derive(
        PrerunInputs(
            card_gib=card,
            util=float(prerun["util"]),
            model_use_gib=int(prerun["model_use_gib"]),
            actual_peak_mib=worst.actual_peak_mib,
            kv_bytes_per_token=bpt,
            block_size=cfg.block_size,
            max_model_len=int(prerun["max_model_len"]),
            headroom_gib=cfg.headroom_gib,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            per_seq_bytes=per_sequence_bytes(cfg.model.vocab_size),
        )
    )
    return AnalyzeResult(
        model=cfg.model.name,
        scan=scan,
        worst=worst,
        card_gib=card,
        card_source=card_source,
        tp=tp,
        tp_source=tp_source,
        kv_bytes_per_token=bpt,
        derivation=derivation,
        assumed=assumed_settings(cfg),
    )
