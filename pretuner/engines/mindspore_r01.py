"""The vLLM-MindSpore r0.1 engine: the command and environment of a launch (pure data), and its
verdict on a launch (MindSpore's pool dump is the measurement, its OOM texts and vLLM 0.6.6's
refusals are the failure classes)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pretuner.emulation import emulator
from pretuner.engines.base import (
    KV_FLAG,
    Deployment,
    Family,
    LaunchCommand,
    LaunchSettings,
    Purpose,
    Target,
    batch_flags,
    launch_command,
)
from pretuner.engines.outcome import Exercised, LaunchOutcome, OutcomeKind, kind_of
from pretuner.errors import BadInputError, ServerFailedError
from pretuner.launch.process import log_hint
from pretuner.logscan import ScanResult
from pretuner.models import ModelSpec, local_model_path

R01_COMMAND = ("python3", "-m", "vllm_mindspore.entrypoints", "vllm.entrypoints.openai.api_server")
V03_COMMAND = ("vllm-mindspore", "serve")
R01 = "vllm-mindspore-r01"  # the real engine (emulated where npu-smi shows no card)
SIM = "sim"  # the emulated card, named
MINDSPORE_CPU = "mindspore-cpu"  # real MindSpore on CPU serving the reference models
NAMES = (R01, SIM, MINDSPORE_CPU)
# The server's own block size: r0.1's kernels take 16.
BLOCK_SIZE = 16
MEMORY_VARS = ("ASCEND_TOTAL_MEMORY_GB", "vLLM_MODEL_MEMORY_USE_GB")  # read by r0.1 only
BACKEND_VARS = ("vLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND")  # the model backend: to 0.3, 0.4+


@dataclass(frozen=True, slots=True)
class Lengths:
    """The default --max-model-len / --min-model-len, and how many tokens each validation
    request decodes after its prompt (prompt + decode = max_model_len)."""

    max_model_len: int
    min_model_len: int
    decode_tokens: int = 16


DEFAULT_LENGTHS = Lengths(16384, 4096)
# The CPU reference server's models prefill on 2 cores: its lengths start where a validation
# under full load still takes well under a minute per launch there.
CPU_LENGTHS = Lengths(1024, 256, decode_tokens=4)


# MindSpore's compile (graph) cache: off unless MS_COMPILER_CACHE_ENABLE=1, then saved and
# loaded under MS_COMPILER_CACHE_PATH as <path>/rank_<RANK_ID>/graph_cache (MindSpore's
# environment-variable list). Where the user enabled it without a path, pretuner names one, so
# the pre-run and the proof share one cache, as VLLM_CACHE_ROOT does for vLLM's.
MS_CACHE_ENABLE_VAR = "MS_COMPILER_CACHE_ENABLE"
MS_CACHE_PATH_VAR = "MS_COMPILER_CACHE_PATH"


def graph_cache_env(env: Mapping[str, str]) -> dict[str, str]:
    """Where the cache is on: both variables, the user's path or the one pretuner names. Every
    launch gets them, and tuned.env and serve.sh too: production starts with the proof's cache
    (MindSpore's own default is the current folder)."""
    if env.get(MS_CACHE_ENABLE_VAR) != "1":
        return {}
    xdg = env.get("XDG_CACHE_HOME")
    path = env.get(MS_CACHE_PATH_VAR) or str(
        (Path(xdg) if xdg else Path.home() / ".cache") / "mindspore")
    return {MS_CACHE_ENABLE_VAR: "1", MS_CACHE_PATH_VAR: path}


def graph_cache_state(env: Mapping[str, str]) -> str:
    """"off" where the cache is not enabled (every start compiles, production's too), else
    "warm" when rank 0's graph cache holds anything, else "cold"."""
    if env.get(MS_CACHE_ENABLE_VAR) != "1":
        return "off"
    root = graph_cache_env(env)[MS_CACHE_PATH_VAR]
    folder = Path(root) / "rank_0" / "graph_cache"
    return "warm" if folder.is_dir() and any(folder.iterdir()) else "cold"


@dataclass(frozen=True, slots=True)
class R01Engine:
    """vLLM-MindSpore r0.1 (0.1-0.2, and a 0.3+ install driven the r0.1 way), real or on the
    emulated card, or the MindSpore reference server on CPU: the KV cache sized by two
    environment variables, the pool dump the measurement."""

    name: str  # R01, SIM or MINDSPORE_CPU
    simulated: bool
    version: str | None  # the installed vLLM-MindSpore's; None for the emulated card and CPU
    reason: str  # why this engine runs (the registry's words)
    family: Family = Family.R01
    # What plan asks before any launch: r0.1 is told a whole model-use GiB, takes no
    # quantization or offload flags, and its method shards with TP only: past one node the TP
    # grows and Ray places its ranks on as many nodes as it has (TP16 on two nodes).
    budget_in_whole_gib: ClassVar[bool] = True
    pp_across_nodes: ClassVar[bool] = False
    takes_weights_flags: ClassVar[bool] = False
    # --serve-cmd: the user's own way to start the server, in place of serve_argv()'s.
    serve_cmd: tuple[str, ...] = ()
    nodes: int = 1  # more than one: the ranks are placed by Ray
    backend: str | None = None  # the model backend production names (a preset's variable)
    launch_env: dict[str, str] = field(default_factory=dict)  # the emulated card's, launched only

    @property
    def server(self) -> str:
        """What serves, in the report's words (`backend`): sim, mindspore-cpu, vllm-mindspore."""
        if self.simulated:
            return SIM
        return MINDSPORE_CPU if self.name == MINDSPORE_CPU else "vllm-mindspore"

    @property
    def device(self) -> str:
        return "cpu" if self.name == MINDSPORE_CPU else "ascend"

    @property
    def device_kind(self) -> str:
        return "emulated" if self.simulated else self.device

    ray_resource = "NPU"  # what one rank holds on a Ray cluster

    @classmethod
    def card_words(cls, card_gib: int, card_source: str, device_kind: str) -> str:
        """r0.1's --card is the card's GiB (ASCEND_TOTAL_MEMORY_GB), with where it came from."""
        return f"{card_gib} GiB card(s) ({card_source})"

    def cache_state(self, env: Mapping[str, str]) -> str:
        """MindSpore's graph cache as a launch starts: "n/a" on the emulated card and behind
        --serve-cmd (a container's cache is not this host's folder)."""
        if self.simulated or self.serve_cmd:
            return "n/a"
        return graph_cache_state({**env, **self.launch_env})

    @property
    def lengths(self) -> Lengths:
        return CPU_LENGTHS if self.name == MINDSPORE_CPU else DEFAULT_LENGTHS

    def serve_argv(self, model: str) -> list[str]:
        """The server command and the model it loads: `--model MODEL` (r0.1 style), or after
        a 0.3+ install's `serve`."""
        if self.serve_cmd:
            return [*self.serve_cmd, "--model", model]
        if self.simulated:
            return [*emulator().server_command("r01"), "--model", model]
        if self.name == MINDSPORE_CPU:
            return [*emulator().server_command("mindspore-cpu"), "--model", model]
        if self.version is not None and version_tuple(self.version) >= (0, 3):
            return [*V03_COMMAND, model]
        return [*R01_COMMAND, "--model", model]

    def model_arg(self, model: str, spec: ModelSpec) -> str:
        """What the server loads: a folder by its absolute path; a registry name as its Hugging
        Face id for a real vLLM-MindSpore (which cannot load `qwen3-8b`); pretuner's own
        servers take the name."""
        if (local := local_model_path(model)) is not None:
            return local
        if self.simulated or self.name == MINDSPORE_CPU:
            return model
        return spec.hf_id or model

    def card_env(self, card_gib: int | None, seed: int, exported: Mapping[str, str], *,
                 weights_format: str, nodes: int) -> dict[str, str]:
        """The emulated card's environment (nothing for a real server)."""
        if not self.simulated:
            return {}
        return emulator().launch_env("r01", card_gib, seed, exported,
                                     weights_format=weights_format, nodes=nodes)

    def smi_command(self) -> list[str] | None:
        """The `npu-smi info` that shows this engine's cards; None where there is none."""
        if self.simulated:
            return emulator().smi_command()
        if self.name == MINDSPORE_CPU:
            return None
        return [shutil.which("npu-smi") or "npu-smi", "info"]

    def command(self, settings: LaunchSettings, target: Target) -> LaunchCommand:
        """The exact argv and environment of one launch (pure)."""
        deployment = self.deploy(settings)
        return launch_command(self.serve_argv(target.model), target, deployment.flags,
                              {**deployment.env, **self.launch_env, **target.extra_env})

    def deploy(self, s: LaunchSettings) -> Deployment:
        """The flags and environment that start the server with these settings: the KV cache is
        what the two memory variables leave of the card (seed 003 section 3.2)."""
        flags = [
            *batch_flags(s),
            ("--gpu-memory-utilization", f"{s.util:g}"),
            ("--block-size", str(s.block_size)),
            ("--tensor-parallel-size", str(s.tp)),
        ]
        if s.pp > 1:
            flags.append(("--pipeline-parallel-size", str(s.pp)))
        if s.chunked_prefill:
            flags.append(("--enable-chunked-prefill", None))
        elif s.max_model_len > CHUNKED_BY_DEFAULT_ABOVE:  # vLLM 0.6 would turn it on
            flags.append(("--enable-chunked-prefill", "False"))
        dtype = server_kv_cache_dtype(s.kv_cache_dtype)
        if dtype is not None:
            flags.append(("--kv-cache-dtype", dtype))
        if self.nodes > 1:
            flags.append(("--distributed-executor-backend", "ray"))
        env = {
            "GLOG_v": "1",  # MindSpore prints the pool dump at INFO only
            MEMORY_VARS[0]: str(s.card_gib),
            MEMORY_VARS[1]: str(s.model_use_gib),
        }
        return Deployment(tuple(flags), env)

    def production(self, s: LaunchSettings) -> Deployment:
        """What starts production on this engine's version (0.1 where unknown) with the settings
        its launches proved: r0.1 reads the two memory variables; 0.2 and later ignore them and
        always chunk (the flag is vLLM V0's); 0.4 renames the backend variable; 0.5 and later
        take the KV cache in bytes; MindSpore at WARNING (the pool dump is the tuner's)."""
        version = self.version or "0.1"
        ver = version_tuple(version)[:2]
        if len(ver) < 2:
            raise BadInputError(f"vLLM-MindSpore version {version!r} is not understood",
                                hint="use e.g. 0.1, 0.3, 0.4 or 0.5")
        launch = self.deploy(s)
        if ver < (0, 2):
            env, flags, notes = {**launch.env, "GLOG_v": "2"}, list(launch.flags), []
        else:
            env = {"GLOG_v": "2"}
            flags = [f for f in launch.flags if f[0] != "--enable-chunked-prefill"]
            notes = [f"vLLM-MindSpore {version} ignores {' and '.join(MEMORY_VARS)}; they are "
                     "not set"]
        if self.backend is not None:
            env[BACKEND_VARS[1] if ver >= (0, 4) else BACKEND_VARS[0]] = self.backend
        if ver >= (0, 5):
            if s.kv_cache_bytes is not None:
                flags.append((KV_FLAG, str(s.kv_cache_bytes)))
        elif ver >= (0, 2):
            notes.append(f"vLLM-MindSpore {version} sizes the KV cache by profiling and has no "
                         f"{KV_FLAG}: the tuned KV figure is not enforced; "
                         "--gpu-memory-utilization is the only lever")
        return Deployment(tuple(flags), env, tuple(notes))

    def check_model(self, spec: ModelSpec, tp: int | None, pp: int,
                    reference: Sequence[str]) -> None:
        """The CPU reference server serves its own models, on one process (exit 2)."""
        if self.name != MINDSPORE_CPU:
            return
        if not spec.eager_attention:
            raise BadInputError(
                f"--engine mindspore-cpu serves the CPU reference models, not {spec.name}",
                hint=f"use --model {' or --model '.join(reference)}, or --engine sim",
            )
        if (tp or 1) * pp != 1:
            raise BadInputError(
                f"--engine mindspore-cpu runs one card; TP{tp or 1} x PP{pp} needs several",
                hint="drop --tp/--pp (the reference server is a single process)",
            )


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


# vLLM 0.6 turns chunked prefill on by default above this max_model_len.
CHUNKED_BY_DEFAULT_ABOVE = 32768
# pretuner's KV dtype names -> the server's `--kv-cache-dtype` (None: the model's own dtype).
# MindSpore's int8 MLA layout (int8 latent, bf16 rope) is what vLLM-MindSpore's int8 means for
# an MLA model.
_SERVER_KV_DTYPE: dict[str, str | None] = {
    "auto": None, "bf16": None, "fp16": None, "int8": "int8", "int8-mla": "int8", "fp8": "fp8",
}


def server_kv_cache_dtype(kv_cache_dtype: str) -> str | None:
    """The `--kv-cache-dtype` value the server takes, or None to leave the flag out."""
    return _SERVER_KV_DTYPE.get(kv_cache_dtype, kv_cache_dtype)


_START_KINDS = {
    "KV_BLOCKS_EXHAUSTED": OutcomeKind.KV_EXHAUSTED,
    "MAX_DEVICE_MEMORY_RANGE": OutcomeKind.DEVICE_REFUSED,
    "MAX_MODEL_LEN_TOO_LARGE": OutcomeKind.LEN_TOO_LARGE,
}


def outcome_of(
    n: int, settings: LaunchSettings, scan: ScanResult,
    done: Exercised,
    *,
    failure: ServerFailedError | None, graceful: bool, init_free_mib: list[int], log_path: Path,
    problem: str | None, worst_node: str | None, rank_peaks_mib: dict[str, int],
    times: tuple[float, float, float, float], exited: int | None = None,
) -> LaunchOutcome:
    """Classify a finished launch from its scanned logs and what its requests got."""
    kind = _classify(scan, settings, failure, done)
    if kind is None:
        raise _fatal(failure, graceful, log_path, scan)
    if kind is OutcomeKind.OK and problem:
        raise ServerFailedError(problem, log_path=str(log_path))
    return LaunchOutcome.of(
        n, settings, kind, log_path, done, times, exited,
        worst_peak_mib=scan.worst.actual_peak_mib if scan.worst else None,
        rank_peaks_mib=rank_peaks_mib, oom_text=scan.oom[0].text if scan.oom else None,
        device_free_mib=_device_free_mib(scan, init_free_mib),
        estimated_max_len=next((o.event.estimated_max_model_len for o in scan.oom
                                if o.event.estimated_max_model_len), None), worst_node=worst_node,
        weights_gib=scan.weights_gib,
        oom_alloc_bytes=max((o.event.alloc_bytes or 0 for o in scan.oom), default=0) or None,
        requests_dropped=max(done.dropped, scan.prompts_ignored_total),
        notes=tuple(t.describe() for t in scan.truncated),  # also in scan.json's "truncated"
    )


def _classify(scan: ScanResult, s: LaunchSettings, failure: ServerFailedError | None,
              done: Exercised) -> OutcomeKind | None:
    """The outcome's kind, or None when nothing explains a failure (fatal for the run)."""
    kinds = [o.kind.name for o in scan.oom]
    refused = next((kind for name, kind in _START_KINDS.items() if name in kinds), None)
    dropped = bool(done.dropped) or (s.purpose is Purpose.PRERUN and bool(scan.prompts_ignored))
    kind = kind_of(refused, bool(kinds), bool(done.total), bool(scan.weights_gib), failure,
                   dropped, done)
    if kind is OutcomeKind.OK and (scan.worst is None or scan.worst.actual_peak_mib is None):
        return None  # no pool dump: nothing measured
    return kind


def _fatal(
    failure: ServerFailedError | None, graceful: bool, log_path: Path, scan: ScanResult
) -> ServerFailedError:
    if failure is not None:
        return failure
    why = (
        "it did not exit within the grace period and was killed, so MindSpore printed nothing"
        if not graceful
        else "its log has no `actual peak used` line"
    )
    if scan.truncated:
        killed = ", killed after the grace period" if not graceful else ""
        why = f"{scan.truncated_total} cut short{killed}; first: {scan.truncated[0].describe()}"
    return ServerFailedError(
        f"the server stopped without a {'complete ' if scan.truncated else ''}memory-pool "
        f"dump: {why}",
        hint=f"check that GLOG_v=1 reaches the server; {log_hint(log_path)}",
        log_path=str(log_path),
    )


def _device_free_mib(scan: ScanResult, init_free: list[int]) -> int | None:
    """The card's free memory as MindSpore measured it: its init line, or the upper bound of
    the max_device_memory range it printed when it refused the pool."""
    for record in scan.oom:
        limit = record.event.max_device_memory_limit_mib
        if limit:
            return int(limit)
    return min(init_free) if init_free else None

