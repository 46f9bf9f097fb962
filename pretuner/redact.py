"""Secrets on a server command line or in its environment: found by name, never stored.

One rule for every place a command is kept or shown (journal, command.json, report.json,
`--json`, the dry run, logs): the value after a secret-named flag (`--api-key K`,
`--api-key=K`) or of a secret-named assignment (`HF_TOKEN=K`) becomes `<redacted>`. The scripts a
person runs (serve.sh) read such a value from an environment variable instead: `secret_var`.

Free text (a quoted log, an error, a written file, console output) goes through `redact_text`:
the secret shapes engines log, and every value this process has recognised as a secret. That
memory is this module's one side effect: a value seen once as `--api-key K` (or in a secret-named
variable) is hidden wherever it turns up later, whatever the line around it looks like.
No I/O beyond the environment mapping a caller passes in.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pretuner.errors import BadInputError

REDACTED = "<redacted>"
# The last word of a name that marks its value as secret. Whole words, so that
# --max-num-batched-tokens and --tokenizer (which pretuner itself passes) stay readable; a word
# ending in one of them (apikey, hftoken) counts too.
_SECRET_WORDS = (
    "key", "keys", "token", "secret", "secrets", "password", "passwd", "credential", "credentials",
)  # fmt: skip
_SECRET_SUFFIXES = ("key", "token", "secret", "password", "passwd")
# ...unless the word before makes it a unit or a tokenizer's word: kv_bytes_per_token, eos_token.
_NOT_SECRET_BEFORE = {"per", "first", "next", "last", "sort", "eos", "bos", "pad", "unk", "sep"}
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_FLAG = re.compile(r"^--?([A-Za-z0-9][A-Za-z0-9_.-]*)(=(.*))?$", re.S)
# A wrapper's variable given in a flag's value: docker's `--env=HF_TOKEN=K`, srun's
# `--export=ALL,HF_TOKEN=K`.
_INNER = re.compile(r"(?:^|,)([A-Za-z_][A-Za-z0-9_]*)=")
# A quoted value (or list) in a Python repr a server logs: vLLM's `non-default args: {'api_key':
# ['K']}` and `args: Namespace(api_key='K')`.
_REPR_ITEM = re.compile(
    r"""(['"]?)(?<![\w-])(\w[\w-]*)\1([ \t]*[:=][ \t]*)(\[[^]\n]*]|'[^'\n]*'|"[^"\n]*")""")
# A YAML line with a bare value (`api-key: K` of a `vllm serve --config` file, quoted in an error).
_YAML_ITEM = re.compile(
    r"""^([ \t]*(?:-[ \t]+)?)([\w-]+)([ \t]*:[ \t]+)([^\s'"\[$#<][^\n]*)$""", re.M)
# Secrets by their shape, whatever names them: a Hugging Face token and an HTTP bearer credential.
_SHAPES = re.compile(r"\bhf_[A-Za-z0-9]{8,}|(?<=\bBearer )[A-Za-z0-9._~+/=-]{8,}")
_TRIGGERS = tuple(f(w) for w in ("key", "token", "secret", "passw", "credential", "hf_", "bearer")
                  for f in (str.lower, str.capitalize, str.upper))
# A value shorter than this is not looked for in free text (`SOME_TOKEN=1` must not hide every
# "1"); its flag or name still hides it where it is given.
MIN_KNOWN_CHARS = 6
_known: set[str] = set()


def remember(value: str) -> None:
    """Hide `value` in all free text this process writes or prints from now on."""
    if len(value) >= MIN_KNOWN_CHARS and REDACTED not in value and not value.startswith("$"):
        _known.add(value)


def is_secret_name(name: str) -> bool:
    """Whether a flag or variable name (`api-key`, `HF_TOKEN`) names a secret: its last word
    does (`prompt_token_ids`, `token_budgets` and `HF_TOKEN_PATH` are no secrets)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    if len(words) > 1 and words[-2] in _NOT_SECRET_BEFORE:
        return False
    return bool(words) and (words[-1] in _SECRET_WORDS or words[-1].endswith(_SECRET_SUFFIXES))


def secret_var(name: str) -> str:
    """The environment variable serve.sh (and --resume) read a secret from: --api-key ->
    PRETUNER_SERVE_API_KEY, HF_TOKEN=... -> PRETUNER_SERVE_HF_TOKEN."""
    return "PRETUNER_SERVE_" + re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").upper()


@dataclass(frozen=True, slots=True)
class SecretArg:
    """One argv word that carries a secret: `prefix` is kept (`--api-key=`, `HF_TOKEN=` or '')
    and the value comes from the environment variable `var`; `flag` names it for people."""

    prefix: str
    var: str
    flag: str


def classify_argv(argv: list[str]) -> list[str | SecretArg]:
    """argv with every secret value replaced by a `SecretArg` (the value itself is dropped)."""
    out: list[str | SecretArg] = []
    pending: str | None = None  # a secret flag whose value is the next word
    for word in argv:
        if pending is not None and not word.startswith("--"):
            remember(word)
            out.append(SecretArg("", secret_var(pending), f"--{pending}"))
            pending = None
            continue
        pending = None
        flag = _FLAG.match(word)
        assign = _ASSIGNMENT.match(word) if flag is None else None
        value = flag.group(3) or "" if flag else ""
        inner = [m for m in _INNER.finditer(value) if is_secret_name(m.group(1))]
        if flag and is_secret_name(flag.group(1)):
            if flag.group(2) is None:
                pending = flag.group(1)  # a boolean flag when a `--flag` follows
                out.append(word)
            else:
                prefix = word[: len(word) - len(flag.group(3))]
                remember(flag.group(3))
                out.append(SecretArg(prefix, secret_var(flag.group(1)), prefix.rstrip("=")))
        elif inner:  # the rest of the word is the secret: kept from its variable as a whole
            prefix = word[: len(word) - len(value) + inner[0].end()]
            remember(word[len(prefix):])
            out.append(SecretArg(prefix, secret_var(inner[0].group(1)), inner[0].group(1)))
        elif assign and is_secret_name(name := assign.group(1)):
            remember(assign.group(2))
            out.append(SecretArg(name + "=", secret_var(name), name))
        else:
            out.append(word)
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """argv as it may be stored or printed: every secret value is `<redacted>`."""
    return [w.prefix + REDACTED if isinstance(w, SecretArg) else w for w in classify_argv(argv)]


def redact_text(text: str) -> str:
    """Free text as it may be written or printed (a quoted log, an error, a file): every value
    this process knows as a secret, the value of a secret-named argument in a Python repr
    (vLLM's `non-default args: {'api_key': ['K']}`, `args: Namespace(api_key='K')`) or of a
    YAML line (`api-key: K`), a Hugging Face token and a bearer credential become
    `<redacted>`."""
    for value in sorted(_known, key=len, reverse=True):  # a secret inside a longer one
        text = text.replace(value, REDACTED)
    # The patterns run only on the lines that hold a word they look for: found with str.find,
    # a scrub of a GiB log stays near disk speed (the patterns alone take seconds a MiB).
    lines = set()
    for word in _TRIGGERS:
        at = text.find(word)
        while at >= 0:
            start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
            lines.add((start, len(text) if end < 0 else end))
            at = -1 if end < 0 else text.find(word, end)
    out, done = [], 0
    for start, end in sorted(lines):
        out += [text[done:start], _redact_line(text[start:end])]
        done = end
    return "".join(out) + text[done:]


def _redact_line(line: str) -> str:
    line = _REPR_ITEM.sub(_redact_item, line)
    if ": " in line or ":\t" in line:
        line = _YAML_ITEM.sub(lambda m: m[1] + m[2] + m[3] + REDACTED if is_secret_name(m[2])
                              else m[0], line)
    return _SHAPES.sub(REDACTED, line) if "hf_" in line or "Bearer " in line else line


def _redact_item(m: re.Match[str]) -> str:
    if not is_secret_name(m[2]):
        return m[0]
    quote = m[4][0] if m[4][0] in "'\"" else m[1] or "'"  # a list: JSON stays JSON
    return f"{m[1]}{m[2]}{m[1]}{m[3]}{quote}{REDACTED}{quote}"


def remember_secrets(words: list[str], environ: Mapping[str, str]) -> None:
    """Learn the secrets of pretuner's own command line, whose values may themselves be command
    lines (`run --server-arg '--api-key K'`, `--serve-cmd='docker run -e HF_TOKEN=T'`), and of
    its environment (`HF_TOKEN`, `VLLM_API_KEY`, `PRETUNER_SERVE_API_KEY`)."""
    redact_env(environ)
    values = [w.split("=", 1)[1] for w in words if w.startswith("--") and "=" in w]
    for value in [*words, *values]:
        try:
            classify_argv(shlex.split(value))
        except ValueError:  # an unbalanced quote
            classify_argv(value.split())
    classify_argv(words)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as recorded: values of secret-looking names replaced (and remembered)."""
    for name, value in env.items():
        if is_secret_name(name):
            remember(value)
    return {k: (REDACTED if is_secret_name(k) else v) for k, v in env.items()}


def redact_command_text(text: str) -> str:
    """A command line kept as one string (`--serve-cmd`), redacted word by word."""
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote: the words as typed, so no value slips through
        words = text.split()
    return shlex.join(redact_argv(words))


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`pretuner run`'s options as journaled: the server command, its flags (`server_args`)
    and any secret-named entry."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key == "serve_cmd" and isinstance(value, str):
            value = redact_command_text(value)
        elif isinstance(value, list):
            value = [redact_command_text(v) if isinstance(v, str) else v for v in value]
        elif isinstance(value, dict):
            value = redact_env(value)
        elif isinstance(value, str) and is_secret_name(key):
            value = REDACTED
        out[key] = value
    return out


def restore_command_text(text: str, environ: Mapping[str, str], run: str) -> str:
    """A journaled `--serve-cmd` with each `<redacted>` value read back from its environment
    variable (the one serve.sh reads); refused, naming the variable, when it is not set."""
    if REDACTED not in text:
        return text
    words = shlex.split(text)
    out = []
    for word, kind in zip(words, classify_argv(words), strict=True):
        if isinstance(kind, SecretArg) and word == kind.prefix + REDACTED:
            if kind.var not in environ:
                raise BadInputError(
                    f"run {run!r} was started with a secret {kind.flag}, which the journal does "
                    f"not keep; export {kind.var} with its value and resume again",
                    hint=f"export {kind.var}=...",
                )
            word = kind.prefix + environ[kind.var]
        out.append(word)
    return shlex.join(out)


def one_line(value: object) -> str:
    """Text that cannot end a `#` comment or a unit-file line: control characters become `?`."""
    return "".join(c if c.isprintable() else "?" for c in str(value))

