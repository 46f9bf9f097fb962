"""What the startup scripts say, decided in pure Python; the templates only lay it out."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from pretuner import __version__
from pretuner.cluster.env import node_exports
from pretuner.engines.mindspore_r01 import (
    R01_COMMAND,
    V03_COMMAND,
    chunked_prefill_flag,
    server_kv_cache_dtype,
)
from pretuner.envfile import server_args
from pretuner.errors import BadInputError
from pretuner.presets.model import KvBasis, Preset, PresetKind
from pretuner.redact import SecretArg, classify_argv, is_secret_name, one_line
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
    command: tuple[str, ...] | None = None  # a server command to use instead of the version's
    status: str | None = None  # a run's own files: "validated under full load" or not


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BACKEND_VARS = ("vLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND")
_MEMORY_VARS = ("ASCEND_TOTAL_MEMORY_GB", "vLLM_MODEL_MEMORY_USE_GB")


KIND_TAG = {
    PresetKind.MEASURED: "measured on real hardware",
    PresetKind.PUBLISHED: "published",
    PresetKind.SIMULATED: "SIMULATED on the emulated card",
    PresetKind.GIVEN: "given by hand, NOT measured by pretuner",
}


@dataclass(frozen=True, slots=True)
class Secrets:
    """A server command and environment with their secrets taken out (pretuner.redact)."""

    argv: list[str | SecretArg]
    env: dict[str, str]  # the environment without its secrets
    notes: list[str]
    checks: list[str]  # shell lines that stop a script when a secret is not exported
    env_checks: list[str]  # those of the environment's secrets only


def split_secrets(argv: list[str], env: dict[str, str]) -> Secrets:
    """A secret (`--api-key K`, or the `<redacted>` a run record holds) is never written: the
    scripts read it from an environment variable (pretuner.redact.secret_var)."""
    words = classify_argv(argv)
    secret_args = list({a.var: a for a in words if isinstance(a, SecretArg)}.values())
    secret_env = [k for k in env if is_secret_name(k)]
    where = "before starting (systemd: Environment= in a drop-in only root reads)"
    notes = [f"secret {a.flag} is not written here: export {a.var} {where}" for a in secret_args]
    notes += [f"secret {k} is not written here: export it {where}" for k in secret_env]
    env_checks = [_check_line(k, "a secret the server needs") for k in secret_env]
    return Secrets(
        argv=words,
        env={k: v for k, v in env.items() if k not in secret_env},
        notes=notes,
        checks=[_check_line(a.var, f"the server flag {a.flag}") for a in secret_args] + env_checks,
        env_checks=env_checks,
    )


def check_env_names(env: dict[str, str], extra_env: dict[str, str]) -> dict[str, str]:
    """`env` with the user's --env on top; every name a valid shell variable name."""
    out = dict(env)
    for key, value in extra_env.items():
        if not _ENV_NAME.match(key):
            raise BadInputError(f"environment name {key!r} is invalid", hint="use e.g. FOO_BAR=1")
        out[key] = value
    bad = [k for k in out if not _ENV_NAME.match(k)]
    if bad:
        raise BadInputError(f"environment name {bad[0]!r} is invalid", hint="use e.g. FOO_BAR=1")
    return out


def engine_tuple(version: str) -> tuple[int, int]:
    nums = [int(x) for x in re.findall(r"\d+", version)[:2]]
    if len(nums) < 2:
        raise BadInputError(
            f"vLLM-MindSpore version {version!r} is not understood",
            hint="use e.g. 0.1, 0.3, 0.4 or 0.5",
        )
    return nums[0], nums[1]


def _model_use_gib(p: Preset) -> tuple[int, str | None]:
    """The r0.1 model-use budget: the preset's own, or one re-expressed from its KV figure."""
    if "vLLM_MODEL_MEMORY_USE_GB" in p.env:
        return int(p.env["vLLM_MODEL_MEMORY_USE_GB"]), None
    # Rounded up, so the KV cache is at most what the source measured.
    use = math.ceil(p.card_gib * p.util - p.kv_gib - 1e-9)
    why = (
        f"model-use re-expressed from the source's KV figure: ceil({p.card_gib} x {p.util:g} - "
        f"{p.kv_gib:.2f}) = {use} GiB"
    )
    return use, why


def build_context(p: Preset, opts: ScriptOptions) -> dict[str, Any]:
    """Every value the templates print, for one preset (or run record) and one engine version."""
    engine_version = opts.engine_version or "0.1"
    ver = engine_tuple(engine_version)
    model_path = opts.model_path or p.model_path
    notes: list[str] = []
    env: dict[str, str] = {"GLOG_v": "2"}  # MindSpore WARNING; 0.3+ would set 3 otherwise
    model_use, why = _model_use_gib(p)
    if ver < (0, 2):
        env["ASCEND_TOTAL_MEMORY_GB"] = str(p.card_gib)
        env["vLLM_MODEL_MEMORY_USE_GB"] = str(model_use)
        if why:
            notes.append(why)
    else:
        notes.append(
            f"vLLM-MindSpore {engine_version} ignores ASCEND_TOTAL_MEMORY_GB and "
            "vLLM_MODEL_MEMORY_USE_GB; they are not set"
        )
    backend = next((p.env[k] for k in _BACKEND_VARS if k in p.env), None)
    if backend is not None:
        env["VLLM_MS_MODEL_BACKEND" if ver >= (0, 4) else "vLLM_MODEL_BACKEND"] = backend
    for key, value in p.env.items():
        if key not in _BACKEND_VARS and key not in _MEMORY_VARS:
            env[key] = value
    if p.nodes > 1:
        env.update(node_exports(opts.nic, p.cards_per_node))
    env = check_env_names(env, opts.extra_env)

    flags: dict[str, int | float | str] = {**p.flags, "tensor_parallel_size": p.tp}
    # vLLM V0 (vLLM-MindSpore r0.1) refuses a batched budget below max_model_len unless
    # chunked prefill is on; V1 engines always chunk.
    chunk_flag = chunked_prefill_flag(
        int(p.flags["max_model_len"]),
        p.flags.get("max_num_batched_tokens", p.flags["max_model_len"]) < p.flags["max_model_len"],
    )
    if chunk_flag is not None and ver < (0, 2):
        flags["enable_chunked_prefill"] = str(chunk_flag)
    server_dtype = server_kv_cache_dtype(p.kv_cache_dtype)
    if server_dtype is not None:
        flags["kv_cache_dtype"] = server_dtype
    if p.pp > 1:
        flags["pipeline_parallel_size"] = p.pp
    if p.nodes > 1:
        flags["distributed_executor_backend"] = "ray"
    if ver >= (0, 5):
        flags["kv_cache_memory_bytes"] = p.kv_bytes
        notes.append(
            f"KV cache pinned with --kv-cache-memory-bytes {p.kv_bytes} "
            f"({p.kv_bytes / GIB:.2f} GiB = {p.kv_tokens:,} tokens per card)"
        )
    elif ver >= (0, 2):
        notes.append(
            f"vLLM-MindSpore {engine_version} sizes the KV cache by profiling and has no "
            "--kv-cache-memory-bytes: the tuned KV figure is not enforced; "
            "--gpu-memory-utilization is the only lever"
        )

    if opts.command is not None:
        base = list(opts.command)
    elif ver < (0, 3):
        base = [*R01_COMMAND, "--model", model_path]
    else:
        base = [*V03_COMMAND, model_path]
    secrets = split_secrets(base + server_args(flags), env)
    argv, env = secrets.argv, secrets.env
    notes += secrets.notes

    tag = KIND_TAG[p.kind]
    if p.kind is PresetKind.GIVEN and p.notes:
        notes.append(p.notes)  # the checks on hand-given values, e.g. an oversubscribed KV cache
    basis = (
        "card x util - model-use"
        if p.kv_basis is KvBasis.MODEL_USE
        else "the engine's own KV log line"
    )
    figures = ", ".join(f"{k} {v:g}" for k, v in p.figures.items())
    header = [
        *([f"run {p.run_id or '-'}: {opts.status}"] if opts.status else []),
        f"model {p.model} ({p.weights_format}) from {model_path}",
        f"card {p.card_gib} GiB; layout TP{p.tp} x PP{p.pp} on {p.nodes} node(s), "
        f"{p.cards_per_node} card(s) per node",
        f"KV cache {p.kv_gib:.2f} GiB/card = {p.kv_tokens:,} tokens at "
        f"{p.kv_bytes_per_token:,} B/token, block {p.block_size} (from {basis})",
        f"figures ({tag}): {figures or 'none beyond the KV cache'}",
        f"source: {p.source}",
        f"preset {p.name}; run {p.run_id or '-'}; rendered by pretuner {__version__} "
        f"for vLLM-MindSpore {engine_version}",
        f"re-tune: pretuner run --model {p.model} --card {p.card_gib} --tp {p.tp} "
        f"--max-model-len {p.max_model_len}, then pretuner script RUN_DIR",
        *notes,
    ]
    head_argv = list(argv)
    if "distributed_executor_backend" not in flags:
        head_argv += ["--distributed-executor-backend", "ray"]
    return {
        "header": [one_line(h) for h in header],
        "secret_checks": secrets.checks,
        "secret_env_checks": secrets.env_checks,
        "simulated": p.kind is PresetKind.SIMULATED,
        "env": env,
        "argv": argv,
        "head_argv": head_argv,
        "config": {k.replace("_", "-"): v for k, v in flags.items()},
        "model_path": model_path,
        "nodes": p.nodes,
        "expected_npus": p.nodes * p.cards_per_node,
        "ray_resource": "NPU",
        "ray_port": opts.ray_port,
        "head_ip": opts.head_ip or "",
        "env_path": f"{opts.install_dir.rstrip('/')}/tuned.env",
        "unit_description": one_line(f"vLLM-MindSpore serving {p.model} (preset {p.name})"),
    }


def _check_line(var: str, what: str) -> str:
    """A shell line that stops the script, naming the variable, when a secret is not exported."""
    return f': "${{{var}:?export {var} ({what}); pretuner never writes a secret}}"'
