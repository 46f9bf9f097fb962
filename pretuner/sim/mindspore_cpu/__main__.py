"""`python -m pretuner.sim.mindspore_cpu serve ...`."""

from __future__ import annotations

import sys

from pretuner.sim.mindspore_cpu.serve import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["serve"]:
        args = args[1:]
    sys.exit(main(args, prog="python -m pretuner.sim.mindspore_cpu serve"))
