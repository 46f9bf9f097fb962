"""Which startup files each `--target` writes: names only, so `pretuner script --help` reads
the choices without loading the templates."""

from __future__ import annotations

from enum import Enum


class Target(str, Enum):
    ALL = "all"
    SERVE = "serve"
    ENV = "env"
    CONFIG = "config"
    RAY = "ray"
    SYSTEMD = "systemd"


GUARD_FILE = "pretuner-guard.sh"  # the systemd unit's ExecStartPre=
# Target -> (file name, template); a `.sh` is written executable
_FILES: dict[Target, tuple[tuple[str, str], ...]] = {
    Target.SERVE: (("serve.sh", "serve.sh.j2"),),
    Target.ENV: (("tuned.env", "tuned.env.j2"),),
    Target.CONFIG: (("vllm-config.yaml", "vllm-config.yaml.j2"),),
    Target.RAY: (("ray-head.sh", "ray-head.sh.j2"), ("ray-worker.sh", "ray-worker.sh.j2")),
    # the guard only where a run proved the configuration (`render.render_scripts`)
    Target.SYSTEMD: (("pretuner-serve.service", "systemd.service.j2"),
                     (GUARD_FILE, "guard.sh.j2")),
}


def files_for(targets: list[Target], nodes: int) -> list[tuple[str, str]]:
    """The files to render; `all` adds the Ray scripts only for a multi-node layout."""
    chosen: list[Target] = []
    for t in targets:
        if t is Target.ALL:
            chosen += [Target.SERVE, Target.ENV, Target.CONFIG, Target.SYSTEMD]
            if nodes > 1:
                chosen.append(Target.RAY)
        else:
            chosen.append(t)
    out: list[tuple[str, str]] = []
    for t in dict.fromkeys(chosen):
        out += _FILES[t]
    return out
