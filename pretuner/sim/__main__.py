"""`python -m pretuner.sim serve|launch|npu-smi|vllm|nvidia-smi ...` without typer (keeps the
servers light). `vllm serve ...` is the emulated vLLM 0.24 on a CUDA card (`pretuner.sim.v1`)."""

from __future__ import annotations

import sys

USAGE = "usage: python -m pretuner.sim {serve,launch,npu-smi,vllm,nvidia-smi} ...\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        from pretuner.sim.serve import main as serve

        return serve(rest)
    if cmd == "launch":
        from pretuner.sim.launcher import main as launch

        return launch(rest)
    if cmd == "npu-smi":
        from pretuner.sim.npusmi import main as npu_smi

        return npu_smi(rest)
    if cmd == "vllm":
        from pretuner.sim.v1.server import main as vllm

        return vllm(rest)
    if cmd == "nvidia-smi":
        from pretuner.sim.v1.smi import main as nvidia_smi

        return nvidia_smi(rest)
    sys.stderr.write(USAGE + f"unknown command {cmd!r}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
