"""`--serve-cmd` as a container wrapper (`docker run ... -p 127.0.0.1:{port}:{port} IMAGE`), the
same on the r0.1 engine and a V1 engine: pretuner's port reaches the wrapper, the variables it
sets reach the container, the container's stdout is the server's log, the device is read from
the host, and a secret in the wrapper is never written.

Fast: the wrapper made whole (pure) and the dry run. Slow: real runs through
tests/fakes/fake_container.sh, a `docker run` that keeps only the environment named with -e and
runs the emulated server from another venv's interpreter.
"""

from __future__ import annotations

import json
import shlex
import site
import sys
import venv
from pathlib import Path

import pytest

from pretuner.launch.command import deployed_port, wrapped
from pretuner.redact import REDACTED, redact_argv, restore_command_text
from tests.helpers import cli_env, invoke, run_cli

FAKE = Path(__file__).parent / "fakes" / "fake_container.sh"
REPO = Path(__file__).resolve().parents[1]
SECRET = "SEKRIT-hf-in-wrapper"  # noqa: S105
# engine -> (its emulated card's --card, the image the fake runs it from)
ENGINES = {"vllm-mindspore-r01": ("64", "mindspore/vllm-mindspore:r0.1"),
           "vllm": ("80", "vllm/vllm-openai:v0.11.0")}


def test_the_port_slot_and_the_environment_reach_a_container() -> None:
    cmd = ["/usr/bin/podman", "run", "--rm", "-p", "127.0.0.1:{port}:{port}", "img", "m"]
    assert wrapped(cmd, 8123, ["GLOG_v", "HF_HUB_OFFLINE"]) == [
        "/usr/bin/podman", "run", "-e", "GLOG_v", "-e", "HF_HUB_OFFLINE", "--rm",
        "-p", "127.0.0.1:8123:8123", "img", "m"]
    # Not a container runner: only the port (srun passes the environment itself).
    assert wrapped(["srun", "--port={port}", "vllm"], 9, ["A"]) == ["srun", "--port=9", "vllm"]
    # The startup files' server listens on its --port, else the engine's default.
    assert deployed_port(["--max-model-len", "8", "--port", "9001"]) == 9001
    assert deployed_port(["--max-model-len", "8"]) == 8000


def test_a_secret_given_to_the_container_is_redacted_and_read_back() -> None:
    argv = ["docker", "run", f"--env=HF_TOKEN={SECRET}", "-e", f"HF_TOKEN={SECRET}",
            f"--export=ALL,HF_TOKEN={SECRET}", "--env=GLOG_v=1", "img"]
    assert redact_argv(argv) == [
        "docker", "run", f"--env=HF_TOKEN={REDACTED}", "-e", f"HF_TOKEN={REDACTED}",
        f"--export=ALL,HF_TOKEN={REDACTED}", "--env=GLOG_v=1", "img"]
    back = restore_command_text(shlex.join(redact_argv(argv)),
                                {"PRETUNER_SERVE_HF_TOKEN": "T"}, "r1")
    assert shlex.split(back)[2] == "--env=HF_TOKEN=T"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("publish", "host"), [
    ("-p 127.0.0.1:{port}:{port}", "0.0.0.0"),  # noqa: S104 (a -p mapping reaches only this)
    ("--network host", "127.0.0.1"),
])
def test_a_dry_run_shows_the_wrapper_with_its_host(engine: str, publish: str, host: str) -> None:
    card, image = ENGINES[engine]
    cmd = f"docker run --rm -e HF_TOKEN={SECRET} {publish} {image}"
    proc = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--card", card,
                  "--dry-run", "--json", "--serve-cmd", cmd)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    argv = json.loads(proc.stdout)["first_launch"]["argv"]
    assert argv[argv.index("--host") + 1] == host
    assert argv[:2] == ["docker", "run"]
    assert f"HF_TOKEN={REDACTED}" in argv


@pytest.fixture(scope="module")
def image_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another venv's interpreter, the "image" the fake container runs: it sees this checkout
    and the test venv's packages through a .pth file, nothing of the caller's environment."""
    folder = tmp_path_factory.mktemp("image") / "venv"
    venv.create(folder, with_pip=False, symlinks=True)
    purelib = folder / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (purelib / "site-packages" / "image.pth").write_text(
        "\n".join([str(REPO), *site.getsitepackages()]) + "\n", encoding="utf-8")
    return folder / "bin" / "python"


def fake_runner(tmp_path: Path, name: str, python: Path) -> Path:
    runner = tmp_path / "bin" / name
    runner.parent.mkdir()
    runner.write_text(FAKE.read_text(encoding="utf-8").replace("@IMAGE_PYTHON@",
                                                               shlex.quote(str(python))))
    runner.chmod(0o755)
    return runner


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "runner"), [("vllm", "docker"),
                                                ("vllm-mindspore-r01", "podman")])
def test_a_run_through_a_container(tmp_path: Path, image_python: Path, engine: str,
                                   runner: str) -> None:
    card, image = ENGINES[engine]
    wrapper = (f"{fake_runner(tmp_path, runner, image_python)} run --rm --gpus all --ipc=host "
               f"--env=HF_TOKEN={SECRET} -p 127.0.0.1:{{port}}:{{port}} {image}")
    run = tmp_path / "r"
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--card", card,
                   "--serve-cmd", wrapper, "--max-model-len", "4096", "--min-model-len", "4096",
                   "--out", str(run), env=cli_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    for path in run.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    launches = sorted(run.glob("launch-*"))
    assert launches
    for launch in launches:
        # The container's stdout is the log: its own line, then the server's.
        log = (launch / "server.log").read_text(encoding="utf-8")
        assert f"fake container: {image} on {image_python}" in log
        argv = json.loads((launch / "command.json").read_text(encoding="utf-8"))["argv"]
        port = argv[argv.index("--port") + 1]
        assert f"127.0.0.1:{port}:{port}" in argv  # the fake refuses a mapping that misses
    # The device was read from the host while the server ran in the container.
    steps = json.loads((run / "report.json").read_text(encoding="utf-8"))["steps"]
    assert all(s["device_peaks_mib"]["loading"] > s["device_peaks_mib"]["launch"] for s in steps)
    # Production starts the same container, on the engine's default port.
    serve = (run / "serve.sh").read_text(encoding="utf-8")
    assert "127.0.0.1:8000:8000" in serve
    assert "PRETUNER_SERVE_HF_TOKEN" in serve
    if engine == "vllm-mindspore-r01":  # the budget is the environment: it reaches the container
        assert f"{runner} run -e GLOG_v -e ASCEND_TOTAL_MEMORY_GB -e vLLM_MODEL_MEMORY_USE_GB" in serve
