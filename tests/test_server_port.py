"""The port a launch's server gets: chosen by pretuner, bound by the server seconds later."""

from __future__ import annotations

import random
import socket

from pretuner.tune.execute import PORTS_FROM, _ephemeral_low, free_port

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
