"""`python -m pretuner.launch.limit --data BYTES -- CMD...`: run CMD under an RLIMIT_DATA.

The budgeted "card" of a CPU engine: RLIMIT_DATA caps each process's data segment (heap and
private writable mappings, VmData in /proc/PID/status) and is inherited by every child, so
vLLM's API server, EngineCore and Worker each fail an allocation that would take them past
the budget, as a device allocator fails past its card. The process sets the limit and execs
CMD (same pid, so the process group pretuner started is the server's), which keeps the
limit visible in the launch's command.json.
"""

from __future__ import annotations

import argparse
import os
import resource
from typing import NoReturn


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m pretuner.launch.limit",
                                     description="run a command under an RLIMIT_DATA")
    parser.add_argument("--data", type=int, required=True, help="bytes per process")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.data <= 0:
        parser.error("a positive --data and a command after -- are required")
    resource.setrlimit(resource.RLIMIT_DATA, (args.data, args.data))  # soft and hard
    os.execvp(command[0], command)  # noqa: S606 - the server command pretuner built


if __name__ == "__main__":
    main()
