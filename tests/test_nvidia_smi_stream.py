"""The streaming nvidia-smi reader (`-lms 20`) against real processes: the emulated nvidia-smi,
and small scripts that print changing rows, die, hang or reject `-lms`."""

from __future__ import annotations

import gc
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pretuner.devices import DeviceMemory, DeviceReadError, nvidia, select_reader
from pretuner.devices.nvidia import NvidiaSmiStreamReader
from pretuner.procgroups import group_alive, group_members
from pretuner.sim.state import Published
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.sim.v1.smi import main as emulated_smi

MIB = 2**20


def script(path: Path, body: str, interpreter: str = "/bin/sh") -> Path:
    path.write_text(f"#!{interpreter}\n{body}", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def python_script(path: Path, body: str) -> Path:
    return script(path, body, sys.executable)


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def sample_until(reader: NvidiaSmiStreamReader, done: Callable[[], bool],
                 timeout_s: float = 10.0) -> None:
    """Sample as the sampler does (every 20 ms) until `done()`; a read error propagates."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        reader.sample()
        time.sleep(0.02)


@pytest.fixture
def readers() -> Iterator[list[NvidiaSmiStreamReader]]:
    """Readers a test makes; every one is closed after it, whatever happened."""
    made: list[NvidiaSmiStreamReader] = []
    yield made
    for reader in made:
        reader.close()


@pytest.fixture
def emulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `nvidia-smi` that runs the emulated one, over a fresh emulated H100 node."""
    monkeypatch.setenv("PRETUNER_SIM_STATE_DIR", str(tmp_path / "gpus"))
    monkeypatch.setenv("PRETUNER_SIM_PROFILE", "h100-80")
    monkeypatch.delenv("PRETUNER_SIM_OCCUPIED_MIB", raising=False)
    (tmp_path / "bin").mkdir()
    return script(tmp_path / "bin" / "nvidia-smi",
                  f'exec {shlex.quote(sys.executable)} -m pretuner.sim nvidia-smi "$@"\n')


def test_streams_the_emulated_nvidia_smi(tmp_path: Path, emulated: Path,
                                         readers: list[NvidiaSmiStreamReader]) -> None:
    profile = CUDA_PROFILES["h100-80"]
    Published().hold(tmp_path / "gpus", "cuda", 0, 1, 75000)
    reader = NvidiaSmiStreamReader(str(emulated), frozenset({1}))
    readers.append(reader)
    first = reader.sample()  # the first sample waits for the first block
    assert first is not None
    assert first.devices == (DeviceMemory(1, profile.idle_mib + 75000, profile.nvml_total_mib),)
    stream = reader._stream
    assert stream is not None
    assert stream.argv[-2:] == ["-lms", "20"]
    assert reader.looping
    Published().hold(tmp_path / "gpus", "cuda", 0, 1, 76000)  # the server grows

    def grown() -> bool:
        got = reader.sample()
        return got is not None and got.worst_used_mib == profile.idle_mib + 76000

    until(grown)
    assert stream.proc.poll() is None  # one process all along
    assert stream.rows >= 16  # several blocks of 8 GPUs
    pgid = stream.proc.pid
    reader.close()
    assert stream.proc.returncode == 0  # SIGTERM ends the emulated nvidia-smi quietly
    assert not group_alive(pgid)


def test_emulated_nvidia_smi_loops_until_sigint(tmp_path: Path, emulated: Path) -> None:
    proc = subprocess.Popen([str(emulated), "--query-gpu=index,memory.used",
                             "--format=csv,noheader,nounits", "--loop-ms=10", "-i", "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines == [f"0, {CUDA_PROFILES['h100-80'].idle_mib}\n"] * 3
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert err == ""


@pytest.mark.parametrize("args", [["-lms", "0"], ["-lms"], ["--loop-ms=x"], ["-l", "-1"]])
def test_emulated_nvidia_smi_rejects_a_bad_loop(args: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert emulated_smi(["--query-gpu=index", "--format=csv", *args]) == 2
    assert "positive whole number" in capsys.readouterr().err


# Blocks of two GPUs: two quiet ones, then (once told to go) GPU 1 spikes to 900 MiB and falls
# back to 200 MiB before the next sample.
SPIKE = """
import os, sys, time
print("0, 10, 1000\\n1, 100, 1000\\n0, 10, 1000\\n1, 100, 1000", flush=True)
while not os.path.exists(sys.argv[0] + ".go"):
    time.sleep(0.01)
print("0, 11, 1000\\n1, 900, 1000\\n0, 12, 1000\\n1, 200, 1000", flush=True)
time.sleep(60)
"""


def test_sample_keeps_the_highest_since_the_last_sample(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia, "STALE_GAP_S", 60.0)  # a slow CI machine is no gap
    fake = python_script(tmp_path / "nvidia-smi", SPIKE)
    reader = NvidiaSmiStreamReader(str(fake))
    readers.append(reader)
    first = reader.sample()  # waits for the first block: complete when the second starts
    assert first is not None
    assert first.devices == (DeviceMemory(0, 10, 1000), DeviceMemory(1, 100, 1000))
    stream = reader._stream
    assert stream is not None
    until(lambda: stream.rows == 4)
    reader.sample()  # what is left of the quiet blocks
    Path(f"{fake}.go").touch()
    until(lambda: stream.rows == 8)
    got = reader.sample()
    assert got is not None
    assert {d.device: d.used_mib for d in got.devices}[1] == 900  # not the 200 printed last
    assert reader.sample() is None  # nothing printed since
    assert stream.proc.poll() is None


def test_a_sample_after_a_long_gap_is_the_latest_rows(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample long after the previous one (between two launches) is not given a peak seen
    while nobody was measuring."""
    monkeypatch.setattr(nvidia, "STALE_GAP_S", 0.0)
    fake = python_script(tmp_path / "nvidia-smi", SPIKE)
    reader = NvidiaSmiStreamReader(str(fake), frozenset({1}))
    readers.append(reader)
    assert reader.sample() is not None
    stream = reader._stream
    assert stream is not None
    until(lambda: stream.rows == 4)
    reader.sample()
    Path(f"{fake}.go").touch()
    until(lambda: stream.rows == 8)
    got = reader.sample()
    assert got is not None
    assert got.devices == (DeviceMemory(1, 200, 1000),)


def test_close_stops_the_whole_group_even_one_ignoring_sigterm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia, "TERM_WAIT_S", 0.3)
    fake = script(tmp_path / "nvidia-smi", "trap '' TERM\nsleep 300 &\n"
                  "while :; do printf '0, 5, 100\\n'; sleep 0.02; done\n")
    reader = NvidiaSmiStreamReader(str(fake))
    sample = reader.sample()
    assert sample is not None
    assert sample.devices == (DeviceMemory(0, 5, 100),)
    stream = reader._stream
    assert stream is not None
    pgid = stream.proc.pid
    assert len(group_members(pgid)) >= 2  # the script and its sleep
    reader.close()
    assert not group_alive(pgid)
    assert stream.proc.returncode == -signal.SIGKILL
    reader.close()  # idempotent


def test_a_dropped_reader_stops_its_nvidia_smi(tmp_path: Path) -> None:
    fake = script(tmp_path / "nvidia-smi", "while :; do printf '0, 5, 100\\n'; sleep 0.02; done\n")
    reader = NvidiaSmiStreamReader(str(fake))
    assert reader.sample() is not None  # a one-off sample, as when learning the card's size
    stream = reader._stream
    assert stream is not None
    del reader
    gc.collect()
    assert stream.stopped
    assert not group_alive(stream.proc.pid)


DIES = """
import sys, time
print("0, 5, 100\\n1, 6, 100", flush=True)
time.sleep(0.2)
print("Unable to determine the device handle for GPU 0000:18:00.0: GPU is lost", file=sys.stderr)
sys.exit(3)
"""


def test_an_nvidia_smi_that_dies_is_a_read_error(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader]) -> None:
    fake = python_script(tmp_path / "nvidia-smi", DIES)
    reader = NvidiaSmiStreamReader(str(fake))
    readers.append(reader)
    first = reader.sample()  # its rows are returned, even though it has exited since
    assert first is not None
    assert first.worst_used_mib == 6
    with pytest.raises(DeviceReadError, match=r"-lms 20 exited with code 3: .*GPU is lost"):
        sample_until(reader, lambda: False)
    assert reader._stream is None  # the next sample (the next launch) starts a new one
    assert reader.looping


def test_an_nvidia_smi_killed_by_a_signal_is_a_read_error(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader]) -> None:
    fake = script(tmp_path / "nvidia-smi", "while :; do printf '0, 5, 100\\n'; sleep 0.02; done\n")
    reader = NvidiaSmiStreamReader(str(fake))
    readers.append(reader)
    assert reader.sample() is not None
    stream = reader._stream
    assert stream is not None
    os.killpg(stream.proc.pid, signal.SIGKILL)
    with pytest.raises(DeviceReadError, match="killed by SIGKILL"):
        sample_until(reader, lambda: False)


NO_LMS = """case " $* " in
  *" -lms "*) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2
              exit 2 ;;
esac
printf '0, 76152, 81559\\n1, 4, 81559\\n'
"""


def test_an_nvidia_smi_without_lms_is_run_once_per_sample(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader]) -> None:
    fake = script(tmp_path / "nvidia-smi", NO_LMS)
    reader = NvidiaSmiStreamReader(str(fake), frozenset({0}))
    readers.append(reader)
    first = reader.sample()
    assert first is not None
    assert first.devices == (DeviceMemory(0, 76152, 81559),)
    assert not reader.looping
    assert reader._stream is None
    assert reader.sample() == first


def test_an_nvidia_smi_that_prints_once_is_run_once_per_sample(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader]) -> None:
    """A tool that ignores -lms, prints one block and exits 0: its block, then once per sample."""
    fake = script(tmp_path / "nvidia-smi", "printf '0, 7, 100\\n'\n")
    reader = NvidiaSmiStreamReader(str(fake))
    readers.append(reader)
    assert reader.sample() is not None
    sample_until(reader, lambda: not reader.looping)
    got = reader.sample()
    assert got is not None
    assert got.devices == (DeviceMemory(0, 7, 100),)


def test_a_missing_or_silent_nvidia_smi_is_a_read_error(
        tmp_path: Path, readers: list[NvidiaSmiStreamReader]) -> None:
    with pytest.raises(DeviceReadError, match="missing"):
        NvidiaSmiStreamReader(str(tmp_path / "missing")).sample()
    fake = script(tmp_path / "nvidia-smi", "exec sleep 60\n")
    reader = NvidiaSmiStreamReader(str(fake), timeout_s=0.3)
    readers.append(reader)
    with pytest.raises(DeviceReadError, match="printed no GPU row for 0.3 s"):
        reader.sample()
    assert reader._stream is None  # stopped


def test_select_reader_streams_nvidia_smi_without_nvml(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pretuner.devices.nvidia.load_nvml", lambda: None)
    script(tmp_path / "nvidia-smi", "true\n")
    reader = select_reader("cuda", {"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "3,5"}, 2)
    assert isinstance(reader, NvidiaSmiStreamReader)
    assert reader.name == "nvidia-smi"
    assert reader.devices == frozenset({3, 5})
    assert reader.executable == str(tmp_path / "nvidia-smi")

