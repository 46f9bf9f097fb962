"""The r0.1 method on logs a user already has: every rank's `actual peak used` in MindSpore's
pool dumps, and the documented pre-run method (vLLM-MindSpore's guide) applied to the worst."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pretuner.analyze import AnalyzeConfig, pick
from pretuner.derivation_text import derivation_lines, env_file_text
from pretuner.errors import BadInputError, InfeasibleError, NothingFoundError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.logscan import RankSummary, ScanResult
from pretuner.logscan.result import truncated_json
from pretuner.method import Derivation, PrerunInputs, derive, per_sequence_bytes
from pretuner.units import GIB, MIB

# The seed's pre-run settings, taken where the user gave none and said as assumed.
ASSUMED_UTIL, ASSUMED_MODEL_USE_GIB, ASSUMED_MAX_MODEL_LEN = 0.9, 50, 16384


@dataclass(frozen=True, slots=True)
class R01Analysis:
    """The worst rank's peak, and the method's derivation from it."""

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

    @property
    def assumed_line(self) -> str | None:
        if not self.assumed:
            return None
        given = ", ".join(f"{flag} {value:g}" for flag, value in self.assumed.items())
        return (f"assumed, not given: {given} (the method's pre-run; the log does not say them): "
                "if the pre-run used others, pass them, the derivation depends on them")

    def to_json(self) -> dict[str, Any]:
        d = self.derivation
        worst = self.worst
        return {
            **pick(self, "model", "card_gib", "card_source", "tp", "tp_source",
                   "kv_bytes_per_token"),
            "actual_peak_mib": worst.actual_peak_mib,
            "worst_rank": pick(worst, "rank", "pid", "file", "line", "actual_peak_mib"),
            "ranks": [pick(r, "rank", "pid", "actual_peak_mib", "truncated_dumps", "file")
                      for r in dumped_ranks(self.scan)],
            "truncated": [truncated_json(t) for t in self.scan.truncated],
            "kv_prerun_gib": round(d.kv_prerun_gib, 4),
            "weights_act_gib": round(d.weights_act_gib, 4),
            "max_kv_gib": round(d.max_kv_gib, 4),
            **pick(d, "max_kv_tokens", "max_num_seqs_method"),
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

    def text(self) -> str:
        worst = self.worst
        lines = [f"{self.model}, TP{self.tp} ({self.tp_source}), {self.kv_bytes_per_token:,} "
                 "B/token KV per card", "actual peak used per rank (measured):"]
        for rank in dumped_ranks(self.scan):
            who = f"rank {rank.rank}" if rank.rank is not None else f"pid {rank.pid}"
            mark = "  <- worst" if rank is worst else ""
            if rank.truncated_dumps:
                mark += f"  ({rank.truncated_dumps} truncated dump(s))"
            peak = "unknown" if rank.actual_peak_mib is None else f"{rank.actual_peak_mib:,} MiB"
            lines.append(f"  {who}: {peak}  ({rank.file}:{rank.line}){mark}")
        lines += [f"warning: {cut.describe()}" for cut in self.scan.truncated]
        if self.scan.truncated_omitted:
            lines.append(f"warning: {self.scan.truncated_omitted:,} more truncated dump(s), not "
                         "listed")
        if self.scan.truncated:
            lines.append(
                "warning: the worst peak above comes from the complete dumps only and may be "
                "too low; for a sure figure, pre-run again and stop the server gracefully"
            )
        lines += ["", *derivation_lines(self.derivation, card_source=self.card_source)]
        if self.assumed_line is not None:
            lines += ["", f"warning: {self.assumed_line}"]
        return "\n".join(lines)

    def out_text(self, command: str) -> str:
        return env_file_text(self.derivation.final, [
            command,
            f"model {self.model}, card {self.card_gib} GiB, TP{self.tp}; worst-rank actual "
            f"peak {self.derivation.actual_peak_bytes // MIB:,} MiB (measured)",
            *(f"warning: {cut.describe()}" for cut in self.scan.truncated),
        ])

    def json_warnings(self) -> list[str]:
        said = self.assumed_line
        return [cut.describe() for cut in self.scan.truncated] + ([] if said is None else [said])


def dumped_ranks(scan: ScanResult) -> list[RankSummary]:
    """The ranks that wrote a pool dump, complete or truncated: each is one rank of the TP."""
    return [r for r in scan.ranks if r.actual_peak_mib is not None or r.truncated_dumps]


def analyze_r01(cfg: AnalyzeConfig, scan: ScanResult) -> R01Analysis:
    """Take the worst rank's peak and apply the method."""
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
            hint="likely causes: the server ran without GLOG_v=1 (MindSpore prints the pool dump "
            "at INFO level only), it was killed with SIGKILL or crashed before exit (the dump is "
            "printed at teardown), or this is not the MindSpore log (with GLOG_logtostderr=0 look "
            "in GLOG_log_dir/rank_*/logs/)",
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
    bpt = kv_bytes_per_token(cfg.model, tp=tp, pp=cfg.pp or 1, kv_dtype=cfg.kv_cache_dtype)
    util = ASSUMED_UTIL if cfg.util is None else cfg.util
    model_use = ASSUMED_MODEL_USE_GIB if cfg.model_use_gib is None else cfg.model_use_gib
    length = ASSUMED_MAX_MODEL_LEN if cfg.max_model_len is None else cfg.max_model_len
    assumed = {flag: value for flag, given, value in (
        ("--util", cfg.util, util),
        ("--model-use-gb", cfg.model_use_gib, model_use),
        ("--max-model-len", cfg.max_model_len, length),
    ) if given is None}
    derivation = derive(
        PrerunInputs(
            card_gib=card,
            util=util,
            model_use_gib=model_use,
            actual_peak_mib=worst.actual_peak_mib,
            kv_bytes_per_token=bpt,
            block_size=cfg.block_size,
            max_model_len=length,
            headroom_gib=cfg.headroom_gib,
            per_seq_bytes=per_sequence_bytes(cfg.model.vocab_size),
        )
    )
    return R01Analysis(
        model=cfg.model.name,
        scan=scan,
        worst=worst,
        card_gib=card,
        card_source=card_source,
        tp=tp,
        tp_source=tp_source,
        kv_bytes_per_token=bpt,
        derivation=derivation,
        assumed=assumed,
    )
