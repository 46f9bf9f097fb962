"""What the startup scripts say, decided in pure Python; the templates only lay it out. One
context for an r0.1-family preset (vLLM-MindSpore's memory variables, for the `--engine-version`
asked) and a pinned one (a V1 engine's `--kv-cache-memory-bytes` and the command its run proved).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from pretuner import __version__
from pretuner.cluster.env import node_exports
from pretuner.derivation_text import server_args
from pretuner.engines.base import KV_FLAG, Engine, LaunchSettings, Purpose
from pretuner.engines.mindspore_r01 import BACKEND_VARS, MEMORY_VARS, R01, R01Engine
from pretuner.engines.registry import STACK_PROBE
from pretuner.engines.stack import LABELS, stack_words
from pretuner.engines.vllm_v1 import (
    DEFAULT_UTIL,
    DEVICE_TOOLS,
    MEMORY_FLAGS,
    NIC_VARS,
    RAY_RESOURCE,
    ROWS,
    V1Engine,
    V1Row,
)
from pretuner.errors import BadInputError
from pretuner.presets.model import (
    KvBasis,
    Preset,
    PresetKind,
    config_entries,
    engine_words,
)
from pretuner.redact import SecretArg, classify_argv, is_secret_name, one_line
from pretuner.report.records import RunReport
from pretuner.units import GIB


@dataclass(frozen=True, slots=True)
class ScriptOptions:
    """How to render: for which vLLM-MindSpore version, and the site's own values."""

    engine_version: str | None = None  # None: 0.1 (a V1 preset names its own engine)
    model_path: str | None = None  # default: the preset's model_path
    nic: str = "eth0"  # multi-node: the NIC the nodes talk over
    head_ip: str | None = None  # multi-node: baked into ray-worker.sh as the default
    ray_port: int = 6379
    install_dir: str = "/etc/pretuner"  # where the systemd unit finds tuned.env
    extra_env: dict[str, str] = field(default_factory=dict)
    # r0.1 only: the server command, model included, to use instead of the version's
    command: tuple[str, ...] | None = None
    status: str | None = None  # a run's own files: "validated under full load" or not
    proof: Proof | None = None  # a run's own files: what the scripts check before starting


@dataclass(frozen=True, slots=True)
class Proof:
    """The fingerprint of the run that proved a configuration: the scripts check it before
    starting (a None is what the run did not record, and is not checked)."""

    engine: str
    distribution: str | None  # the engine as importlib.metadata knows it
    version: str | None
    device_tool: str | None  # nvidia-smi or npu-smi; None: no device to read (CPU)
    visible_devices_var: str
    device_name: str | None  # as the device tool prints it
    device_total_mib: int | None
    free_mib: int | None  # the device's free memory when the proof started
    retune: str | None = None  # the run again with every option it was given (a real device's)
    # torch, its CUDA, CANN, MindSpore... (pretuner.engines.stack); None: not recorded
    stack: dict[str, str] | None = None
    distributions: tuple[str, ...] = ()  # the engine's, which the stack probe leaves out
    devices: int = 1  # on each node: TP x PP / nodes, every one checked
    python: str | None = None  # the engine's own interpreter (its venv); None: python3

    def line(self) -> str:
        """The fingerprint as the scripts' header says it."""
        total, free = ("not recorded" if mib is None else f"{mib:,} MiB"
                       for mib in (self.device_total_mib, self.free_mib))
        return ("proof fingerprint (the startup scripts check it before starting): engine "
                f"{self.engine} {self.version or '(version not recorded)'} on "
                f"{stack_words(self.stack)}; device {self.device_name or '(name not recorded)'}, "
                f"total {total}, free when the proof started {free}")


def proof_of(rep: RunReport) -> Proof:
    """What a finished run proved its configuration on: the engine and its version, the device
    its final launch saw (total, and free = total - used when that launch began)."""
    row = ROWS.get(rep.engine) or ROWS["vllm-mindspore"]  # r0.1: vLLM-MindSpore's facts
    last = next((s for s in reversed(rep.steps) if s.device_total_mib), None)
    total = last.device_total_mib if last is not None else None
    used = last.device_peaks_mib.get("launch") if last is not None else None
    return Proof(
        engine=rep.engine, distribution=row.distributions[0], version=rep.engine_version,
        device_tool=DEVICE_TOOLS.get(row.device), visible_devices_var=row.visible_devices_var,
        device_name=rep.device_name, device_total_mib=total,
        free_mib=total - used if total is not None and used is not None else None,
        # an emulated card's run is re-tuned on the real device: the header's command
        retune=None if rep.simulated else shlex.join(rep.retune_command),
        # only the names the probe prints: a hand-edited report.json names nothing else
        stack=None if rep.stack is None else {
            k: v for k, v in rep.stack.items() if k in LABELS},
        distributions=row.distributions, devices=max(1, rep.tp * rep.pp // rep.nodes),
        python=rep.engine_python,
    )


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RAY_BACKEND = ("--distributed-executor-backend", "ray")

KIND_TAG = {
    PresetKind.MEASURED: "measured on real hardware",
    PresetKind.PUBLISHED: "published",
    PresetKind.SIMULATED: "SIMULATED on the emulated card",
    PresetKind.GIVEN: "given by hand, NOT measured by pretuner",
}


def _check_line(var: str, what: str) -> str:
    return f': "${{{var}:?export {var} ({what}); pretuner never writes a secret}}"'


@dataclass(frozen=True, slots=True)
class _Server:
    """What one engine family puts in the scripts; `build_context` adds what every one shares."""

    env: dict[str, str]  # before the user's --env and the secrets are taken out
    argv: list[str]  # the whole server command
    config: dict[str, Any]  # the YAML's keys
    notes: list[str]  # before the secrets' notes
    late_notes: list[str]  # after them
    kv_line: str  # the header's KV cache line
    engine: str  # the engine in the header's words
    unit_engine: str  # in the systemd unit's description
    retune: str  # `pretuner run` options that name the engine
    ray_resource: str


def _r01_server(p: Preset, opts: ScriptOptions, model_path: str) -> _Server:
    """vLLM-MindSpore r0.1 and its later versions: what `R01Engine.production` starts the
    version with, the preset's own variables and flags beside it."""
    engine_version = opts.engine_version or "0.1"
    if MEMORY_VARS[1] in p.env:
        use, use_note = int(p.env[MEMORY_VARS[1]]), None
    else:  # rounded up, so the KV cache is at most what the source measured
        use = math.ceil(p.card_gib * p.util - p.kv_gib - 1e-9)
        use_note = (f"model-use re-expressed from the source's KV figure: ceil({p.card_gib} x "
                    f"{p.util:g} - {p.kv_gib:.2f}) = {use} GiB")
    engine = R01Engine(R01, False, engine_version, "script", nodes=p.nodes,
                       backend=next((p.env[k] for k in BACKEND_VARS if k in p.env), None))
    deployment = engine.production(preset_settings(p, model_use_gib=use,
                                                   kv_cache_bytes=p.kv_bytes))
    # the re-expressed model-use is said where the version reads it
    notes = [use_note] if use_note and MEMORY_VARS[1] in deployment.env else []
    notes += deployment.notes
    env = dict(deployment.env)
    env |= {k: v for k, v in p.env.items() if k not in BACKEND_VARS + MEMORY_VARS}
    if p.nodes > 1:
        env.update(node_exports(opts.nic, p.cards_per_node))
    if KV_FLAG in dict(deployment.flags):
        notes.append(
            f"KV cache pinned with {KV_FLAG} {p.kv_bytes} "
            f"({p.kv_bytes / GIB:.2f} GiB = {p.kv_tokens:,} tokens per card)"
        )
    args = deployment.argv()
    # a preset's flags the engine does not set itself (a user's file may name more)
    args += server_args({k: v for k, v in p.flags.items()
                         if k.replace("_", "-") not in config_entries(args)})
    base = list(opts.command) if opts.command is not None else engine.serve_argv(model_path)
    basis = "card x util - model-use" if p.kv_basis is KvBasis.MODEL_USE else (
        "the engine's own KV log line")
    return _Server(
        env=env,
        argv=base + args,
        config=config_entries(args),
        notes=notes,
        # the checks on hand-given values, e.g. an oversubscribed KV cache
        late_notes=[p.notes] if p.kind is PresetKind.GIVEN and p.notes else [],
        kv_line=f"KV cache {p.kv_gib:.2f} GiB/card = {p.kv_tokens:,} tokens at "
        f"{p.kv_bytes_per_token:,} B/token, block {p.block_size} (from {basis})",
        engine=f"vLLM-MindSpore {engine_version}",
        unit_engine="vLLM-MindSpore",
        retune="",
        ray_resource="NPU",
    )


def preset_settings(p: Preset, **values: Any) -> LaunchSettings:
    """The preset's values as the settings an engine deploys (`values` overrides)."""
    batched = int(p.flags.get("max_num_batched_tokens", p.max_model_len))
    return replace(LaunchSettings(
        Purpose.VALIDATE, p.card_gib, float(p.flags.get("gpu_memory_utilization", DEFAULT_UTIL)),
        0, p.max_model_len, int(p.flags["max_num_seqs"]), batched, p.block_size, p.tp, p.pp,
        p.kv_cache_dtype, chunked_prefill=batched < p.max_model_len), **values)


def preset_flags(p: Preset, row: V1Row) -> list[str]:
    """The flags after the model: the run's own, or (a preset without them) what the engine
    deploys for the preset's values."""
    if p.server_flags is not None:
        return list(p.server_flags)
    engine: Engine = V1Engine(row, simulated=False)
    return engine.production(preset_settings(p, kv_cache_bytes=p.kv_cache_memory_bytes)).argv()


def layout_flags(flags: list[str], p: Preset) -> list[str]:
    """`flags` with the parallel sizes and, across nodes, the Ray executor, where missing."""
    out = list(flags)
    for name, size in (("--tensor-parallel-size", p.tp), ("--pipeline-parallel-size", p.pp)):
        if size > 1 and name[2:] not in config_entries(out):
            out += [name, str(size)]
    if p.nodes > 1 and RAY_BACKEND[0][2:] not in config_entries(out):
        out += RAY_BACKEND
    return out


def node_env(row: V1Row, nic: str, cards: int) -> dict[str, str]:
    """What every node exports before `ray start`: the NIC in the device's terms, the cards."""
    env = {var: nic for var in NIC_VARS[row.device]}
    env[row.visible_devices_var] = ",".join(str(i) for i in range(cards))
    return env


def _v1_server(p: Preset, opts: ScriptOptions, model_path: str) -> _Server:
    """A pinned (V1 engine) preset: the command and flags its run proved, no r0.1 variable."""
    row = ROWS[p.engine]
    if opts.engine_version is not None:
        raise BadInputError(
            f"--engine-version is for vLLM-MindSpore r0.1-family presets; {p.name} is a "
            f"{p.engine} configuration (the engine comes from the preset)",
            hint="drop --engine-version",
        )
    kv = p.kv_cache_memory_bytes or 0
    flags = layout_flags(preset_flags(p, row), p)
    env = {**row.env, **p.env}
    if p.nodes > 1:
        env.update(node_env(row, opts.nic, p.cards_per_node))
    r01 = [k for k in MEMORY_VARS if k in {**env, **opts.extra_env}]
    if r01:
        raise BadInputError(
            f"{r01[0]} is vLLM-MindSpore r0.1's; {p.engine} ignores it",
            hint=f"drop it: {KV_FLAG} sizes the KV cache",
        )
    return _Server(
        env=env,
        argv=[*(p.server_command or row.command), model_path, *flags],
        config=config_entries(classify_argv(flags)),
        notes=[
            f"KV cache pinned with {KV_FLAG} {kv} ({kv / GIB:.2f} GiB = {p.kv_tokens:,} tokens "
            "per card): the engine skips its own memory profiling"
        ],
        late_notes=[
            f"the figures are SIMULATED; the command is the real {p.engine}'s with the run's "
            "flags: run `pretuner run` on the real device to measure and prove them"
        ] if p.kind is PresetKind.SIMULATED else [],
        kv_line=f"KV cache {KV_FLAG} {kv} = {kv / GIB:.2f} GiB/card = {p.kv_tokens:,} tokens "
        f"at {p.kv_bytes_per_token:,} B/token, block {p.block_size} (pinned)",
        engine=engine_words(p),
        unit_engine=engine_words(p),
        retune=f" --engine {p.engine}",
        # GPU, NPU or CPU: pretuner's own word, printed inside the scripts' quoted grep pattern.
        ray_resource=RAY_RESOURCE[row.device],
    )


def build_context(p: Preset, opts: ScriptOptions) -> dict[str, Any]:
    """Every value the templates print, for one preset (or run record)."""
    model_path = opts.model_path or p.model_path
    pinned = p.kv_basis is KvBasis.PINNED
    s = (_v1_server if pinned else _r01_server)(p, opts, model_path)
    # A secret (`--api-key K`, or the `<redacted>` a run record holds) is never written: the
    # scripts read it from an environment variable (pretuner.redact.secret_var).
    argv = classify_argv(s.argv)
    secret_args = list({a.var: a for a in argv if isinstance(a, SecretArg)}.values())
    env = {**s.env, **opts.extra_env}  # every name a valid shell variable name
    bad = [k for k in (*opts.extra_env, *env) if not _ENV_NAME.match(k)]
    if bad:
        raise BadInputError(f"environment name {bad[0]!r} is invalid", hint="use e.g. FOO_BAR=1")
    secret_env = [k for k in env if is_secret_name(k)]
    where = "before starting (systemd: Environment= in a drop-in only root reads)"
    secret_notes = [f"secret {a.flag} is not written here: export {a.var} {where}"
                    for a in secret_args]
    secret_notes += [f"secret {k} is not written here: export it {where}" for k in secret_env]
    env_checks = [_check_line(k, "a secret the server needs") for k in secret_env]
    figures = ", ".join(f"{k} {v:g}" for k, v in p.figures.items())
    # A folder by its path: from another folder, its name is a registry model or nothing.
    retune_model = shlex.quote(model_path) if os.path.isabs(model_path) else p.model
    pp = f" --pp {p.pp}" if p.pp > 1 else ""  # TP alone would not fit the cards
    ray = " --ray-address auto" if p.nodes > 1 else ""  # run on the head, as these scripts
    retune = (f"pretuner run --model {retune_model}{s.retune} --card {p.card_gib} --tp {p.tp}"
              f"{pp} --max-model-len {p.max_model_len}{ray}")
    header = [
        *([f"run {p.run_id or '-'}: {opts.status}"] if opts.status else []),
        f"model {p.model} ({p.weights_format}) from {model_path}",
        f"card {p.card_gib} GiB; layout TP{p.tp} x PP{p.pp} on {p.nodes} node(s), "
        f"{p.cards_per_node} card(s) per node",
        s.kv_line,
        f"figures ({KIND_TAG[p.kind]}): {figures or 'none beyond the KV cache'}",
        f"source: {p.source}",
        f"preset {p.name}; run {p.run_id or '-'}; rendered by pretuner {__version__} "
        f"for {s.engine}",
        f"re-tune: {retune}, then pretuner script RUN_DIR",
        *([opts.proof.line()] if opts.proof else []),
        *s.notes,
        *secret_notes,
        *s.late_notes,
    ]
    head_argv = list(argv)
    if RAY_BACKEND[0][2:] not in config_entries(head_argv):
        head_argv += RAY_BACKEND
    return {
        "header": [one_line(h) for h in header],
        "secret_checks": [_check_line(a.var, f"the server flag {a.flag}") for a in secret_args]
        + env_checks,
        "secret_env_checks": env_checks,
        "env": {k: v for k, v in env.items() if k not in secret_env},
        "argv": argv,
        "head_argv": head_argv,
        "config": s.config,
        "expected_npus": p.nodes * p.cards_per_node,
        "ray_resource": s.ray_resource,
        "ray_port": opts.ray_port,
        "head_ip": opts.head_ip or "",
        "env_path": f"{opts.install_dir.rstrip('/')}/tuned.env",
        "guard_path": f"{opts.install_dir.rstrip('/')}/pretuner-guard.sh",
        "guard": None if opts.proof is None else {
            "proof": opts.proof, "retune": opts.proof.retune or retune,
            "memory_flags": sorted(MEMORY_FLAGS), "probe": STACK_PROBE, "labels": LABELS},
        "unit_description": one_line(f"{s.unit_engine} serving {p.model} (preset {p.name})"),
    }
