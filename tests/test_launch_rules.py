"""Rules of one launch: the port its server gets (chosen by pretuner, bound by the server
seconds later), and how long a stopping server is given."""

from __future__ import annotations

import random
import socket

import pytest

from pretuner.engines.v1_launch import V1Hooks
from pretuner.tune.execute import (
    FAILED_V1_STOP_GRACE_S,
    PORTS_FROM,
    LaunchContext,
    _ephemeral_low,
    free_port,
    stop_grace,
)

HOST = "127.0.0.1"


def test_the_port_is_below_the_ephemeral_range() -> None:
    """Rule: outgoing connections (Ray opens many) take ports from the ephemeral range, so the
    server's port comes from below it, above Ray's worker ports."""
    low = _ephemeral_low()
    ports = {free_port(HOST, random.Random(seed)) for seed in range(20)}
    assert all(PORTS_FROM <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # chosen at random, not one fixed port that runs would share


def test_a_port_something_listens_on_is_never_chosen() -> None:
    """Rule: a candidate another process holds is skipped (here the first one drawn)."""
    held_port = random.Random(3).randrange(PORTS_FROM, _ephemeral_low())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((HOST, held_port))
        held.listen()
        port = free_port(HOST, random.Random(3))
        assert port != held_port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, port))  # free indeed


@pytest.mark.parametrize(("v1", "failed", "given", "grace"), [
    (True, False, 120.0, 120.0),  # a V1 server that ran: the whole --stop-grace
    (True, True, 120.0, FAILED_V1_STOP_GRACE_S),  # failed (OOM seen, died): nothing to write
    (True, True, 3.0, 3.0),  # never more than the user's --stop-grace
    (False, True, 120.0, 120.0),  # r0.1 writes its memory-pool dump at any stop
    (False, False, 120.0, 120.0),
])
def test_stop_grace(v1: bool, failed: bool, given: float, grace: float) -> None:
    ctx = LaunchContext(build=lambda s, port: None, served_name="m",  # type: ignore[arg-type,return-value]
                        stop_grace_s=given, hooks=V1Hooks(bytes_per_token=1024) if v1 else None)
    assert stop_grace(ctx, failed=failed) == grace
