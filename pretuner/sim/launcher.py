"""The r0.1 launcher trap: a wrapper that runs the real server as a child via `subprocess.run`.

`python -m vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server --model M ...` (r0.1)
writes a small temp script and runs it with `subprocess.run`, so the server is a *child* of the
process the user started. Consequences the tuner must survive, reproduced here:

- SIGINT to the wrapper alone: `subprocess.run` catches KeyboardInterrupt, gives the child
  0.25 s, then kills it: the child never prints its pool dump.
- SIGTERM to the whole process group: the wrapper dies at once, the server stops gracefully and
  prints its dump after the wrapper is gone; wait for every member of the group.
- The wrapper's exit code says nothing about the server's (it ignores it).

One deliberate difference: the child gets a parent-death guard (SIGTERM when the wrapper dies),
so a SIGKILL of pretuner, which kills the wrapper by pretuner's own guard, stops the server too.
SIGTERM, not SIGKILL: on a normal stop the wrapper dies first and the server must still dump
its pool. The real r0.1 wrapper has no such guard: there pretuner's pid file names the orphan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from pretuner.procgroups import parent_death_guard

DEFAULT_ENTRY = "vllm.entrypoints.openai.api_server"

_SCRIPT = """\
import sys
from pretuner.sim.serve import main
sys.exit(main(sys.argv[1:], prog={entry!r}))
"""


def child_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Split `[entry_module] args...` into the entry name and the server's own arguments."""
    if argv and not argv[0].startswith("-"):
        return argv[0], list(argv[1:])
    return DEFAULT_ENTRY, list(argv)


def main(argv: Sequence[str] | None = None) -> int:
    entry, args = child_argv(list(sys.argv[1:] if argv is None else argv))
    fd, script = tempfile.mkstemp(prefix="vllm_ms_entry_", suffix=".py")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(_SCRIPT.format(entry=entry))
    try:
        # Deliberately like r0.1: no new session, no check, the child's code dropped.
        subprocess.run(
            [sys.executable, script, *args],
            check=False,
            preexec_fn=parent_death_guard(signal.SIGTERM),  # only a prctl: safe after fork
        )
    finally:
        os.unlink(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
