"""The preset record, its JSON form (unknown keys rejected), its check against the KV math, and
a run record as a preset. Pure apart from reading the package's own data files."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pretuner.engines.mindspore_r01 import MEMORY_VARS
from pretuner.engines.vllm_v1 import ROWS, card_unit
from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens
from pretuner.models import folder_identity, resolve
from pretuner.models.checkpoint import reject_unknown
from pretuner.redact import SecretArg, redact_argv
from pretuner.report.records import PinnedDerivation, R01Derivation, RunReport
from pretuner.units import GIB


class PresetKind(str, Enum):
    """Where a preset's figures come from, the most trusted first."""

    MEASURED = "measured"  # a run record on real hardware
    PUBLISHED = "published"  # a public source, cited in `source`
    SIMULATED = "simulated"  # a run record on the emulated card
    GIVEN = "given"  # values a user tuned by hand, typed on the command line (never shipped)


class KvBasis(str, Enum):
    """How the KV cache size follows from the configuration."""

    # r0.1: card*util - vLLM_MODEL_MEMORY_USE_GB, block-floored (seed 003).
    MODEL_USE = "model-use"
    # The engine profiled and logged its KV memory; `kv_gib` is that figure (2 decimals).
    ENGINE_LOG = "engine-log"
    # A V1 engine: the KV cache is `--kv-cache-memory-bytes`, exact bytes
    # (`kv_cache_memory_bytes`); the engine floors it to whole blocks.
    PINNED = "pinned"


# What a pinned (V1) preset's flags must hold; the others also need the util.
_PINNED_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size")
_R01_FLAGS = ("max_model_len", "max_num_seqs", "gpu_memory_utilization", "block_size")
_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


@dataclass(frozen=True, slots=True)
class Preset:
    """A tuned configuration for one model, card size and parallel layout, with its source."""

    name: str
    kind: PresetKind
    model: str  # registry name
    model_path: str  # what the server loads (HF id or folder)
    card_gib: int
    tp: int
    pp: int
    nodes: int
    cards_per_node: int
    weights_format: str
    kv_cache_dtype: str
    engine: str
    engine_version: str | None  # None: the source does not say
    env: dict[str, str]
    flags: dict[str, int | float]
    kv_bytes_per_token: int
    kv_basis: KvBasis
    kv_gib: float
    kv_tokens: int
    date: str
    source: str
    notes: str = ""
    run_id: str | None = None
    # Named figures the preset rests on (units in the names), e.g. actual_peak_mib.
    figures: dict[str, float] = field(default_factory=dict)
    # kv_basis pinned (V1 engines) only: the KV cache in bytes, and the server command the run
    # proved, before the model (`vllm serve`) and after it (the flags, exactly as launched).
    kv_cache_memory_bytes: int | None = None
    server_command: list[str] | None = None
    server_flags: list[str] | None = None

    @property
    def block_size(self) -> int:
        return int(self.flags["block_size"])

    @property
    def max_model_len(self) -> int:
        return int(self.flags["max_model_len"])

    @property
    def util(self) -> float:
        return float(self.flags["gpu_memory_utilization"])

    @property
    def kv_bytes(self) -> int:
        """KV bytes per card the tokens occupy (whole blocks)."""
        return self.kv_tokens * self.kv_bytes_per_token


_KEYS = {f.name for f in fields(Preset)}
_PINNED_KEYS = ("kv_cache_memory_bytes", "server_command", "server_flags")


def preset_from_dict(data: dict[str, Any], origin: str) -> Preset:
    """Build a preset from its JSON form, rejecting unknown or missing keys (`presets show
    --json` adds `schema_version`, which is read past)."""
    data = {k: v for k, v in data.items() if k != "schema_version"}
    reject_unknown(data, _KEYS, f"{origin}: unknown preset key(s)")
    try:
        kinds = {"kind": PresetKind(data["kind"]), "kv_basis": KvBasis(data["kv_basis"])}
        preset = Preset(**(data | kinds))
    except (KeyError, TypeError, ValueError) as err:
        raise BadInputError(f"{origin}: invalid preset: {err}") from None
    check_name(preset.name, origin)
    pinned = preset.kv_basis is KvBasis.PINNED
    for key in _PINNED_FLAGS if pinned else _R01_FLAGS:
        if key not in preset.flags:
            raise BadInputError(f"{origin}: flags lack {key!r}")
    if pinned:
        _check_pinned_fields(preset, origin)
    elif set(_PINNED_KEYS) & set(data):
        raise BadInputError(
            f"{origin}: kv_cache_memory_bytes, server_command and server_flags go with "
            f"kv_basis {KvBasis.PINNED.value!r} only",
            hint=f"kv_basis is {preset.kv_basis.value!r}",
        )
    return preset


def check_name(name: str, origin: str) -> str:
    """`name` when it can name a preset: a file name in the presets folder and a shell word."""
    if not _NAME.match(name):
        raise BadInputError(f"{origin}: preset name {name!r} is invalid",
                            hint="use lower-case letters, digits, dots and dashes")
    return name


def _check_pinned_fields(p: Preset, origin: str) -> None:
    """A V1 preset: a V1 engine, its KV bytes, and none of r0.1's memory variables."""
    if p.engine not in ROWS:
        raise BadInputError(
            f"{origin}: engine {p.engine!r} takes no --kv-cache-memory-bytes",
            hint=f"a pinned preset names a V1 engine: {', '.join(ROWS)}",
        )
    kv = p.kv_cache_memory_bytes
    if type(kv) is not int or kv < 1:
        raise BadInputError(f"{origin}: kv_cache_memory_bytes {kv!r} is not a positive integer")
    for key in ("server_command", "server_flags"):
        value = getattr(p, key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(x, str) for x in value)
        ):
            raise BadInputError(f"{origin}: {key} is not a list of strings")
    r01 = [k for k in MEMORY_VARS if k in p.env]
    if r01:
        raise BadInputError(
            f"{origin}: {r01[0]} is vLLM-MindSpore r0.1's; a V1 engine ignores it",
            hint="drop it: kv_cache_memory_bytes sizes the KV cache",
        )


def preset_to_json(p: Preset) -> dict[str, Any]:
    data = asdict(p) | {"kind": p.kind.value, "kv_basis": p.kv_basis.value}
    if p.kv_basis is not KvBasis.PINNED:
        for key in _PINNED_KEYS:
            del data[key]
    return data


def load_preset_file(path: Path) -> Preset:
    try:
        data = json.loads(Path(path).read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise BadInputError(f"cannot read preset {str(path)!r}: {err}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{str(path)!r} is not a preset (a JSON object)")
    return preset_from_dict(data, str(path))


@cache
def builtin_presets() -> tuple[Preset, ...]:
    """Every preset shipped with the package, sorted by name."""
    data = resources.files("pretuner.presets").joinpath("data").iterdir()
    found = [preset_from_dict(json.loads(e.read_text("utf-8")), e.name) for e in data
             if e.name.endswith(".json")]
    return tuple(sorted(found, key=lambda p: p.name))


def user_presets_dir() -> Path:
    """Where `presets add` keeps a user's presets: $PRETUNER_PRESETS_DIR, else
    $XDG_DATA_HOME/pretuner/presets (~/.local/share/pretuner/presets); never the package."""
    if os.environ.get("PRETUNER_PRESETS_DIR"):
        return Path(os.environ["PRETUNER_PRESETS_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pretuner" / "presets"


def all_presets() -> tuple[Preset, ...]:
    """The shipped presets, then those `presets add` wrote for this user, each sorted by name."""
    found = [load_preset_file(p) for p in user_presets_dir().glob("*.json")]
    return builtin_presets() + tuple(sorted(found, key=lambda p: p.name))


def engine_words(p: Preset) -> str:
    return f"{p.engine} {p.engine_version}" if p.engine_version else p.engine


def get_preset(name: str) -> Preset:
    presets = {p.name: p for p in all_presets()}
    if name in presets:
        return presets[name]
    close = difflib.get_close_matches(name, list(presets), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "run `pretuner presets list`"
    raise BadInputError(f"unknown preset {name!r}", hint=hint)


def resolve_preset(name_or_path: str) -> Preset:
    """A shipped preset by name, or a preset file (`presets add --out DIR` writes them)."""
    if name_or_path.endswith(".json") or "/" in name_or_path:
        return load_preset_file(Path(name_or_path))
    return get_preset(name_or_path)


def find_preset(model: str, card_gib: int, tp: int) -> Preset | None:
    """The preset for this model, card size and TP (in PresetKind's order: measured first). A
    local folder is matched by the hub model its config.json names, never by its base name, and
    a folder's own preset (its absolute model_path) only by that folder."""
    folder = folder_identity(model)
    name: str | None = folder.hub_id if folder is not None else model
    if name is not None:
        with contextlib.suppress(BadInputError):  # a name no registry knows is matched as given
            name = resolve(name).name

    def same(p: Preset) -> bool:
        if Path(p.model_path).is_absolute():
            return folder is not None and p.model_path == folder.path
        return p.model == name

    hits = [p for p in all_presets() if same(p) and p.card_gib == card_gib and p.tp == tp]
    return min(hits, key=lambda p: (list(PresetKind).index(p.kind), p.name)) if hits else None


def preset_line(model: str, card_gib: int, tp: int, kv_tokens: int, what: str,
                engine: str | None, given: str | None = None) -> str:
    """One line for `run` and `plan`: the preset for this model, card and layout, if any
    (`given`: the model as the user named it, a folder's path)."""
    p = find_preset(given or model, card_gib, tp)
    if p is None:
        return f"preset: none for {model} on {card_gib} {card_unit(engine)} cards at TP{tp}"
    diff = kv_tokens - p.kv_tokens
    pct = f" ({diff / p.kv_tokens:+.1%})" if p.kv_tokens else ""
    return (
        f"preset {p.name} ({p.kind.value}): {p.kv_tokens:,} KV tokens/card; this {what} result "
        f"{kv_tokens:,} differs by {diff:+,}{pct}"
    )


def model_use_budget_bytes(card_gib: int, util: float, model_use_gib: int) -> int:
    """r0.1's KV budget: card*util - model-use, in bytes (before block flooring)."""
    return int(card_gib * GIB * util) - model_use_gib * GIB


def check_preset(p: Preset) -> list[str]:
    """Where a preset disagrees with pretuner's KV math; empty when it agrees."""
    problems = []
    # A local folder's preset is checked against that folder, not a registry model of its name.
    spec = resolve(p.model_path if Path(p.model_path).is_absolute() else p.model)
    bpt = kv_bytes_per_token(spec, tp=p.tp, pp=p.pp, kv_dtype=p.kv_cache_dtype)
    if bpt != p.kv_bytes_per_token:
        problems.append(f"kv_bytes_per_token {p.kv_bytes_per_token:,} B but the math gives {bpt:,}")
    block = p.block_size
    if p.kv_tokens % block:
        problems.append(f"kv_tokens {p.kv_tokens:,} is not whole blocks of {block}")
    if p.kv_basis is KvBasis.PINNED:  # the engine floors the pinned bytes to whole blocks
        kv = p.kv_cache_memory_bytes or 0
        want = kv_tokens(kv, bpt, block)
        if want != p.kv_tokens:
            problems.append(
                f"kv_tokens {p.kv_tokens:,} but --kv-cache-memory-bytes {kv} holds {want:,} "
                f"(whole blocks of {block} at {bpt:,} B/token)"
            )
        if abs(kv / GIB - p.kv_gib) > 0.005:
            problems.append(f"kv_gib {p.kv_gib} but {kv} B is {kv / GIB:.4f} GiB")
    elif p.kv_basis is KvBasis.MODEL_USE:
        budget = model_use_budget_bytes(p.card_gib, p.util, int(p.env["vLLM_MODEL_MEMORY_USE_GB"]))
        want = kv_tokens(budget, bpt, block)
        if want != p.kv_tokens:
            problems.append(f"kv_tokens {p.kv_tokens:,} but card*util - model-use gives {want:,}")
        if abs(budget / GIB - p.kv_gib) > 0.01:
            problems.append(f"kv_gib {p.kv_gib} but card*util - model-use is {budget / GIB:.4f}")
    else:
        # kv_gib is printed with 2 decimals: the tokens must lie within that rounding.
        lo = kv_tokens(int((p.kv_gib - 0.005) * GIB), bpt, block)
        hi = kv_tokens(int((p.kv_gib + 0.005) * GIB), bpt, block)
        if not lo <= p.kv_tokens <= hi:
            problems.append(
                f"kv_tokens {p.kv_tokens:,} is outside {lo:,}..{hi:,}, what {p.kv_gib} GiB holds"
            )
    logged_bytes = p.figures.get("kv_bytes_logged")
    if logged_bytes is not None and kv_tokens(int(logged_bytes), bpt, block) != p.kv_tokens:
        problems.append(f"kv_tokens {p.kv_tokens:,} disagree with the logged {logged_bytes:.0f} B")
    conc = p.figures.get("max_concurrency_x")
    if conc is not None and round(p.kv_tokens / p.max_model_len, 2) != conc:
        problems.append(
            f"concurrency {p.kv_tokens / p.max_model_len:.2f}x but the source says {conc}x"
        )
    return problems


def numeric_flags(argv: list[str]) -> dict[str, int | float]:
    """The server flags that take a number, by vLLM's long name (`--max-model-len 16384` ->
    max_model_len: 16384); the parallel sizes are the preset's own fields."""
    return {key.replace("-", "_"): value for key, value in config_entries(argv).items()
            if type(value) in (int, float) and not key.endswith("parallel-size")}


def preset_name(text: str) -> str:
    """A preset's name as every preset writes it: lower case, runs of other characters a dash."""
    return re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-")


def preset_from_report(rep: RunReport, *, name: str | None = None, date: str) -> Preset:
    """A run record as a preset (measured, or simulated on the emulated card): what every run
    records, and the method's own figures (`_r01_fields`, `_pinned_fields`)."""
    d = rep.derivation
    kind = PresetKind.SIMULATED if rep.simulated else PresetKind.MEASURED
    r01 = isinstance(d, R01Derivation)
    own = _r01_fields(rep, d) if isinstance(d, R01Derivation) else _pinned_fields(rep, d)
    engine = "" if r01 else f"-{rep.engine}"
    default = f"{rep.model}-tp{rep.tp}-{rep.card_gib}g{engine}-{kind.value}-{rep.run_id}"
    notes = ["validated under full load" if rep.validated else "NOT validated"]
    if rep.simulated and not r01:
        notes.append("figures simulated on the emulated card; the server command is the "
                     f"real {rep.engine}'s with the run's flags")
    return Preset(
        name=name or preset_name(default),
        kind=kind, model=rep.model, card_gib=rep.card_gib, tp=rep.tp, pp=rep.pp,
        nodes=rep.nodes, weights_format=rep.weights_format, kv_cache_dtype=rep.kv_cache_dtype,
        env=dict(rep.final.env), kv_bytes_per_token=rep.kv_bytes_per_token,
        kv_tokens=rep.final.kv_tokens or 0, date=date, notes="; ".join(notes),
        source=f"pretuner {rep.pretuner_version} run {rep.run_id} "
        f"({'emulated card' if rep.simulated else rep.engine})",
        run_id=rep.run_id, kv_basis=KvBasis.MODEL_USE if r01 else KvBasis.PINNED, **own,
    )


def _r01_fields(rep: RunReport, d: R01Derivation) -> dict[str, Any]:
    """An r0.1 run's preset fields: its variables, its flags, the pre-run's figures."""
    try:
        model_use = int(rep.final.env["vLLM_MODEL_MEMORY_USE_GB"])
    except (KeyError, ValueError) as err:
        raise BadInputError(f"the run record lacks {err} in report.json",
                            hint="pass a finished run folder") from None
    # What the real server loads: the emulated card took the registry name, the real
    # vLLM-MindSpore needs the Hugging Face id (a folder stays a folder).
    model_path = rep.model_arg
    if rep.simulated and not Path(model_path).exists() and model_path == rep.model:
        model_path = resolve(model_path).hf_id or model_path
    return {
        "model_path": model_path,
        "cards_per_node": 8 if rep.nodes > 1 else rep.tp * rep.pp,
        "engine": "emulated vllm-mindspore" if rep.simulated else "vllm-mindspore",
        "engine_version": "0.1", "flags": numeric_flags(rep.final.flags),
        "kv_gib": round(model_use_budget_bytes(rep.card_gib, d.util, model_use) / GIB, 2),
        "figures": {"actual_peak_mib": d.actual_peak_mib, "kv_prerun_gib": d.kv_prerun_gib,
                    "weights_act_gib": d.weights_act_gib, "headroom_gib": d.headroom_gib},
    }


def config_entries(flags: Sequence[str | SecretArg]) -> dict[str, Any]:
    """The flags as `vllm serve --config` YAML keys (long names with dashes); a switch is
    `true`, a secret is left out (the scripts read it from the environment)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        word = flags[i]
        nxt = flags[i + 1] if i + 1 < len(flags) else None
        if isinstance(word, SecretArg):  # `--api-key=K` as one word
            i += 1
            continue
        name, eq, inline = word.partition("=")
        key = name.removeprefix("--")
        if eq:
            out[key], i = _scalar(inline), i + 1
        elif isinstance(nxt, SecretArg):
            i += 2
        elif nxt is not None and not nxt.startswith("--"):
            out[key], i = _scalar(nxt), i + 2
        else:
            out[key], i = True, i + 1
    return out


def _scalar(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def split_command(command: list[str], flags: list[str]) -> tuple[list[str], str]:
    """(the command before the model, the model) of `[*command, model, *flags]`."""
    n = len(flags)
    if len(command) < n + 2 or command[len(command) - n :] != flags:
        raise BadInputError(
            "the run record's server command does not end with its flags",
            hint="pass a run folder written by `pretuner run --engine ...`",
        )
    return command[: -n - 1], command[-n - 1]


def _pinned_fields(rep: RunReport, d: PinnedDerivation) -> dict[str, Any]:
    """A V1 run's preset fields: the command it proved, its KV bytes, its figures."""
    f, engine = rep.final, rep.engine
    # A simulated run's serve command starts the emulator: the preset keeps the real engine's.
    command = f.engine_serve_command if rep.simulated else None
    server_command, model_path = split_command(command or f.serve_command, f.flags)
    if engine not in ROWS:
        raise BadInputError(
            f"run engine {engine!r} is not a V1 engine", hint=f"V1 engines: {', '.join(ROWS)}"
        )
    if d.kv_cache_memory_bytes is None:
        raise BadInputError("the V1 run record pinned no KV cache",
                            hint="pass a finished run folder")
    given = config_entries(f.flags)
    flags: dict[str, int | float] = {
        "max_model_len": f.max_model_len,
        "max_num_seqs": f.max_num_seqs,
        "max_num_batched_tokens": f.max_num_batched_tokens,
        "block_size": int(given.get("block-size", ROWS[engine].default_block_size)),
    }
    if "gpu-memory-utilization" in given:
        flags["gpu_memory_utilization"] = float(given["gpu-memory-utilization"])
    return {
        "model_path": model_path, "cards_per_node": rep.tp * rep.pp // rep.nodes,
        "engine": engine, "engine_version": rep.engine_version, "flags": flags,
        "kv_gib": round(d.kv_cache_memory_bytes / GIB, 2),
        "figures": _figures(d),
        "kv_cache_memory_bytes": d.kv_cache_memory_bytes, "server_command": server_command,
        "server_flags": redact_argv(f.flags),  # a record written before runs redacted them
    }


def _figures(d: PinnedDerivation) -> dict[str, float]:
    """The derivation's figures (MiB), the engine's own profiled KV tokens, the validation's
    speed and the weights offloaded, when present."""
    out: dict[str, float] = {}
    if d.budget is not None:
        b = d.budget
        out |= {"device_total_mib": b.device_total_mib, "device_peak_mib": b.device_peak_mib,
                "non_kv_peak_mib": b.non_kv_peak_mib, "margin_mib": b.margin_mib}
    if d.baseline.kv_tokens is not None:
        out["profiled_kv_tokens"] = float(d.baseline.kv_tokens)
    if d.speed is not None:
        if d.speed.decode_tokens_per_s is not None:
            out["decode_tokens_per_s"] = d.speed.decode_tokens_per_s
        out["ttft_s"] = d.speed.ttft_s
    if d.weights is not None and d.weights.cpu_offload_gib:
        out["cpu_offload_gib"] = d.weights.cpu_offload_gib
    return out
