"""The result files of a run a `PretunerError` stopped: report.json and report.md say why.

A failed run has no configuration, so it gets no tuned.env and no serve.sh; its reports hold
the error, the fix, every launch made (also one that raised before it had an outcome) and
every decision. A Ctrl-C writes none of this: that run stays resumable.
"""

from __future__ import annotations

from typing import Any

from pretuner.errors import PretunerError, ServerFailedError
from pretuner.report.records import Step
from pretuner.tune.loop import Tuner
from pretuner.tune.record import RunRecord
from pretuner.tune.report import (
    RunMeta,
    failure_json,
    step_json,
    unfinished_step,
    write_failure,
)


def record_failure(record: RunRecord, tuner: Tuner, err: PretunerError, meta: RunMeta) -> None:
    """Write report.json and report.md of the failure and attach them to `err`."""
    steps = [step_json(o) for o in tuner.state.outcomes]
    started = _unfinished_launch(record, steps)
    if started is not None:
        n = int(started["n"])
        steps.append(unfinished_step(n, started["settings"], _log_of(record, n, err)))
    write_failure(record, failure_json(err, meta, tuner.plan, steps, tuner.state.decisions), err)


def _unfinished_launch(record: RunRecord, steps: list[Step]) -> dict[str, Any] | None:
    """The journal's last launch_started event when that launch never got an outcome."""
    done = max((s.n for s in steps), default=0)
    last = None
    for event in record.of_kind("launch_started"):
        last = event
    return last if last is not None and last["n"] > done else None


def _log_of(record: RunRecord, n: int, err: PretunerError) -> str | None:
    if isinstance(err, ServerFailedError) and err.log_path:
        return err.log_path
    path = record.path / f"launch-{n}" / "server.log"
    return str(path) if path.is_file() else None
