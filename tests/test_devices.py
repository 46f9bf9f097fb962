"""Device memory readers: parsers on verbatim outputs, readers on real (fake) commands."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest

from pretuner.devices import DeviceMemory, DeviceReadError, select_reader
from pretuner.devices.npu_smi import NpuSmiReader, npu_memory
from pretuner.devices.nvidia import (
    NvidiaSmiReader,
    parse_nvidia_smi_csv,
    parse_nvml_series,
    series_peaks,
)
from pretuner.sim.memory import PROFILES
from pretuner.sim.npusmi import render, write_shim
from pretuner.sim.reader import EmulatedReader
from pretuner.sim.state import DeviceUse, Published
from tests.helpers import shared

NVML_SERIES = ("real-logs", "vllm-0.24-h100", "nvml-series.tsv")

# `nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`
NVIDIA_SMI_CSV = "0, 76152, 81559\n1, 4, 81559\n2, [N/A], [N/A]\n"


def executable(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (NVIDIA_SMI_CSV, (DeviceMemory(0, 76152, 81559), DeviceMemory(1, 4, 81559))),
        ("", ()),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", ()),
        ("0, 1" + "0" * 20 + ", 81559\n", ()),
    ],
)
def test_parse_nvidia_smi_csv(text: str, expected: tuple[DeviceMemory, ...]) -> None:
    assert parse_nvidia_smi_csv(text) == expected


def test_parse_real_nvml_series() -> None:
    points = parse_nvml_series(shared(*NVML_SERIES).read_text(encoding="utf-8"))
    assert len(points) == 1181
    assert points[0].phase == "idle"
    assert points[0].run is None
    assert points[0].used_mib == 480
    assert points[1].run == "A-util090"
    assert points[1].phase == "start"
    peaks = series_peaks(points)
    assert set(peaks) == {"idle", "start", "probe", "load-full", "stop"}
    assert max(peaks.values()) <= 81559  # the H100's total as NVML reports it
    assert peaks["idle"] == 480


def test_parse_nvml_series_skips_garbage() -> None:
    text = "1.5\trun:start\t100\nnot a row\n2.0\tidle\tNaN\nx\tidle\t5\n2.5\tstop\t90\n"
    assert [(p.phase, p.used_mib) for p in parse_nvml_series(text)] == [
        ("start", 100), ("stop", 90)
    ]


def test_npu_memory_from_the_emulated_table() -> None:
    profile = PROFILES["910b-64"]
    text = render(profile, [DeviceUse(0, 40000, ((7, 37000),)), DeviceUse(1, 3000)])
    found = npu_memory(text)
    assert found == (DeviceMemory(0, 40000, profile.total_mib),
                     DeviceMemory(1, 3000, profile.total_mib))


def test_npu_smi_reader_runs_the_emulated_npu_smi(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRETUNER_SIM_STATE_DIR", str(tmp_path / "card"))
    monkeypatch.setenv("PRETUNER_SIM_PROFILE", "910b-32")
    shim = write_shim(tmp_path / "bin", sys.executable)
    sample = NpuSmiReader(str(shim), frozenset({1})).sample()
    profile = PROFILES["910b-32"]
    assert sample is not None
    assert sample.devices == (DeviceMemory(1, profile.driver_reserved_mib, profile.total_mib),)


def test_command_readers_raise_on_failure(tmp_path: Path) -> None:
    failing = executable(tmp_path / "broken", "exit 3\n")
    with pytest.raises(DeviceReadError, match="code 3"):
        NpuSmiReader(str(failing)).sample()
    with pytest.raises(DeviceReadError, match="code 3"):
        NvidiaSmiReader(str(failing)).sample()
    with pytest.raises(DeviceReadError):
        NvidiaSmiReader(str(tmp_path / "missing")).sample()


def test_nvidia_smi_reader(tmp_path: Path) -> None:
    fake = executable(tmp_path / "nvidia-smi", f"printf '{NVIDIA_SMI_CSV}'\n")
    sample = NvidiaSmiReader(str(fake), frozenset({0})).sample()
    assert sample is not None
    assert sample.worst_used_mib == 76152


def test_emulated_reader_reads_the_card_in_process(tmp_path: Path) -> None:
    state = tmp_path / "card"
    state.mkdir()
    profile = PROFILES["910b-64"]
    Published().hold(state, "npu", 0, 1, 50000 - profile.driver_reserved_mib)
    env = {"PRETUNER_SIM_STATE_DIR": str(state), "PRETUNER_SIM_PROFILE": "910b-64"}
    sample = EmulatedReader(env, frozenset({0, 1})).sample()
    assert sample is not None
    assert [d.device for d in sample.devices] == [0, 1]
    assert sample.worst_used_mib == 50000
    assert sample.devices[0].used_mib == profile.driver_reserved_mib


def test_select_reader(tmp_path: Path) -> None:
    empty = {"PATH": str(tmp_path)}
    reader = select_reader("emulated", empty, 2)
    assert reader is not None
    assert reader.name == "emulated"
    assert select_reader("ascend", empty) is None
    assert select_reader("cpu", empty) is None
    executable(tmp_path / "nvidia-smi", "true\n")
    executable(tmp_path / "npu-smi", "true\n")
    cuda = select_reader("cuda", {**empty, "CUDA_VISIBLE_DEVICES": "3,5"}, 1)
    assert cuda is not None
    assert cuda.name in ("nvml", "nvidia-smi")
    ascend = select_reader("ascend", empty, 2)
    assert isinstance(ascend, NpuSmiReader)
    assert ascend.devices == frozenset({0, 1})


def test_the_emulated_card_is_read_where_its_engine_is_told_to_run() -> None:
    """The emulated card's reader reads the devices the engine's variable lists (a Ray task's
    own GPUs), as NVML does: a run beside another on the same card reads its own GPU."""
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    told = select_reader("emulated", env, 1, visible_var="CUDA_VISIBLE_DEVICES")
    assert getattr(told, "devices", None) == frozenset({3})
    assert getattr(select_reader("emulated", env, 2), "devices", None) == frozenset({0, 1})


def test_select_reader_cpu_budget_and_attach() -> None:
    """On CPU the device is the budget imposed on the server: a reader only with a budget, and
    it follows the launch it is attached to; a card reader ignores `attach`."""
    from pretuner.devices.base import attach
    from pretuner.devices.cpu import CpuBudgetReader

    cpu = select_reader("cpu", {}, 1, budget_mib=2048)
    assert isinstance(cpu, CpuBudgetReader)
    assert cpu.sample() is None  # nothing attached: nothing of the server to read
    attach(cpu, os.getpid())
    assert cpu.session == os.getpid()
    card = NvidiaSmiReader("nvidia-smi", None)
    attach(card, 1)  # no hook: nothing happens
    attach(None, 1)
    with pytest.raises(ValueError, match="positive"):
        CpuBudgetReader(0)


def test_emulated_reader_reads_the_cuda_card_in_process(tmp_path: Path) -> None:
    from pretuner.sim.v1.memory import CUDA_PROFILES
    state = tmp_path / "gpus"
    Published().hold(state, "cuda", 0, 1, 75000)
    dead = '{"pid": 999999999, "shown_pid": 999999999, "process_mib": 9}'
    (state / "cuda-node0-dev0-pid999999999.json").write_text(dead)
    env = {"PRETUNER_SIM_STATE_DIR": str(state), "PRETUNER_SIM_PROFILE": "h100-80",
           "PRETUNER_SIM_OCCUPIED_MIB": "100"}
    sample = EmulatedReader(env, frozenset({0, 1})).sample()
    profile = CUDA_PROFILES["h100-80"]
    assert sample is not None
    assert [d.device for d in sample.devices] == [0, 1]
    assert sample.devices[0].used_mib == profile.idle_mib + 100  # the dead pid is ignored
    assert sample.devices[1].used_mib == profile.idle_mib + 100 + 75000
    assert sample.devices[1].total_mib == profile.nvml_total_mib == 81559


def test_a_killed_servers_file_does_not_pass_to_a_process_given_its_pid(tmp_path: Path) -> None:
    # A server killed with SIGKILL leaves its state file. When the kernel gives its pid to a
    # later process (here: this one, started later than the file says), the card must not
    # show the dead server's 142,427 MiB: an emulated run once derived its non-KV peak from a
    # card clamped full by such a file. A file written by the live process itself still counts.
    from pretuner.procgroups import start_ticks
    from pretuner.sim.state import read_devices

    ticks = start_ticks(os.getpid())
    assert ticks is not None
    state = tmp_path / "gpus"
    state.mkdir()
    for device, written_at in ((0, ticks - 1), (1, ticks)):
        (state / f"cuda-node0-dev{device}-pid{os.getpid()}.json").write_text(
            f'{{"pid": {os.getpid()}, "shown_pid": {os.getpid()}, "process_mib": 142427, '
            f'"start_ticks": {written_at}}}')
    used = [d.used_mib for d in read_devices(state, "cuda", 0, 2, idle_mib=615)]
    assert used == [615, 615 + 142_427]


@pytest.mark.parametrize("fmt", ["csv,noheader,nounits", "csv"])
def test_emulated_nvidia_smi_csv_parses(tmp_path: Path, fmt: str,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from pretuner.sim.v1.smi import main

    Published().hold(tmp_path, "cuda", 0, 0, 75672)
    monkeypatch.setenv("PRETUNER_SIM_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("PRETUNER_SIM_PROFILE", "h100-80")
    monkeypatch.delenv("PRETUNER_SIM_OCCUPIED_MIB", raising=False)
    assert main(["--query-gpu=index,memory.used,memory.total", f"--format={fmt}"]) == 0
    out = capsys.readouterr().out
    if fmt == "csv":
        assert out.splitlines()[0] == "index, memory.used [MiB], memory.total [MiB]"
        assert "0, 76152 MiB, 81559 MiB" in out
    else:
        gpus = parse_nvidia_smi_csv(out)
        assert gpus[0] == DeviceMemory(0, 76152, 81559)
        assert len(gpus) == 8
    assert main([]) == 0
    assert "76152MiB / 81559MiB" in capsys.readouterr().out


class _FakeNvml:
    """The slice of pynvml the reader uses, over fixed figures (bytes, as NVML reports)."""

    class NVMLError(Exception):
        pass

    def __init__(self, used_total_mib: list[tuple[int, int]], fail: bool = False) -> None:
        self.cards = used_total_mib
        self.fail = fail

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml's names
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:  # noqa: N802
        if self.fail:
            raise self.NVMLError("GPU is lost")
        used, total = self.cards[handle]
        return types.SimpleNamespace(used=used * 2**20, total=total * 2**20, free=0)


def test_nvml_reader_reads_the_devices_asked_for() -> None:
    from pretuner.devices.nvidia import NvmlReader

    reader = NvmlReader(_FakeNvml([(480, 81559), (76152, 81559), (1000, 81559)]),
                        frozenset({1, 7}))
    sample = reader.sample()
    assert sample is not None
    assert [(d.device, d.used_mib, d.total_mib) for d in sample.devices] == [(1, 76152, 81559)]


def test_nvml_reader_errors_become_device_read_errors() -> None:
    from pretuner.devices.base import DeviceReadError
    from pretuner.devices.nvidia import NvmlReader

    reader = NvmlReader(_FakeNvml([(480, 81559)], fail=True))
    with pytest.raises(DeviceReadError, match="GPU is lost"):
        reader.sample()
