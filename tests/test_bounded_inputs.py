"""Issue 28 #6, #7, #10: what a user hands in is read once, typed and bounded, and every way it
can be wrong is one line on stderr with a documented exit code, never a traceback or a hang."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer

from pretuner.cli.vocab import read_vllm_config
from pretuner.engines.vllm_v1 import parse_server_args
from pretuner.errors import BadInputError
from pretuner.files import MAX_INPUT_BYTES
from pretuner.models.hf import spec_from_folder
from pretuner.tune.record import DiskFullError, folder_error
from tests.helpers import cli_env, invoke

REPORT_JSON = Path(__file__).parent / "golden" / "run" / "report.json"
V1_DRY = ("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--dry-run")
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}  # fmt: skip


def one_line_refusal(done: Any, code: int = 2) -> str:
    """The single stderr line of a refused command (exit `code`, no traceback)."""
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("pretuner: error: ")
    return str(line)


# -- --config: one typed parse ---------------------------------------------------------------


@pytest.mark.parametrize(("text", "says"), [
    # YAML's `true` is a bool, and Python's bool an int: it once reached vLLM as `True`.
    ("max-model-len: true\n", "max-model-len: true is not an integer or a string"),
    ("max_num_seqs: '64'\n", 'max-num-seqs: "64" is not an integer'),
    ("tensor-parallel-size: 2.5\n", "tensor-parallel-size: 2.5 is not an integer"),
    ("gpu-memory-utilization: yes\n", "gpu-memory-utilization: true is not an integer or a "
     "number"),
    ("enforce-eager: 1\n", "enforce-eager: 1 is not true or false"),
    ("model: [a, b]\n", 'model: ["a", "b"] is not a string'),
])  # fmt: skip
def test_a_config_value_of_the_wrong_type_is_refused_naming_key_and_type(
    tmp_path: Path, text: str, says: str
) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    with pytest.raises(typer.BadParameter, match=re.escape(says)):
        read_vllm_config(cfg)


def test_config_values_of_their_types_pass_as_typed(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-model-len: 32K\nmax-num-seqs: 8\ngpu-memory-utilization: 1\n"
                   "enforce-eager: false\nswap-space: 0.5\nblock-size: null\n"
                   "limit-mm-per-prompt: {image: 2}\n")
    defaults, _ = read_vllm_config(cfg)
    assert defaults == {"max_model_len": "32K", "max_num_seqs": 8, "util": 1,
                        "enforce_eager": False, "swap_space_gib": 0.5, "block_size": None,
                        "limit_mm_per_prompt": '{"image": 2}'}


def test_a_boolean_max_model_len_never_reaches_the_server(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-model-len: true\n")
    line = one_line_refusal(invoke(*V1_DRY, "--config", str(cfg)))
    assert "max-model-len: true is not an integer" in line


def test_an_unbalanced_quote_in_server_arg_is_one_line_exit_2() -> None:
    line = one_line_refusal(invoke(*V1_DRY, "--server-arg", "--chat-template 'x"))
    assert "--server-arg \"--chat-template 'x\" cannot be split" in line
    assert "balance the quotes" in line


# -- --config: bounded -----------------------------------------------------------------------


def _bomb(levels: int) -> str:
    """A billion laughs in YAML: each level nine aliases of the one before."""
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("make", "says"), [
    pytest.param(lambda p: p.write_text(_bomb(9)), "expands to more than 100,000 values",
                 id="alias-bomb"),
    pytest.param(lambda p: p.write_text("a: &a [*a, *a]\n"), "expands to",
                 id="self-alias"),
    pytest.param(lambda p: p.write_text("a: " + "[" * 50 + "]" * 50 + "\n"),
                 "nesting deeper than 32", id="nested"),
    pytest.param(lambda p: p.write_text("[" * 100_000),
                 "nests too deeply|maximum nesting depth", id="deep"),  # PyYAML's, libyaml's
    pytest.param(lambda p: p.write_bytes(b"# " + b"x" * MAX_INPUT_BYTES), "is over 1,024 KiB",
                 id="large"),
    pytest.param(lambda p: os.mkfifo(p), "is not a regular file", id="fifo"),
    pytest.param(lambda p: p.write_bytes(b"a: \xff\xfe\n"), "is not YAML", id="not-utf8"),
    pytest.param(lambda p: p.write_text("a: [\n  b\n c: d\n"), "is not YAML", id="bad-yaml"),
])  # fmt: skip
def test_a_config_that_would_not_end_is_refused_fast_on_one_line(
    tmp_path: Path, make: Any, says: str
) -> None:
    """A 1 KB alias bomb once grew past 7.9 GB; --config /dev/zero took 22 GB; a FIFO waits
    for a writer forever."""
    cfg = tmp_path / "serve.yaml"
    make(cfg)
    started = time.monotonic()
    with pytest.raises(typer.BadParameter, match=says) as caught:
        read_vllm_config(cfg)
    assert time.monotonic() - started < 5
    assert "\n" not in str(caught.value)


def test_config_dev_zero_is_one_line_exit_2() -> None:
    line = one_line_refusal(invoke(*V1_DRY, "--config", "/dev/zero"))
    assert "'/dev/zero' is not a regular file" in line


def test_a_config_path_with_an_overlong_name_is_one_line(tmp_path: Path) -> None:
    line = one_line_refusal(invoke(*V1_DRY, "--config", str(tmp_path / ("c" * 300))))
    assert "File name too long" in line


# -- config.json: bounded reading and bounded model arithmetic --------------------------------


def _folder(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


def _config(**changes: Any) -> str:
    return json.dumps({**QWEN3_8B, **changes})


@pytest.mark.parametrize(("text", "says"), [
    pytest.param(_config(vocab_size=10**400), "a number of 401 digits is beyond any config",
                 id="400-digits"),
    pytest.param(_config()[:-1] + ', "rope_theta": 1e400}', "the number 1e400 is not finite",
                 id="1e400"),
    pytest.param(_config()[:-1] + ', "eps": NaN}', "the number NaN is not finite", id="nan"),
    pytest.param(_config()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 "nests too deeply", id="deep"),
    pytest.param(_config()[:-1] + ', "x": "' + "y" * MAX_INPUT_BYTES + '"}', "is over 1,024 KiB",
                 id="large"),
])  # fmt: skip
def test_a_config_json_that_would_break_the_reader_is_refused(
    tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(BadInputError, match=says) as caught:
        spec_from_folder(_folder(tmp_path, text))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("changes", "says"), [
    # 10^12 layers or heads sent plan's layout search through billions of steps.
    ({"num_hidden_layers": 10**12}, "num_hidden_layers 1,000,000,000,000 is beyond any model"),
    ({"num_attention_heads": 10**12}, "num_attention_heads 1,000,000,000,000 is beyond any"),
    ({"hidden_size": 10**12}, "hidden_size 1,000,000,000,000 is beyond any model"),
    ({"num_hidden_layers": 4097}, "num_hidden_layers 4,097 is beyond any model (at most 4,096)"),
    ({"num_local_experts": 1 << 15}, "num_local_experts 32,768 is beyond any model"),
    ({"vocab_size": 1 << 25}, "vocab_size 33,554,432 is beyond any model"),
    # Each within its bound, together 10 T parameters: beyond any model too.
    ({"hidden_size": 65536, "num_hidden_layers": 100, "intermediate_size": 524288},
     "parameters is beyond any model (at most 10,000,000,000,000)"),
    # Sizes of 0 (or below) were accepted, or ended in a division by zero.
    ({"hidden_size": 0}, "hidden_size is 0; a model's sizes are above 0"),
    ({"vocab_size": 0}, "vocab_size is 0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
    ({"intermediate_size": -1}, "intermediate_size must be a non-negative integer, got -1"),
    ({"num_attention_heads": 8192}, "num_attention_heads 8,192 is beyond any model"),
    ({"num_attention_heads": 4096, "hidden_size": 2048},
     "num_attention_heads 4,096 is above hidden_size 2,048"),
])  # fmt: skip
def test_absurd_model_sizes_are_refused_naming_the_field(
    tmp_path: Path, changes: dict[str, int], says: str
) -> None:
    with pytest.raises(BadInputError, match=re.escape(says)):
        spec_from_folder(_folder(tmp_path, _config(**changes)))


@pytest.mark.parametrize("command", [
    ("plan", "--engine", "vllm", "--card", "80"),
    ("run", "--engine", "vllm", "--emulate", "--dry-run"),
])  # fmt: skip
def test_plan_and_run_refuse_10_to_the_12_heads_fast(tmp_path: Path, command: tuple[str, ...]
                                                     ) -> None:
    """Issue 28 #7: a V1 plan or run of a config.json with 10^12 heads never returned."""
    folder = _folder(tmp_path, _config(num_hidden_layers=10**12))
    started = time.monotonic()
    line = one_line_refusal(invoke(command[0], "--model", str(folder), *command[1:]))
    assert time.monotonic() - started < 30
    assert "num_hidden_layers 1,000,000,000,000 is beyond any model" in line


# -- files a run writes, and folders a user hands back ----------------------------------------


@pytest.mark.parametrize(("code", "says"), [
    (errno.ENOSPC, "No space left on device"),
    (errno.EFBIG, "File too large"),  # `ulimit -f`: a traceback before
])  # fmt: skip
def test_a_full_disk_and_a_file_size_limit_are_the_same_one_line(
    tmp_path: Path, code: int, says: str
) -> None:
    err = folder_error(OSError(code, os.strerror(code), str(tmp_path / "journal.jsonl")), tmp_path)
    assert isinstance(err, DiskFullError)
    assert says in str(err)
    assert "ulimit -f" in str(err)


def test_a_run_folder_removed_during_the_run_is_named(tmp_path: Path) -> None:
    gone = tmp_path / "run"
    err = folder_error(OSError(errno.ENOENT, "No such file or directory"), gone)
    assert isinstance(err, DiskFullError)
    assert f"the run folder {str(gone)!r} was removed during the run" in str(err)
    other = OSError(errno.EACCES, "Permission denied")
    assert folder_error(other, tmp_path) is other  # the folder is there: not ours to explain


@pytest.mark.parametrize(("flags", "says"), [
    (["--request-timeout", "1e10"], "--request-timeout 1e+10 s is above the limit of 604800 s"),
    (["--ready-timeout", "1e10"], "--ready-timeout 1e+10 s is above the limit"),
    (["--stop-grace", "1e10"], "--stop-grace 1e+10 s is above the limit"),
    (["--out", "o" * 300], "has a name over 255 bytes"),
    (["--out", f"runs/{'o' * 256}/r1"], "has a name over 255 bytes"),
])  # fmt: skip
def test_run_refuses_values_the_system_cannot_take(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    """`--request-timeout 1e10` overflowed the socket's timeout; a 300-character --out name
    failed in mkdir: tracebacks both."""
    done = invoke("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", *flags,
                  cwd=tmp_path)
    assert says in one_line_refusal(done)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("damage", "says"), [
    ("[" * 100_000, "is not valid JSON: maximum recursion depth"),
    ('{"schema_version": 2, "model": 5}', "is not a pretuner run record: "),
    ("", "is not valid JSON: Expecting value"),
])  # fmt: skip
@pytest.mark.parametrize("command", [("report",), ("script",), ("presets", "add")])
def test_report_script_and_presets_add_name_a_damaged_report_json(
    tmp_path: Path, damage: str, says: str, command: tuple[str, ...]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(damage)
    line = one_line_refusal(invoke(*command, str(run)))
    assert f"{str(run / 'report.json')!r} {says}" in line


def test_a_json_value_in_a_config_keeps_its_quotes(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("override-generation-config: '{\"temperature\": 0.5}'\n"
                   "hf-overrides: {rope_scaling: {type: \"a b\"}}\nserved-model-name: my model\n")
    _, extra = read_vllm_config(cfg)
    assert dict(parse_server_args(extra)) == {
        "--override-generation-config": '{"temperature": 0.5}',
        "--hf-overrides": '{"rope_scaling":{"type":"a b"}}', "--served-model-name": "my model"}


# -- the same, met by a real run ---------------------------------------------------------------

V1_RUN = ("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80")


def _pretuner(*args: str, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pretuner", *args], env=cli_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.slow
def test_a_file_size_limit_mid_run_is_one_line_like_a_full_disk(tmp_path: Path) -> None:
    """`ulimit -f` made the journal's write fail with EFBIG: a traceback before."""
    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = _pretuner(*V1_RUN, "--out", str(tmp_path / "r"), preexec_fn=small_files)
    _, err = proc.communicate(timeout=240)  # progress lines, then the error's one line
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert (f"pretuner: error: cannot write to the run folder {str(tmp_path / 'r')!r}: File too "
            "large") in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_run_folder_removed_mid_run_is_one_line(tmp_path: Path) -> None:
    run = tmp_path / "r"
    proc = _pretuner(*V1_RUN, "--out", str(run))
    deadline = time.monotonic() + 120
    while '"launch_started"' not in _text(run / "journal.jsonl"):
        assert proc.poll() is None, "the run ended before its first launch"
        assert time.monotonic() < deadline, "the run never launched"
        time.sleep(0.05)
    while run.exists():  # as `rm -rf` again would: the server may write a file meanwhile
        shutil.rmtree(run, ignore_errors=True)
        assert time.monotonic() < deadline, "the run folder could not be removed"
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert f"the run folder {str(run)!r} was removed during the run" in err.strip().splitlines()[-1]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_report_of_a_run_whose_memory_tsv_is_damaged_still_renders(tmp_path: Path) -> None:
    """A byte that is not UTF-8 in a launch's memory.tsv was a traceback of `report`."""
    run = tmp_path / "run"
    (run / "launch-1").mkdir(parents=True)
    shutil.copy(REPORT_JSON, run / "report.json")
    (run / "launch-1" / "memory.tsv").write_bytes(b"\xff\xfe\x00 not a row\n")
    done = invoke("report", str(run), "--out", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r.html").is_file()
