"""V1 engine presets (kv_basis pinned) and their startup files, without launching anything:
the JSON form, the check against the KV math, and the pure pieces of the V1 script context."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pretuner.deploy.context import ScriptOptions, layout_flags, node_env
from pretuner.deploy.render import render_scripts
from pretuner.deploy.targets import Target
from pretuner.engines.vllm_v1 import ROWS
from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens
from pretuner.models import resolve
from pretuner.presets.catalog import derivation_lines, kv_words
from pretuner.presets.model import (
    KvBasis,
    Preset,
    builtin_presets,
    check_preset,
    config_entries,
    preset_from_dict,
    preset_from_report,
    preset_to_json,
    split_command,
)
from pretuner.redact import SecretArg
from pretuner.report.records import PinnedDerivation, RunReport, read_report

R01_WORDS = ("ASCEND_TOTAL_MEMORY_GB", "vLLM_MODEL_MEMORY_USE_GB", "model-use", "MODEL_MEMORY")
KV = 12 * 2**30 + 12345  # not a whole number of blocks: the engine floors it


def v1_preset(
    engine: str = "vllm", *, tp: int = 8, pp: int = 2, nodes: int = 2, **extra: Any
) -> Preset:
    """A hand-written pinned preset that agrees with the math (no run's flags: the engine's)."""
    bpt = kv_bytes_per_token(resolve("qwen3-8b"), tp=tp, pp=pp)
    block = ROWS[engine].default_block_size
    data: dict[str, Any] = {
        "name": f"qwen3-8b-tp{tp}-pp{pp}-{engine}",
        "kind": "published",
        "model": "qwen3-8b",
        "model_path": "Qwen/Qwen3-8B",
        "card_gib": 80,
        "tp": tp,
        "pp": pp,
        "nodes": nodes,
        "cards_per_node": tp * pp // nodes,
        "weights_format": "bf16",
        "kv_cache_dtype": "auto",
        "engine": engine,
        "engine_version": None,
        "env": {},
        "flags": {
            "max_model_len": 32768,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 8192,
            "block_size": block,
        },
        "kv_bytes_per_token": bpt,
        "kv_basis": "pinned",
        "kv_gib": round(KV / 2**30, 2),
        "kv_tokens": kv_tokens(KV, bpt, block),
        "date": "-",
        "source": "test",
        "kv_cache_memory_bytes": KV,
    } | extra
    return preset_from_dict(data, "test")


H200 = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200" / "run8k"
FLAGS = ["--max-model-len", "32768", "--kv-cache-memory-bytes", "64084770816"]


def v1_record() -> RunReport:
    """A V1 run's record (a real run's, made an emulated one's: the fields presets read)."""
    base = read_report(H200)
    assert isinstance(base, RunReport)
    assert isinstance(base.derivation, PinnedDerivation)
    return base.model_copy(update={
        "run_id": "r1", "simulated": True, "provenance": "simulated", "model_arg": "qwen3-8b",
        "card_gib": 80, "validated": True,
        "final": base.final.model_copy(update={
            "kv_tokens": 434592, "max_model_len": 32768, "max_num_seqs": 256,
            "max_num_batched_tokens": 8192, "flags": FLAGS, "env": {},
            "serve_command": ["/py", "-m", "pretuner.sim", "vllm", "serve", "qwen3-8b", *FLAGS],
            "engine_serve_command": ["vllm", "serve", "Qwen/Qwen3-8B", *FLAGS]}),
        "derivation": base.derivation.model_copy(update={"kv_cache_memory_bytes": 64084770816}),
    })


REPORT = v1_record()


@pytest.mark.parametrize(
    ("command", "flags", "want"),
    [
        pytest.param(["vllm", "serve", "M", "--x", "1"], ["--x", "1"], (["vllm", "serve"], "M"),
                     id="vllm-serve"),
        pytest.param(["prlimit", "--data=9", "py", "-m", "api", "--model", "M"], [],
                     (["prlimit", "--data=9", "py", "-m", "api", "--model"], "M"), id="cpu"),
    ],
)  # fmt: skip
def test_split_command(
    command: list[str], flags: list[str], want: tuple[list[str], str]
) -> None:
    assert split_command(command, flags) == want


def test_split_command_refuses_a_command_without_its_flags() -> None:
    with pytest.raises(BadInputError, match="does not end with its flags"):
        split_command(["vllm", "serve", "M", "--x", "2"], ["--x", "1"])


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        pytest.param(["--kv-cache-memory-bytes", "123", "--max-num-seqs", "4"],
                     {"kv-cache-memory-bytes": 123, "max-num-seqs": 4}, id="ints"),
        pytest.param(["--enforce-eager", "--gpu-memory-utilization", "0.95"],
                     {"enforce-eager": True, "gpu-memory-utilization": 0.95}, id="switch-float"),
        pytest.param(["--load-format=dummy"], {"load-format": "dummy"}, id="inline"),
        pytest.param(["--enforce-eager", "--a", "1"], {"enforce-eager": True, "a": 1},
                     id="switch-then-flag"),
        pytest.param(["--ab", "1"], {"ab": 1}, id="prefix-is-not-the-flag"),
        pytest.param([], {}, id="absent"),
        pytest.param(["--api-key", SecretArg("", "PRETUNER_API_KEY", "--api-key"), "--x", "1"],
                     {"x": 1}, id="secret-left-out"),
    ],
)  # fmt: skip
def test_config_entries(flags: list[str | SecretArg], want: dict[str, Any]) -> None:
    assert config_entries(flags) == want


@pytest.mark.parametrize(
    ("tp", "pp", "nodes", "flags", "want"),
    [
        pytest.param(1, 1, 1, ["--x", "1"], ["--x", "1"], id="single-card"),
        pytest.param(2, 1, 1, ["--tensor-parallel-size", "2"], ["--tensor-parallel-size", "2"],
                     id="tp-kept"),
        pytest.param(8, 2, 2, [], ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
                                   "--distributed-executor-backend", "ray"], id="two-nodes"),
        pytest.param(8, 1, 2, ["--distributed-executor-backend", "mp"],
                     ["--distributed-executor-backend", "mp", "--tensor-parallel-size", "8"],
                     id="backend-kept"),
    ],
)  # fmt: skip
def test_layout_flags(
    tp: int, pp: int, nodes: int, flags: list[str], want: list[str]
) -> None:
    p = dataclasses.replace(v1_preset(), tp=tp, pp=pp, nodes=nodes)
    assert layout_flags(flags, p) == want


@pytest.mark.parametrize(
    ("engine", "want"),
    [
        pytest.param("vllm", {"NCCL_SOCKET_IFNAME": "ens3", "GLOO_SOCKET_IFNAME": "ens3",
                              "CUDA_VISIBLE_DEVICES": "0,1"}, id="cuda"),
        pytest.param("vllm-ascend", {"HCCL_SOCKET_IFNAME": "ens3", "GLOO_SOCKET_IFNAME": "ens3",
                                     "ASCEND_RT_VISIBLE_DEVICES": "0,1"}, id="ascend"),
        pytest.param("vllm-mindspore", {"HCCL_SOCKET_IFNAME": "ens3",
                                        "GLOO_SOCKET_IFNAME": "ens3",
                                        "ASCEND_RT_VISIBLE_DEVICES": "0,1"}, id="mindspore"),
    ],
)  # fmt: skip
def test_node_env_names_the_nic_in_the_device_terms(engine: str, want: dict[str, str]) -> None:
    assert node_env(ROWS[engine], "ens3", 2) == want


def test_a_v1_report_becomes_a_pinned_preset_that_agrees_with_the_math() -> None:
    p = preset_from_report(REPORT, date="-")
    assert p.kv_basis is KvBasis.PINNED
    assert p.kind.value == "simulated"
    assert p.engine == "vllm"
    assert p.kv_cache_memory_bytes == 64084770816
    assert p.server_command == ["vllm", "serve"]  # the real engine's, not the emulator's
    assert p.model_path == "Qwen/Qwen3-8B"
    assert p.block_size == 16  # vLLM's default: the run passed no --block-size
    assert check_preset(p) == []
    assert preset_from_dict(preset_to_json(p), "x") == p


def test_a_measured_v1_report_keeps_its_own_command() -> None:
    rep = REPORT.model_copy(update={"simulated": False, "final": REPORT.final.model_copy(update={
        "serve_command": ["vllm", "serve", "/models/q", *FLAGS], "engine_serve_command": None})})
    p = preset_from_report(rep, name="mine", date="-")
    assert (p.name, p.kind.value, p.model_path) == ("mine", "measured", "/models/q")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param({"kv_tokens": 434592 + 16}, "holds 434,592", id="tokens"),
        pytest.param({"kv_cache_memory_bytes": 64084770816 // 2}, "holds", id="bytes"),
        pytest.param({"kv_gib": 60.5}, "kv_gib", id="gib"),
        pytest.param({"kv_tokens": 434593}, "whole blocks", id="not-blocks"),
    ],
)
def test_check_rejects_a_tampered_pinned_preset(change: dict[str, Any], says: str) -> None:
    data = preset_to_json(preset_from_report(REPORT, date="-")) | change
    problems = check_preset(preset_from_dict(data, "x"))
    assert any(says in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param({"kv_tokenz": 1}, "unknown preset key", id="unknown-key"),
        pytest.param({"engine": "vllm-mindspore-r01"}, "takes no --kv-cache-memory-bytes",
                     id="r01-engine"),
        pytest.param({"kv_cache_memory_bytes": None}, "not a positive integer", id="no-bytes"),
        pytest.param({"env": {"vLLM_MODEL_MEMORY_USE_GB": "50"}}, "r0.1", id="r01-var"),
        pytest.param({"server_flags": "--x 1"}, "list of strings", id="flags-not-a-list"),
        pytest.param({"kv_basis": "model-use"}, "flags lack 'gpu_memory_utilization'",
                     id="r01-basis"),
    ],
)  # fmt: skip
def test_json_form_rejects_bad_pinned_presets(change: dict[str, Any], says: str) -> None:
    data = preset_to_json(preset_from_report(REPORT, date="-")) | change
    with pytest.raises(BadInputError, match=says):
        preset_from_dict(data, "x")


def test_v1_keys_stay_off_other_presets() -> None:
    p = builtin_presets()[0]
    assert "kv_cache_memory_bytes" not in preset_to_json(p)  # old files round-trip unchanged
    with pytest.raises(BadInputError, match="go with kv_basis 'pinned' only"):
        preset_from_dict(preset_to_json(p) | {"kv_cache_memory_bytes": 1}, "x")


def test_show_words_for_a_pinned_preset() -> None:
    p = preset_from_report(REPORT, date="-")
    assert kv_words(p) == "59.68 GiB pinned"
    assert any("--kv-cache-memory-bytes 64084770816" in line for line in derivation_lines(p))


def test_two_node_ray_files_speak_vllm() -> None:
    p = v1_preset()
    assert check_preset(p) == []
    files = render_scripts(p, ScriptOptions(nic="ens3", head_ip="10.0.0.1"), [Target.ALL])
    assert {"ray-head.sh", "ray-worker.sh"} <= set(files)  # all: Ray for a multi-node preset
    head, worker = files["ray-head.sh"], files["ray-worker.sh"]
    want = ["vllm", "serve", "Qwen/Qwen3-8B", "--max-model-len", "32768", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "8192", "--kv-cache-memory-bytes", str(KV),
            "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
            "--distributed-executor-backend", "ray"]  # fmt: skip
    exec_line = next(x for x in head.splitlines() if x.startswith("exec "))
    assert shlex.split(exec_line) == ["exec", *want, "$@"]
    assert "ray start --head --port=6379" in head
    assert 'ray start --address="$head_ip:"6379' in worker
    assert "default_head=10.0.0.1" in worker
    assert "GPU" in head
    assert "NPU" not in head
    for text in (head, worker):  # the NIC is exported before `ray start`
        lines = text.splitlines()
        start = next(i for i, x in enumerate(lines) if x.startswith("ray start"))
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            assert lines.index(f"export {var}=ens3") < start
        assert "export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in lines
        assert "HCCL_SOCKET_IFNAME" not in text
    serve = files["serve.sh"]
    assert "--distributed-executor-backend ray" in serve
    assert 'distributed-executor-backend: "ray"' in files["vllm-config.yaml"]
    for name, text in files.items():
        for word in R01_WORDS:
            assert word not in text, (name, word)
        if name.endswith(".sh"):
            subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_ascend_ray_files_export_hccl() -> None:
    files = render_scripts(v1_preset("vllm-ascend"), ScriptOptions(nic="enp1"), [Target.RAY])
    head = files["ray-head.sh"]
    assert "export HCCL_SOCKET_IFNAME=enp1" in head
    assert "export GLOO_SOCKET_IFNAME=enp1" in head
    assert "NCCL_SOCKET_IFNAME" not in head
    assert "? NPU'" in head
    assert "--block-size" not in head  # 128 is vllm-ascend's default


def test_engine_version_is_refused_for_a_v1_preset() -> None:
    with pytest.raises(BadInputError, match="engine comes from the preset"):
        render_scripts(v1_preset(), ScriptOptions(engine_version="0.5"), [Target.SERVE])


def test_an_r01_variable_given_with_env_is_refused() -> None:
    opts = ScriptOptions(extra_env={"ASCEND_TOTAL_MEMORY_GB": "64"})
    with pytest.raises(BadInputError, match="r0.1"):
        render_scripts(v1_preset(), opts, [Target.ENV])


def test_the_catalog_shows_a_pinned_preset() -> None:
    from pretuner.presets.catalog import catalog_markdown

    text = catalog_markdown((v1_preset(),))
    assert f"--kv-cache-memory-bytes {KV}" in text
    assert "ray-head.sh" in text  # a two-node preset starts on the head node
    for word in R01_WORDS:
        assert word not in text
