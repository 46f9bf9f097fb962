"""The background memory sampler with fake readers: phases, peaks, failures, prompt stop."""

from __future__ import annotations

import threading
import time

from pretuner.devices import DeviceMemory, Sample
from pretuner.launch.sampler import MemorySampler


class Scripted:
    """A reader whose used MiB the test sets."""

    name = "fake"
    interval_s = 0.0  # asks for more than the sampler allows: it still waits 20 ms

    def __init__(self) -> None:
        self.used = 100
        self.calls = 0
        self.first = threading.Event()

    def sample(self) -> Sample | None:
        self.calls += 1
        self.first.set()
        return Sample((DeviceMemory(0, self.used, 1000), DeviceMemory(1, self.used // 2, 1000)))


def wait_for_samples(reader: Scripted, count: int) -> None:
    start = reader.calls
    deadline = time.monotonic() + 5
    while reader.calls < start + count and time.monotonic() < deadline:
        time.sleep(0.005)


def test_peaks_per_phase() -> None:
    reader = Scripted()
    seen: list[str] = []
    sampler = MemorySampler(reader)
    phase = sampler.wrap(lambda name, detail: seen.append(name))
    sampler.start()
    wait_for_samples(reader, 2)
    phase("loading", "")
    reader.used = 700
    wait_for_samples(reader, 2)
    reader.used = 300
    wait_for_samples(reader, 2)
    phase("stop", "")
    reader.used = 200
    wait_for_samples(reader, 2)
    done = sampler.stop()
    assert seen == ["loading", "stop"]  # the wrapped callback still gets every phase
    assert done.reader == "fake"
    assert done.failure is None
    assert done.peaks_mib["launch"] == 100
    assert done.peaks_mib["loading"] == 700  # the worst device, not the sum
    assert done.peaks_mib["stop"] == 200
    assert done.peak_mib == 700


def test_never_more_often_than_every_20_ms() -> None:
    reader = Scripted()
    sampler = MemorySampler(reader).start()
    time.sleep(0.3)
    sampler.stop()
    assert 3 <= reader.calls <= 17


class Raising:
    name = "broken"
    interval_s = 0.02

    def __init__(self) -> None:
        self.calls = 0

    def sample(self) -> Sample | None:
        self.calls += 1
        raise RuntimeError("driver went away")


def test_a_raising_reader_stops_sampling_and_is_reported() -> None:
    reader = Raising()
    sampler = MemorySampler(reader).start()
    time.sleep(0.1)
    done = sampler.stop()
    assert reader.calls == 1
    assert done.failure == "sampler failed: RuntimeError: driver went away"
    assert done.peaks_mib == {}
    assert done.peak_mib is None


class Slow(Scripted):
    def sample(self) -> Sample | None:
        time.sleep(0.1)  # a command that takes its time
        return super().sample()


def test_stops_within_half_a_second() -> None:
    reader = Slow()
    sampler = MemorySampler(reader).start()
    reader.first.wait(2)
    t0 = time.monotonic()
    done = sampler.stop()
    assert time.monotonic() - t0 < 0.5
    assert done.samples >= 1


def test_no_reader_samples_nothing() -> None:
    calls: list[str] = []

    def phase(name: str, detail: str) -> None:
        calls.append(name)

    sampler = MemorySampler(None)
    assert sampler.wrap(phase) is phase
    sampler.start()
    done = sampler.stop()
    assert done.reader is None
    assert done.peaks_mib == {}
    assert done.samples == 0
