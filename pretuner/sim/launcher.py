"""The r0.1 launcher trap: a wrapper that runs the real server as a child via `subprocess.run`.

Reproduced because the tuner must survive it: SIGINT to the wrapper alone kills the child after
0.25 s (no pool dump); a group SIGTERM kills the wrapper at once while the server still dumps;
the wrapper's exit code ignores the server's. Unlike r0.1, the child gets a parent-death
SIGTERM (not SIGKILL, so it still dumps its pool) so that killing pretuner stops it too."""

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
