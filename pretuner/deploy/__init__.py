"""Startup scripts rendered from jinja2 templates: serve.sh, tuned.env, a vLLM config YAML,
Ray head/worker scripts and a systemd unit. The templates live in `pretuner/deploy/templates/`
(package data); every value in them is quoted and every decision is made in `context.py`.

`targets.py` names the files, `context.py` decides what they say, `render.py` renders and
writes them. Nothing is imported here: `pretuner script --help` reads the targets without
loading jinja2 and the engines behind the context (tests/test_cli_startup.py)."""
