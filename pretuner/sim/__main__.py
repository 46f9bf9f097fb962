"""`python -m pretuner.sim serve|launch|npu-smi|vllm|nvidia-smi|mindspore-cpu ...` without typer
(keeps the servers light). `vllm serve ...` is the emulated vLLM 0.24 on a CUDA card
(`pretuner.sim.v1`), `mindspore-cpu serve ...` the reference server on real MindSpore."""

from __future__ import annotations

import importlib
import sys

# command -> the module whose main(argv) runs it
COMMANDS = {"serve": "pretuner.sim.serve", "launch": "pretuner.sim.launcher",
            "npu-smi": "pretuner.sim.npusmi", "vllm": "pretuner.sim.v1.server",
            "nvidia-smi": "pretuner.sim.v1.smi",
            "mindspore-cpu": "pretuner.sim.mindspore_cpu.serve"}
USAGE = f"usage: python -m pretuner.sim {{{','.join(COMMANDS)}}} ...\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    module = COMMANDS.get(args[0])
    if module is None:
        sys.stderr.write(USAGE + f"unknown command {args[0]!r}\n")
        return 2
    return int(importlib.import_module(module).main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
