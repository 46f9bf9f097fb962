"""Startup files (serve.sh, tuned.env, a vLLM config YAML, Ray scripts, a systemd unit) from the
jinja2 templates in `templates/`: `targets` names them, `context` decides what they say, `render`
writes them. Nothing is imported here: `pretuner script --help` reads the targets without loading
jinja2 and the engines behind the context (tests/test_cli_startup.py)."""
