"""The command of one launch as data: argv and the environment pretuner adds (pure)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pretuner.redact import redact_argv, redact_env


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
