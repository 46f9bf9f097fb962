"""Two engines on one device (issue 28 item 8): a process that comes on the run's device while
it runs voids the proof, on every engine (exit 8, naming its pid and MiB)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pretuner.devices.base import DeviceReadError, Holder
from pretuner.errors import CardBusyError
from pretuner.tune.busy import Tenants
from tests.helpers import FAST_SIM, cli_env, run_cli, wait_for

TENANT = Holder(0, 4242, "python3", 20_000)  # there before the run: part of what it measured
SECOND = Holder(0, 5151, "python3", 75_663)  # a second run's server, come during it


class Scripted:
    """A reader whose process lists are given in turn (the last repeats)."""

    name = "scripted"
    interval_s = 0.02

    def __init__(self, *lists: tuple[Holder, ...] | None) -> None:
        self.lists = list(lists)

    def sample(self) -> None:
        return None

    def holders(self) -> tuple[Holder, ...]:
        now = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        if now is None:
            raise DeviceReadError("NVML: not supported")
        return now


@pytest.mark.parametrize(
    ("lists", "own", "refused"),
    [
        pytest.param([(TENANT,), (TENANT,)], (), False, id="the-same-tenant-stays"),
        pytest.param([(TENANT,), ()], (), False, id="a-tenant-leaving-is-no-harm"),
        pytest.param([(TENANT,), (TENANT, SECOND)], (), True, id="a-second-run-came"),
        pytest.param([(), (SECOND,)], (5151,), False, id="the-launchs-own-server"),
        pytest.param([(), (Holder(1, 4242, "python3", 1),)], (), True, id="same-pid-new-device"),
        pytest.param([(), None], (), False, id="a-reader-that-cannot-list-gives-no-verdict"),
    ],
)
def test_a_process_that_came_during_the_run_voids_it(
        lists: list[tuple[Holder, ...] | None], own: tuple[int, ...], refused: bool) -> None:
    tenants = Tenants(Scripted(*lists))
    tenants.check("before launch 1")
    ours = own.__contains__
    if not refused:
        tenants.check("after launch 1", ours=ours)
        return
    with pytest.raises(CardBusyError) as err:
        tenants.check("after launch 1", ours=ours)
    assert err.value.exit_code == 8
    assert "took device memory during the run (after launch 1)" in str(err.value)


def test_the_message_names_the_pid_and_its_mib() -> None:
    tenants = Tenants(Scripted((TENANT,), (TENANT, SECOND)))
    tenants.check("before launch 1")
    with pytest.raises(CardBusyError, match=r"pid 5151 \(python3, 75,663 MiB on device 0\)"):
        tenants.check("after launch 2")


def test_no_reader_no_verdict() -> None:
    Tenants(None).check("before launch 1")  # the CPU budget without a device tool: nothing


V1_RUN = ("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
          "--max-model-len", "8192")


@pytest.mark.slow
def test_two_concurrent_runs_on_one_emulated_device_are_not_both_validated(
        tmp_path: Path) -> None:
    # Seen in issue 28: both reported VALIDATED at 54.4 GiB (60.0 GiB alone). Servers that take
    # 2 s to load keep the two runs overlapping on a loaded machine (two runs one after the
    # other may both validate, rightly).
    env = cli_env(**{**FAST_SIM, "PRETUNER_SIM_STARTUP_S": "2"},
                  PRETUNER_SIM_STATE_DIR=str(tmp_path / "card"))
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda name: run_cli(*V1_RUN, "--out", str(tmp_path / name),
                                                  env=env), ["a", "b"]))
    codes = sorted(p.returncode for p in runs)
    # Never both validated. The loser is refused as sharing the device (8), or, seen once in
    # CI on a loaded machine, runs out of launches (6) after its launches met the other's
    # memory; never a validation.
    assert codes in ([0, 8], [8, 8], [0, 6], [6, 8]), [p.stderr[-3000:] for p in runs]
    for p in runs:
        if p.returncode == 8:
            # Caught mid-run (the other appeared during it) or at the start (the other was
            # there already, the busy-card refusal): either way the other is named.
            during = "took device memory during the run" in p.stderr
            assert during or "an earlier run?" in p.stderr, p.stderr[-500:]
            assert "MiB on device 0" in p.stderr or not during


# A process that holds 20,000 MiB on the emulated device 0 as long as it lives.
HOLDER = ("import os, time\n"
          "from pretuner.sim.state import Published, state_dir\n"
          "Published().hold(state_dir(os.environ), 'cuda', 0, 0, 20000)\n"
          "print('held', flush=True)\n"
          "time.sleep(120)\n")


@pytest.mark.slow
def test_a_process_allocating_on_the_device_mid_run_ends_it_with_exit_8(tmp_path: Path) -> None:
    env = cli_env(**FAST_SIM, PRETUNER_SIM_STATE_DIR=str(tmp_path / "card"))
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err:
        run = subprocess.Popen([sys.executable, "-m", "pretuner", *V1_RUN, "--out",
                                str(tmp_path / "run")], env=env, stdout=subprocess.DEVNULL,
                               stderr=err, stdin=subprocess.DEVNULL)
    out_path = tmp_path / "holder.out"
    holder = None
    try:
        wait_for(err_path, "#1 ready")
        with out_path.open("w") as out:
            holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=out, stdin=subprocess.DEVNULL)
        wait_for(out_path, "held")
        assert run.wait(timeout=120) == 8
    finally:
        run.kill()
        if holder is not None:
            holder.kill()
            holder.wait()
    error = err_path.read_text().strip().splitlines()[-1]
    assert f"pid {holder.pid} (python3, 20,000 MiB on device 0)" in error, error
    assert not (tmp_path / "run" / "serve.sh").exists()
