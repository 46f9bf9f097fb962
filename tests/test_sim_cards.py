"""The emulated CUDA cards people have, one row each: chosen by `--card` (GB), named in the
output, shown by the emulated nvidia-smi with the total NVML reports on the real card, and as
fast as the card's own figures say."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretuner.errors import BadInputError
from pretuner.models import lookup
from pretuner.sim.plugin import EMULATOR
from pretuner.sim.v1.smi import main as nvidia_smi
from pretuner.sim.v1.truth import decode_tokens_per_s

# What nvidia-smi prints on the real card (name, memory.total in MiB), by --card; the sources
# are beside the rows of pretuner/sim/v1/memory.py.
REAL = {
    40: ("NVIDIA A100-SXM4-40GB", 40960),
    48: ("NVIDIA L40S", 46068),
    80: ("NVIDIA H100 80GB HBM3", 81559),  # ../shared/real-logs/vllm-0.24-h100
    94: ("NVIDIA H100 NVL", 95830),
    96: ("NVIDIA H20", 97871),
    141: ("NVIDIA H200", 143771),  # tests/fixtures/real/vllm-0.24-h200
    180: ("NVIDIA B200", 183359),
}


@pytest.mark.parametrize(("card", "real"), REAL.items())
def test_card_picks_the_gpu_whose_nvidia_smi_prints_the_real_name_and_total(
        card: int, real: tuple[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in EMULATOR.launch_env("v1", card, 0, {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PRETUNER_SIM_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("PRETUNER_SIM_OCCUPIED_MIB", raising=False)
    query = ["--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits", "-i", "0"]
    assert nvidia_smi(query) == 0
    assert capsys.readouterr().out == f"0, {real[0]}, {real[1]}\n"
    assert nvidia_smi([]) == 0
    table = capsys.readouterr().out
    assert real[0] in table
    assert f"MiB / {real[1]}MiB" in table


@pytest.mark.parametrize(("card", "exported", "name"), [
    (141, {}, "emulated H200 141 GB"),
    (40, {}, "emulated A100 40 GB"),
    (None, {}, "emulated H100 80 GB"),  # no --card: the H100 the emulator is calibrated on
    (80, {}, "emulated H100 80 GB"),  # 80 GB is an H100 or an A100: the H100 unless told
    (80, {"PRETUNER_SIM_PROFILE": "a100-80"}, "emulated A100 80 GB"),
    (141, {"PRETUNER_SIM_PROFILE": "a100-80"}, "emulated H200 141 GB"),  # not 141 GB: ignored
    (80, {"PRETUNER_SIM_PROFILE": "910b-64"}, "emulated H100 80 GB"),  # an Ascend profile
])
def test_the_output_names_the_card_the_launch_gets(card: int | None, exported: dict[str, str],
                                                   name: str) -> None:
    assert EMULATOR.card_name(EMULATOR.launch_env("v1", card, 0, exported)) == name


def test_an_ascend_card_has_no_cuda_name_and_an_unknown_size_lists_the_sizes() -> None:
    assert EMULATOR.card_name(EMULATOR.launch_env("r01", 64, 0, {})) is None
    with pytest.raises(BadInputError, match="the emulated CUDA card has no 100 GB") as err:
        EMULATOR.launch_env("v1", 100, 0, {})
    assert err.value.hint == "use --card 180, 141, 96, 94, 80, 64, 48, 40, 32, 24, 20"


def test_each_card_runs_at_its_own_speed_and_has_its_own_host() -> None:
    # Decoding one sequence reads the weights once per token: the published memory bandwidths
    # order the cards (L40S 864 GB/s < A100 80GB 2.0 < H100 3.35 < H200 4.8 < B200 8 TB/s).
    spec = lookup("qwen3-8b")
    rates = [decode_tokens_per_s(spec, p) for p in
             ("l40s-48", "a100-80", "h100-80", "h200-141", "b200-180")]
    assert rates == sorted(rates)
    assert len(set(rates)) == len(rates)
    for profile in ("a100-40", "h20-96", "h100-nvl-94", "b200-180"):
        host = EMULATOR.host_memory({"PRETUNER_SIM_PROFILE": profile})
        assert host is not None
        assert 0 < host.available_bytes < host.total_bytes
