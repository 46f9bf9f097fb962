"""`pretuner script --model M --card ...`: scripts from values a user tuned by hand."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pretuner.deploy.given import GivenValues, preset_from_values
from pretuner.presets.model import PresetKind, check_preset, get_preset
from tests.helpers import invoke

# The DeepSeek-R1 W8A8 production deployment (2 nodes x 8 x 64 GB, TP16).
R1 = [
    "--model", "deepseek-r1", "--card", "64", "--tp", "16", "--nodes", "2", "--util", "0.93",
    "--model-use-gb", "53", "--max-model-len", "32768", "--max-num-seqs", "192",
    "--max-num-batched-tokens", "16384", "--block-size", "32", "--weights-format", "w8a8",
]  # fmt: skip
QWEN = [
    "--model", "qwen3-8b", "--card", "64", "--tp", "1", "--util", "0.9", "--model-use-gb", "30",
    "--max-model-len", "16384", "--max-num-seqs", "8", "--max-num-batched-tokens", "16384",
    "--block-size", "16",
]  # fmt: skip
FILES = {
    "serve.sh", "tuned.env", "vllm-config.yaml", "ray-head.sh", "ray-worker.sh",
    "pretuner-serve.service",
}  # fmt: skip


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return invoke("script", *args)


def _with(base: list[str], flag: str, value: str) -> list[str]:
    out = list(base)
    out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize("version", ["0.1", "0.5"])
@pytest.mark.parametrize("values", [R1, QWEN], ids=["r1-2nodes", "qwen-1card"])
def test_every_target_from_values(tmp_path: Path, values: list[str], version: str) -> None:
    out = tmp_path / "serve"
    targets = [w for t in ("serve", "env", "config", "ray", "systemd") for w in ("--target", t)]
    res = _script(*values, *targets, "--engine-version", version, "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert {p.name for p in out.iterdir()} == FILES
    flags = dict(zip(values[::2], values[1::2], strict=True))
    for path in out.iterdir():
        text = path.read_text()
        # Every file's header carries the values given.
        assert f"card {flags['--card']} GiB, util {flags['--util']}, model-use" in text
        assert f"max-num-seqs {flags['--max-num-seqs']}," in text
        assert "given by hand, NOT measured" in text
        if path.suffix == ".sh" or path.name == "tuned.env":
            subprocess.run(["bash", "-n", str(path)], check=True)
    serve = (out / "serve.sh").read_text()
    assert f"--max-model-len {flags['--max-model-len']}" in serve
    assert f"--max-num-seqs {flags['--max-num-seqs']}" in serve
    assert f"--max-num-batched-tokens {flags['--max-num-batched-tokens']}" in serve
    assert f"--block-size {flags['--block-size']}" in serve
    assert f"--tensor-parallel-size {flags['--tp']}" in serve
    if version == "0.1":
        assert f"export vLLM_MODEL_MEMORY_USE_GB={flags['--model-use-gb']}" in serve
        assert f"export ASCEND_TOTAL_MEMORY_GB={flags['--card']}" in serve
    else:
        assert "--kv-cache-memory-bytes" in serve


def test_deepseek_r1_production_example() -> None:
    res = _script(*R1, "--target", "serve")
    assert res.returncode == 0, res.stderr
    header = [line for line in res.stdout.splitlines() if line.startswith("# ")]
    assert "# KV cache 6.52 GiB/card = 99,616 tokens at 70,272 B/token, block 32" in "\n".join(
        header
    )
    assert "# card 64 GiB; layout TP16 x PP1 on 2 node(s), 8 card(s) per node" in header
    assert any(
        "card 64 GiB, util 0.93, model-use 53 GiB, max-model-len 32768, max-num-seqs 192, "
        "max-num-batched-tokens 16384, block 32" in line
        for line in header
    )
    # 192 full-length sequences need far more than the cache: said, not refused.
    assert any("at most 3 full-length sequence(s) fit" in line for line in header)


def test_given_preset_matches_the_published_one() -> None:
    p = preset_from_values(
        GivenValues(
            model="deepseek-r1",
            card_gib=64,
            tp=16,
            util=0.93,
            model_use_gib=53,
            max_model_len=32768,
            max_num_seqs=192,
            max_num_batched_tokens=16384,
            block_size=32,
            nodes=2,
            weights_format="w8a8",
        )  # fmt: skip
    )
    published = get_preset("deepseek-r1-w8a8-tp16-2x8x64g")
    assert p.kind is PresetKind.GIVEN
    assert check_preset(p) == []
    for field in ("kv_bytes_per_token", "kv_tokens", "kv_gib", "cards_per_node", "flags"):
        assert getattr(p, field) == getattr(published, field), field


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_with(R1, "--model-use-gb", "60"), "--model-use-gb 60 leaves no KV cache"),
        (_with(R1, "--model-use-gb", "60"), "64 x 0.93 = 59.52 GiB"),
        (_with(R1, "--max-model-len", "131072"), "the most that fits is 99,616"),
        (_with(R1, "--max-num-batched-tokens", "200000"), "the most that fits is 99,616"),
        (_with(R1, "--model", "deepseek-r7"), "unknown model 'deepseek-r7'"),
        (_with(R1, "--util", "1.5"), "--util 1.5 is invalid"),
        (_with(R1, "--block-size", "0"), "--block-size 0 is invalid"),
        (_with(R1, "--nodes", "3"), "do not split evenly over 3 node(s)"),
        ([*R1, "--kv-cache-dtype", "int3"], "unknown KV cache dtype 'int3'"),
        (R1[:-4], "--model needs --block-size too"),
        ([*R1, "--preset", "deepseek-r1-w8a8-tp16-2x8x64g"], "give exactly one of RUN_DIR"),
        (["some-run-dir", *R1], "give exactly one of RUN_DIR"),
        ([], "give exactly one of RUN_DIR"),
        (["--preset", "deepseek-r1-w8a8-tp16-2x8x64g", "--card", "64"], "--card only go with"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input_exits_2(args: list[str], message: str) -> None:
    res = _script(*args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert message in lines[0]
    assert "Traceback" not in res.stderr
