"""The tuned environment and server flags as a file a shell can `source`."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping

from pretuner.method import FinalConfig


def server_args(flags: Mapping[str, int | float | str]) -> list[str]:
    """`--max-model-len 16384 ...` from the flag dict (underscores become dashes)."""
    args: list[str] = []
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def env_file_text(final: FinalConfig, header: Iterable[str]) -> str:
    """`KEY=value` lines for the two env vars plus PRETUNER_SERVER_ARGS, with a comment header."""
    lines = [f"# {line}" for line in header]
    lines += [f"{key}={shlex.quote(value)}" for key, value in final.env.items()]
    lines.append(f"PRETUNER_SERVER_ARGS={shlex.quote(shlex.join(server_args(final.flags)))}")
    return "\n".join(lines) + "\n"
