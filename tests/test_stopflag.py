"""The servers' stop flag: set by a signal while the main thread waits on it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pretuner.stopflag import StopFlag


@pytest.fixture
def usr1() -> object:
    old = signal.getsignal(signal.SIGUSR1)
    yield signal.SIGUSR1
    signal.signal(signal.SIGUSR1, old)


def test_a_signal_during_many_short_waits_stops_the_waiter(usr1: signal.Signals) -> None:
    flag = StopFlag()
    flag.install(usr1)
    threading.Timer(0.3, os.kill, (os.getpid(), usr1)).start()
    started = time.monotonic()
    while not flag.wait(0.001):  # the servers' loop, at a much higher rate
        assert time.monotonic() - started < 10, "the signal never stopped the wait"
    assert flag.signal_name == "SIGUSR1"
    assert flag.is_set()


def test_wait_times_out_when_nothing_comes() -> None:
    flag = StopFlag()
    started = time.monotonic()
    assert flag.wait(0.1) is False
    assert 0.09 <= time.monotonic() - started < 2
    flag.set()
    assert flag.wait() is True
    assert flag.signal_name == ""
