"""The command of one launch as data: argv and the environment pretuner adds (pure)."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pretuner.redact import redact_argv, redact_env

# In a --serve-cmd, the port pretuner chose for the launch: a container's `-p {port}:{port}`.
PORT_SLOT = "{port}"
# The port of the startup files, which pass no --port: the engines' own default (vLLM's).
SERVE_PORT = 8000
# Where a server behind a port mapping listens: inside a container, 127.0.0.1 is the
# container's own loopback, which `-p` cannot reach.
ALL_HOSTS = "0.0.0.0"  # noqa: S104
CONTAINER_RUNNERS = ("docker", "podman", "nerdctl")


def wrapped(argv: list[str], port: int, env: Iterable[str]) -> list[str]:
    """A server command with each `{port}` of a --serve-cmd wrapper replaced by `port`; a
    `docker|podman run` wrapper is given `-e NAME` for each variable pretuner sets, as a
    container sees only the environment it is given (`-e NAME` copies the runner's value)."""
    argv = [word.replace(PORT_SLOT, str(port)) for word in argv]
    if len(argv) > 1 and Path(argv[0]).name in CONTAINER_RUNNERS and argv[1] == "run":
        argv[2:2] = [word for name in env for word in ("-e", name)]
    return argv


def deployed_port(flags: list[str]) -> int:
    """The port of the startup files' server: its `--port` flag, else the engine's default."""
    given = zip(flags, flags[1:], strict=False)
    return next((int(v) for f, v in given if f == "--port" and v.isdigit()), SERVE_PORT)


@dataclass(frozen=True, slots=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str]  # only what pretuner sets on top of the inherited environment
    bearer: str | None = None  # the server's API key, which pretuner's own requests send

    def redacted(self) -> LaunchCommand:
        """The command as it may be stored or printed: secret values are `<redacted>`."""
        return LaunchCommand(argv=redact_argv(self.argv), env=redact_env(self.env))

    def shell_line(self) -> str:
        """The command for people to read (never run by pretuner), secrets redacted."""
        cmd = self.redacted()
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        return f"{env} {shlex.join(cmd.argv)}".strip()
