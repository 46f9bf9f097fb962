"""One strict jinja2 environment over the packaged startup-file templates
(`pretuner/deploy/templates`) and its quoting filters: every file pretuner writes for people
to run (startup scripts, the Ray restart lines) is rendered here."""

from __future__ import annotations

import json
import re
import shlex
from functools import cache
from typing import Any

import jinja2

from pretuner.redact import SecretArg, one_line

_SYSTEMD_SAFE = re.compile(r"^[A-Za-z0-9_./:=,+@-]+$")


def shell_quote(value: object) -> str:
    """One shell word; a secret is a reference to its variable, never its value."""
    if isinstance(value, SecretArg):
        return (shlex.quote(value.prefix) if value.prefix else "") + f'"${value.var}"'
    return shlex.quote(str(value))


def yaml_scalar(value: object) -> str:
    """A YAML scalar: numbers and booleans as they are, strings double-quoted (JSON strings
    are valid YAML); a switch (`enforce-eager: true`) is what `vllm serve --config` takes."""
    return json.dumps(value if isinstance(value, int | float) else str(value))  # bool: true


def systemd_word(value: object) -> str:
    """One ExecStart= word: specifiers (%) and variables ($) made literal, quoted if needed."""
    text = str(value)
    if _SYSTEMD_SAFE.match(text):
        return text
    out = []
    for c in text:
        if c in '\\"':
            out.append("\\" + c)
        elif c == "%":
            out.append("%%")
        elif c == "$":
            out.append("$$")
        elif not c.isprintable():
            out.append("".join(f"\\x{b:02x}" for b in c.encode()))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def systemd_secret(arg: SecretArg) -> str:
    """`${VAR}` as one ExecStart= word (systemd substitutes it whole, without splitting)."""
    word = systemd_word(arg.prefix) if arg.prefix else ""
    if word.startswith('"'):
        return word[:-1] + "${" + arg.var + '}"'
    return word + "${" + arg.var + "}"


def systemd_argv(argv: list[str | SecretArg]) -> str:
    words = list(argv)
    if isinstance(words[0], SecretArg) or not words[0].startswith("/"):
        words.insert(0, "/usr/bin/env")  # ExecStart= wants an absolute path
    return " ".join(systemd_secret(w) if isinstance(w, SecretArg) else systemd_word(w)
                    for w in words)


@cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("pretuner.deploy", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701  (shell scripts, not HTML; every value is shell-quoted)
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )
    env.filters.update(
        q=shell_quote, qargs=lambda values: " ".join(shell_quote(v) for v in values),
        yaml=yaml_scalar, sdargv=systemd_argv,
        sdtext=lambda value: one_line(value).replace("%", "%%"),  # no systemd specifier
        comment=one_line,  # every value in a `#` line: a newline must not start a live line
    )
    return env


def render_template(name: str, ctx: dict[str, Any]) -> str:
    return _env().get_template(name).render(**ctx)
