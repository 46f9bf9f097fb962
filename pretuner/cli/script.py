"""`pretuner script`: startup scripts from a run record, a preset, or values tuned by hand."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

import pretuner.cli.options as o
from pretuner import validate as v
from pretuner.cli.app import app
from pretuner.cli.render import emit
from pretuner.deploy.targets import Target
from pretuner.errors import BadInputError

if TYPE_CHECKING:
    from pretuner.report.records import RunReport

# The presets and the templates are imported where they are used: `pretuner --help` and a
# usage error answer without loading them (tests/test_cli_startup.py).


def finished_run(run_dir: Path) -> RunReport:
    from pretuner.report.records import FailureReport, read_report

    rep = read_report(Path(run_dir))
    if isinstance(rep, FailureReport):  # the reason, no configuration
        reason = rep.error.partition("\n")[0]
        raise BadInputError(
            f"run {str(run_dir)!r} failed (exit {rep.exit_code}): {reason}",
            hint="a failed run has no configuration; see its report.md",
        )
    return rep


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise BadInputError(f"--env {item!r} lacks '='", hint="use --env KEY=VALUE")
        out[key] = value
    return out


@app.command(
    "script",
    short_help="Write serve.sh, tuned.env, YAML, Ray and systemd files.",
    epilog="""\b
Examples:
  pretuner script runs/<run> --out deploy/
  pretuner script --preset <name> --target serve --target systemd
  pretuner script --model qwen3-8b --card 64 --tp 1 --util 0.9 --model-use-gb 20 \\
      --max-model-len 16384 --max-num-seqs 17 --max-num-batched-tokens 16384 --block-size 16""",
)
def script_cmd(
    ctx: typer.Context,
    run_dir: Path | None = typer.Argument(
        None, metavar="RUN_DIR", help="A run folder with report.json."
    ),
    preset: str | None = typer.Option(
        None, "--preset", metavar="NAME|FILE",
        help="A preset name (or preset file) instead of a run.",
    ),
    target: list[Target] = typer.Option(
        [Target.ALL], "--target", metavar="TARGET",
        help="serve | env | config | ray | systemd | all (repeatable).",
    ),
    engine_version: str | None = typer.Option(
        None, "--engine-version", metavar="VERSION",
        help="vLLM-MindSpore version the scripts are for (0.1, 0.5...; default 0.1). Not for "
        "a V1 engine run or preset: it names its engine.",
    ),
    model_path: str | None = typer.Option(
        None, "--model-path", metavar="PATH", help="What the server loads."
    ),
    nic: str = typer.Option(
        "eth0", "--nic", metavar="NIC", help="Multi-node: the NIC between the nodes."
    ),
    head_ip: str | None = typer.Option(
        None, "--head-ip", metavar="ADDRESS", help="Multi-node: the head's address."
    ),
    install_dir: str = typer.Option(
        "/etc/pretuner", "--install-dir", metavar="DIR",
        help="Where the systemd unit finds tuned.env.",
    ),
    env: list[str] = typer.Option(
        [], "--env", metavar="KEY=VALUE", help="Extra KEY=VALUE to export (repeatable)."
    ),
    out: Path | None = typer.Option(
        None, "--out", metavar="DIR", help="Write the files here (default: print)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print {file name: content} as JSON (or, with --out, the paths)."
    ),
    model: str | None = typer.Option(
        None, "--model", metavar="MODEL",
        help="Values tuned by hand instead of a run: the model (with --card...).",
    ),
    card_gib: int | None = typer.Option(
        None, "--card", metavar="GIB", help="With --model: card memory in GiB."
    ),
    tp: int | None = typer.Option(
        None, "--tp", metavar="N", help="With --model: tensor parallel size."
    ),
    pp: int = typer.Option(1, "--pp", metavar="N", help="With --model: pipeline parallel size."),
    nodes: int = typer.Option(1, "--nodes", metavar="N", help="With --model: number of nodes."),
    util: float | None = typer.Option(
        None, "--util", metavar="FRACTION", help="With --model: --gpu-memory-utilization."
    ),
    model_use_gib: int | None = typer.Option(
        None, "--model-use-gb", metavar="GIB",
        help="With --model: vLLM_MODEL_MEMORY_USE_GB (whole GiB).",
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", metavar="TOKENS", help="With --model."
    ),
    max_num_seqs: int | None = typer.Option(
        None, "--max-num-seqs", metavar="N", help="With --model."
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", metavar="TOKENS", help="With --model."
    ),
    block_size: int | None = typer.Option(
        None, "--block-size", metavar="TOKENS", help="With --model."
    ),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype", metavar="DTYPE",
        help="With --model: auto|bf16|fp16|int8|fp8|fp8_e4m3|fp8_e5m2|int8-mla.",
    ),
    weights_format: str | None = typer.Option(
        None, "--weights-format", metavar="FORMAT",
        help="With --model: checkpoint format (bf16, w8a8...).",
    ),
) -> None:
    """Render serve.sh, tuned.env, a vLLM config YAML, Ray scripts and a systemd unit."""
    from pretuner.deploy.context import ScriptOptions
    from pretuner.deploy.given import GivenValues, preset_from_values
    from pretuner.deploy.render import render_scripts, run_scripts, write_scripts
    from pretuner.models import local_model_path
    from pretuner.presets.model import resolve_preset

    if util is not None:
        v.finite("--util", util, example="0.9")
    given = {"--card": card_gib, "--tp": tp, "--util": util, "--model-use-gb": model_use_gib,
             "--max-model-len": max_model_len, "--max-num-seqs": max_num_seqs,
             "--max-num-batched-tokens": max_num_batched_tokens, "--block-size": block_size}
    sources = [run_dir is not None, preset is not None, model is not None]
    if sum(sources) != 1:
        raise BadInputError(
            "give exactly one of RUN_DIR, --preset NAME or --model M (with the tuned values)",
            hint=f"{sum(sources)} given",
        )
    if model is not None:
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise BadInputError(
                f"--model needs {', '.join(missing)} too", hint="give every value you tuned"
            )
        p = preset_from_values(o.named(GivenValues, ctx.params))
    else:
        changed = {**{flag: value is not None for flag, value in given.items()},
                   "--pp": pp != 1, "--nodes": nodes != 1,
                   "--kv-cache-dtype": kv_cache_dtype != "auto",
                   "--weights-format": weights_format is not None}
        if extra := [flag for flag, on in changed.items() if on]:
            raise BadInputError(f"{', '.join(extra)} only go with --model", hint="drop them")
        if preset is not None:
            p = resolve_preset(preset)
    opts = ScriptOptions(
        engine_version=engine_version, nic=nic, head_ip=head_ip, install_dir=install_dir,
        # A folder by its absolute path: the scripts run from other folders.
        model_path=local_model_path(model_path) or model_path if model_path else None,
        extra_env=_env_pairs(env))
    if run_dir is not None:  # the files its folder holds
        files = run_scripts(finished_run(run_dir), opts, list(target))
    else:
        files = render_scripts(p, opts, list(target))
    if out is None:
        emit(as_json, {"files": files},
             "\n".join(f"==> {name} <==\n{text}" for name, text in files.items()))
        return
    written = write_scripts(files, out)
    emit(as_json, {"written": [str(path) for path in written]},
         "\n".join(str(path) for path in written))
