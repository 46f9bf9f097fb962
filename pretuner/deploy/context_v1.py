"""What the startup files say for a V1 engine preset (kv_basis pinned), decided in pure Python.

The KV cache is `--kv-cache-memory-bytes`; the server command is the one the run proved
(`Preset.server_command` + the model + `Preset.server_flags`), so none of vLLM-MindSpore r0.1's
variables appears. The templates are the same as r0.1's (`context.py`); only the words differ.
"""

from __future__ import annotations

from typing import Any

from pretuner import __version__
from pretuner.deploy.context import KIND_TAG, ScriptOptions, check_env_names, split_secrets
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.vllm_v1 import DEFAULT_UTIL, NIC_VARS, RAY_RESOURCE, ROWS, V1Engine, V1Row
from pretuner.errors import BadInputError
from pretuner.presets.model import R01_MEMORY_VARS, Preset, PresetKind
from pretuner.presets.v1 import flag_value
from pretuner.redact import SecretArg, one_line
from pretuner.units import GIB

KV_FLAG = "--kv-cache-memory-bytes"
RAY_BACKEND = ("--distributed-executor-backend", "ray")


def preset_flags(p: Preset, row: V1Row) -> list[str]:
    """The flags after the model: the run's own, or (a preset without them) what the engine
    deploys for the preset's values."""
    if p.server_flags is not None:
        return list(p.server_flags)
    settings = LaunchSettings(
        purpose=Purpose.VALIDATE,
        card_gib=p.card_gib,
        util=float(p.flags.get("gpu_memory_utilization", DEFAULT_UTIL)),
        model_use_gib=0,
        max_model_len=p.max_model_len,
        max_num_seqs=int(p.flags["max_num_seqs"]),
        max_num_batched_tokens=int(p.flags["max_num_batched_tokens"]),
        block_size=p.block_size,
        tp=p.tp,
        pp=p.pp,
        kv_cache_dtype=p.kv_cache_dtype,
        kv_cache_bytes=p.kv_cache_memory_bytes,
    )
    return V1Engine(row, simulated=False).deploy(settings).argv()


def layout_flags(flags: list[str], p: Preset) -> list[str]:
    """`flags` with the parallel sizes and, across nodes, the Ray executor, where missing."""
    out = list(flags)
    for name, size in (("--tensor-parallel-size", p.tp), ("--pipeline-parallel-size", p.pp)):
        if size > 1 and flag_value(out, name) is None:
            out += [name, str(size)]
    if p.nodes > 1 and flag_value(out, RAY_BACKEND[0]) is None:
        out += RAY_BACKEND
    return out


def config_entries(flags: list[str | SecretArg]) -> dict[str, Any]:
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


def node_env(row: V1Row, nic: str, cards: int) -> dict[str, str]:
    """What every node exports before `ray start`: the NIC in the device's terms, the cards."""
    env = {var: nic for var in NIC_VARS[row.device]}
    env[row.visible_devices_var] = ",".join(str(i) for i in range(cards))
    return env


def build_v1_context(p: Preset, opts: ScriptOptions) -> dict[str, Any]:
    """Every value the templates print for a pinned (V1 engine) preset."""
    row = ROWS[p.engine]
    if opts.engine_version is not None:
        raise BadInputError(
            f"--engine-version is for vLLM-MindSpore r0.1-family presets; {p.name} is a "
            f"{p.engine} configuration (the engine comes from the preset)",
            hint="drop --engine-version",
        )
    model_path = opts.model_path or p.model_path
    kv = p.kv_cache_memory_bytes or 0
    flags = layout_flags(preset_flags(p, row), p)
    if opts.command is not None:
        base = list(opts.command)
    else:
        base = [*(p.server_command or row.command), model_path, *flags]
    env = {**row.env, **p.env}
    if p.nodes > 1:
        env.update(node_env(row, opts.nic, p.cards_per_node))
    env = check_env_names(env, opts.extra_env)
    r01 = [k for k in R01_MEMORY_VARS if k in env]
    if r01:
        raise BadInputError(
            f"{r01[0]} is vLLM-MindSpore r0.1's; {p.engine} ignores it",
            hint=f"drop it: {KV_FLAG} sizes the KV cache",
        )
    secrets = split_secrets(base, env)
    notes = [
        f"KV cache pinned with {KV_FLAG} {kv} ({kv / GIB:.2f} GiB = {p.kv_tokens:,} tokens "
        "per card): the engine skips its own memory profiling",
        *secrets.notes,
    ]
    if p.kind is PresetKind.SIMULATED:
        notes.append(
            f"the figures are SIMULATED; the command is the real {p.engine}'s with the run's "
            "flags: run `pretuner run` on the real device to measure and prove them"
        )
    figures = ", ".join(f"{k} {v:g}" for k, v in p.figures.items())
    engine = f"{p.engine} {p.engine_version}" if p.engine_version else p.engine
    header = [
        *([f"run {p.run_id or '-'}: {opts.status}"] if opts.status else []),
        f"model {p.model} ({p.weights_format}) from {model_path}",
        f"card {p.card_gib} GiB; layout TP{p.tp} x PP{p.pp} on {p.nodes} node(s), "
        f"{p.cards_per_node} card(s) per node",
        f"KV cache {KV_FLAG} {kv} = {kv / GIB:.2f} GiB/card = {p.kv_tokens:,} tokens at "
        f"{p.kv_bytes_per_token:,} B/token, block {p.block_size} (pinned)",
        f"figures ({KIND_TAG[p.kind]}): {figures or 'none beyond the KV cache'}",
        f"source: {p.source}",
        f"preset {p.name}; run {p.run_id or '-'}; rendered by pretuner {__version__} for {engine}",
        f"re-tune: pretuner run --model {p.model} --engine {p.engine} --card {p.card_gib} "
        f"--tp {p.tp} --max-model-len {p.max_model_len}, then pretuner script RUN_DIR",
        *notes,
    ]
    argv = secrets.argv
    head_argv = list(argv)
    if flag_value([w for w in argv if isinstance(w, str)], RAY_BACKEND[0]) is None:
        head_argv += RAY_BACKEND
    return {
        "header": [one_line(h) for h in header],
        "secret_checks": secrets.checks,
        "secret_env_checks": secrets.env_checks,
        "simulated": p.kind is PresetKind.SIMULATED,
        "env": secrets.env,
        "argv": argv,
        "head_argv": head_argv,
        "config": config_entries(split_secrets(flags, {}).argv),
        "model_path": model_path,
        "nodes": p.nodes,
        "expected_npus": p.nodes * p.cards_per_node,
        # GPU, NPU or CPU: pretuner's own word, printed inside the scripts' quoted grep pattern.
        "ray_resource": RAY_RESOURCE[row.device],
        "ray_port": opts.ray_port,
        "head_ip": opts.head_ip or "",
        "env_path": f"{opts.install_dir.rstrip('/')}/tuned.env",
        "unit_description": one_line(f"{engine} serving {p.model} (preset {p.name})"),
    }
