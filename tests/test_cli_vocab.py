"""vLLM's own spelling on pretuner's command line: flag names, 32K, KV dtype names, --config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from pretuner.cli.vocab import KvDtype, human_int, human_minutes, kv_dtype, read_vllm_config
from pretuner.kvmath import KV_DTYPES
from tests.helpers import first_launch_line, invoke

V1_DRY = ("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--dry-run")


@pytest.mark.parametrize(("text", "value"), [
    ("32768", 32768), ("32K", 32768), ("32k", 32000), ("25.6k", 25600), ("1M", 1048576),
    ("2m", 2000000), (" 8K ", 8192), (4096, 4096),
])  # fmt: skip
def test_human_int_reads_what_vllm_reads(text: str | int, value: int) -> None:
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["3.5K", "abc", "-1", "1.25", "32 K", "1e3"])
def test_human_int_refuses_what_is_not_a_whole_count(text: str) -> None:
    with pytest.raises(typer.BadParameter, match=repr(text.strip())):
        human_int(text)


@pytest.mark.parametrize(("text", "minutes"), [
    ("90", 90.0), ("7.5", 7.5), ("90m", 90.0), ("1.5h", 90.0), ("2h30m", 150.0), ("2H", 120.0),
    ("0.5h15m", 45.0), (" 10m ", 10.0), (45, 45.0), (1.5, 1.5),
])  # fmt: skip
def test_soak_durations_read_as_minutes_bare_or_with_h_and_m(text: str | float,
                                                            minutes: float) -> None:
    # A bare number stays minutes, as --soak-minutes always read it; h and m may add up.
    assert human_minutes(text) == minutes


@pytest.mark.parametrize("text", ["", "abc", "1h30", "30m2h", "1.5.h", "-5", "1d", "h", "90 m"])
def test_a_duration_in_any_other_spelling_is_refused_with_the_forms_it_takes(text: str) -> None:
    with pytest.raises(typer.BadParameter, match="90 \\(minutes\\), 90m, 1.5h or 2h30m"):
        human_minutes(text)


def test_every_kv_dtype_pretuner_knows_is_offered_and_nothing_else() -> None:
    assert {kv_dtype(d) for d in KvDtype} == set(KV_DTYPES)
    assert kv_dtype("bfloat16") == "bf16"
    assert kv_dtype(KvDtype.FP8_E5M2) == "fp8_e5m2"


def test_vllm_flag_names_reach_the_server_command() -> None:
    proc = invoke(*V1_DRY, "--gpu-memory-utilization", "0.8", "-tp", "1",
                  "--max-model-len", "32K", "--max-num-batched-tokens", "16k",
                  "--kv-cache-dtype", "fp8_e4m3")
    assert proc.returncode == 0, proc.stderr
    assert "--gpu-memory-utilization 0.8" in proc.stdout
    assert "--max-model-len 32768" in proc.stdout
    assert "--max-num-batched-tokens 16000" in proc.stdout
    assert "--kv-cache-dtype fp8_e4m3" in proc.stdout


def test_plan_takes_the_same_names() -> None:
    proc = invoke("plan", "--model", "qwen3-8b", "--card", "64", "--tensor-parallel-size", "2",
                  "--pipeline-parallel-size", "1", "--max-model-len", "32K",
                  "--kv-cache-dtype", "bfloat16", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["tp"] == 2
    assert data["max_model_len"] == 32768


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--kv-cache-dtype", "garbage", "fp8_e4m3"),
    ("--max-model-len", "3.5K", "3.5k"),
    ("--max-model-len", "lots", "32K"),
])  # fmt: skip
def test_a_bad_value_is_a_usage_error_naming_the_fix(flag: str, value: str, says: str) -> None:
    proc = invoke(*V1_DRY, flag, value)
    assert proc.returncode == 2
    assert flag in proc.stderr
    assert says in proc.stderr


def test_config_file_gives_defaults_and_the_command_line_wins(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: qwen3-8b\nmax-model-len: 32K\ngpu_memory_utilization: 0.85\n"
                   "max-num-seqs: 64\nenforce-eager: true\nenable-prefix-caching: false\n")
    proc = invoke("run", "--engine", "vllm", "--emulate", "--config", str(cfg), "--max-num-seqs", "32",
                  "--dry-run")
    assert proc.returncode == 0, proc.stderr
    line = first_launch_line(proc.stdout)
    assert "--max-model-len 32768" in line
    assert "--gpu-memory-utilization 0.85" in line
    assert "--max-num-seqs 32" in line  # given on the command line: it wins
    assert "--enforce-eager" in line
    assert "--no-enable-prefix-caching" in line


@pytest.mark.parametrize(("text", "says"), [
    ("kv-cache-memory-bytes: 1000\n", "pretuner measures"),
    ("- 1\n- 2\n", "not the mapping"),
    ("max-model-len: [\n", "not YAML"),
])  # fmt: skip
def test_a_config_pretuner_cannot_honour_is_refused(tmp_path: Path, text: str, says: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    with pytest.raises(typer.BadParameter, match=says):
        read_vllm_config(cfg)
    proc = invoke("run", "--model", "qwen3-8b", "--config", str(cfg), "--dry-run")
    assert proc.returncode == 2
    assert "--config" in proc.stderr


def test_config_keys_the_r01_method_cannot_pass_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("enforce-eager: true\n")
    proc = invoke("run", "--model", "qwen3-8b", "--config", str(cfg), "--dry-run")
    assert proc.returncode == 2
    assert "--config" in proc.stderr
    assert "V1 engine" in proc.stderr


@pytest.mark.parametrize(("command", "record", "not_options"), [
    ("run", "pretuner.tune.options:RunOptions", {"as_json", "backend", "config", "dry", "resume"}),
    ("plan", "pretuner.tune.options:RunOptions", {"as_json", "kv_gib"}),
    ("analyze", "pretuner.analyze:AnalyzeConfig", {"as_json", "logs", "out"}),
    ("script", "pretuner.deploy.given:GivenValues", {
        "as_json", "engine_version", "env", "head_ip", "install_dir", "model_path", "nic", "out",
        "preset", "run_dir", "target"}),
])  # fmt: skip
def test_every_option_a_command_passes_on_by_name_is_a_field(
        command: str, record: str, not_options: set[str]) -> None:
    """Rule: `run`, `plan`, `analyze` and `script` build their config from their parameters by
    name (`cli.options.named`), which keeps only the names the record has: a parameter named
    otherwise would be dropped without a word and its flag would do nothing. Only these few
    are the command's own."""
    import dataclasses
    import importlib

    import typer

    from pretuner.cli import app

    module, _, name = record.partition(":")
    fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    found = group.get_command(None, command)  # type: ignore[arg-type]  # no context is needed
    assert found is not None
    params = {p.name for p in found.params}
    assert params - fields == not_options
