"""The background memory sampler with fake readers: phases, peaks, failures, prompt stop."""

from __future__ import annotations

import threading
import time

import pytest

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


def test_the_series_keeps_every_device_and_the_phases_not_the_statuses() -> None:
    reader = Scripted()
    sampler = MemorySampler(reader)
    phase = sampler.wrap(lambda name, detail: None)
    sampler.start()
    wait_for_samples(reader, 2)
    phase("loading", "")
    phase("memory", "1,000 MiB used now")  # a status: no phase of its own
    phase("requests", "1/2 done")
    reader.used = 700
    wait_for_samples(reader, 2)
    done = sampler.stop()
    assert done.series, "a series"
    assert {p.phase for p in done.series} <= {"launch", "loading"}
    assert done.series[-1].phase == "loading"
    assert all([dev for dev, _ in p.used_mib] == [0, 1] for p in done.series)
    assert done.series[-1].used_mib == ((0, 700), (1, 350))
    times = [p.t_s for p in done.series]
    assert times == sorted(times)
    assert times[0] >= 0


@pytest.mark.slow
def test_the_series_stays_bounded_however_long_the_launch() -> None:
    reader = Scripted()
    sampler = MemorySampler(reader, series_max_points=8).start()
    wait_for_samples(reader, 40)
    done = sampler.stop()
    assert done.samples >= 40
    assert 4 <= len(done.series) < 8  # halved when it reached 8


def test_bounded_series_decimates_evenly() -> None:
    from pretuner.launch.sampler import BoundedSeries, SeriesPoint

    series = BoundedSeries(max_points=10)
    for i in range(1000):
        series.add(SeriesPoint(float(i), "load", ((0, i),)))
        assert len(series.points) < 10
    kept = [int(p.t_s) for p in series.points]
    assert kept[0] == 0  # the start is always there
    gaps = {b - a for a, b in zip(kept, kept[1:], strict=False)}
    assert gaps == {series.every}  # evenly spaced: every `every`-th offered point
    assert kept[-1] > 1000 - 2 * series.every  # and it reaches the end


def test_series_tsv_rows_and_header() -> None:
    from pretuner.devices.series import parse_memory_tsv
    from pretuner.launch.sampler import Sampled, SeriesPoint, series_tsv

    assert series_tsv(Sampled("fake"), 1) is None  # nothing sampled: no file
    sampled = Sampled("fake", {"load": 700}, 2, None, 1000,
                      (SeriesPoint(0.02, "launch", ((0, 100), (1, 50))),
                       SeriesPoint(0.04, "load", ((0, 700), (1, 350)))))
    text = series_tsv(sampled, 3)
    assert text is not None
    lines = text.splitlines()
    assert lines[0].startswith("# ")
    assert "total_mib=1000" in lines[0]
    assert lines[1] == "t_s\tphase\tdevice\tused_mib"
    assert lines[2:] == ["0.020\tlaunch\t0\t100", "0.020\tlaunch\t1\t50",
                         "0.040\tload\t0\t700", "0.040\tload\t1\t350"]
    parsed = parse_memory_tsv(3, text)
    assert parsed.total_mib == 1000
    assert parsed.reader == "fake"
    assert [(r.phase, r.device, r.used_mib) for r in parsed.rows][-1] == ("load", 1, 350)
