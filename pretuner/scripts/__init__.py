"""Startup scripts rendered from jinja2 templates: serve.sh, tuned.env, a vLLM config YAML,
Ray head/worker scripts and a systemd unit. The templates live in `pretuner/scripts/templates/`
(package data); every value in them is quoted and every decision is made in `context.py`."""

from pretuner.scripts.context import ScriptOptions, Target, build_context, files_for
from pretuner.scripts.render import render_scripts, write_scripts

__all__ = [
    "ScriptOptions",
    "Target",
    "build_context",
    "files_for",
    "render_scripts",
    "write_scripts",
]
