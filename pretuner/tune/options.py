"""`RunOptions`, everything `pretuner run` was asked, and its checks: one place for the rules
every way into `pretuner run` meets (flags, a library call, a journal read back by --resume)."""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pydantic

from pretuner import validate as v
from pretuner.errors import BadInputError
from pretuner.kvmath import KV_DTYPES
from pretuner.models import local_model_path
from pretuner.models.quant import METHODS
from pretuner.redact import redact_command_text


@pydantic.with_config(pydantic.ConfigDict(extra="forbid", strict=True))
@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything `pretuner run` was asked; journaled so that --resume rebuilds the same run."""

    model: str
    engine: str = "auto"  # auto | a name of pretuner.engines.registry.ENGINES
    emulate: bool = False  # the emulated engine of that name, asked for
    engine_python: str | None = None  # the interpreter of the engine's own venv
    card_gib: int | None = None
    max_model_len: int | None = None  # default: the engine's
    min_model_len: int | None = None
    # V1 engines: the production's; None: the engine's own (pinned.setup.batch_defaults)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    util: float = 0.9
    tp: int | None = None
    pp: int | None = None  # None: the layout chooses (pretuner.plan.layout)
    nodes: int | None = None
    cards_per_node: int = 8
    block_size: int | None = None  # None: the engine's own
    kv_cache_dtype: str = "auto"
    weights_format: str | None = None
    headroom_gib: float | None = None  # base headroom; None: scaled to the measurement
    reserve_gib: float | None = None
    model_use_gib: int | None = None
    max_launches: int = 8
    validate: bool = True
    repeat_proof: int = 1  # boots the final configuration is proven on
    serve_cmd: str | None = None
    # V1 engines: more server flags, launched and written to serve.sh as given
    # (["--load-format dummy"]: each value is shell-split).
    server_args: list[str] = field(default_factory=list)
    runs_dir: str = "runs"
    out: str | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    ready_timeout_s: float = 1800.0
    request_timeout_s: float = 900.0
    stop_grace_s: float = 120.0
    sim_env: dict[str, str] = field(default_factory=dict)
    ray_address: str | None = None  # multi-node via Ray: HOST:PORT or auto
    # Vision-language models (V1 engines): vLLM's flags, launched and deployed, and the soak
    # after validation (requests and/or minutes; None: DEFAULT_SOAK for a VL model, 0 else).
    limit_mm_per_prompt: str | None = None
    mm_processor_cache_gb: float | None = None
    soak: int | None = None
    soak_minutes: float | None = None
    # V1 engines, fixed for every launch: where the weights live and how steps run.
    quantization: str | None = None  # vLLM's --quantization (bitsandbytes, fp8, awq, gptq)
    cpu_offload_gib: float = 0.0  # --cpu-offload-gb: weights per card kept in host memory
    swap_space_gib: float | None = None  # --swap-space; None: the engine's default
    enforce_eager: bool = False  # --enforce-eager: no CUDA graphs
    # The validation's decode speed (one sequence alone) must reach this, or exit 9.
    min_tokens_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def knobs_given(self) -> dict[str, bool]:
        """The V1 weights knobs by flag: whether each was given (or set by --config)."""
        return {"--quantization": self.quantization is not None,
                "--cpu-offload-gb": bool(self.cpu_offload_gib),
                "--swap-space": self.swap_space_gib is not None,
                "--enforce-eager": self.enforce_eager}

    def command_line(self) -> list[str]:
        """`pretuner run` with every option that differs from its default: the same run again
        (a new run folder; what the emulated card was told through its env is not a flag)."""
        argv = ["pretuner", "run", "--model", local_model_path(self.model) or self.model]
        defaults = RunOptions(model=self.model)
        for name, flag in RETUNE_FLAGS:
            value = getattr(self, name)
            if value == getattr(defaults, name):
                continue
            if isinstance(value, bool):
                argv.append(flag if value else f"--no-{flag[2:]}")
            elif isinstance(value, list):
                argv += [part for item in value for part in (flag, redact_command_text(item))]
            elif name == "serve_cmd":
                argv += [flag, redact_command_text(str(value))]
            else:
                argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return argv

    @classmethod
    def from_json(cls, data: Any, made_by: str | None = None) -> RunOptions:
        """The options a journal recorded, refused with the key at fault (another version's run,
        a hand edit) instead of a traceback."""
        if isinstance(data, dict) and "backend" in data:  # recorded before --engine named all
            from pretuner.engines.registry import engine_of_backend

            data = dict(data)
            data["engine"] = engine_of_backend(str(data.pop("backend")),
                                               str(data.get("engine", "auto")))
        who = f"pretuner {made_by}" if made_by else "another pretuner version (none recorded)"
        if not isinstance(data, dict):
            raise BadInputError(
                f"the journal's run options are a {type(data).__name__}, not an object",
                hint="the journal is damaged: start a new run",
            )
        try:  # through JSON: pydantic's strict mode takes an object for a dataclass there only
            return _JOURNALED.validate_json(json.dumps(data))
        except pydantic.ValidationError as err:
            problems = err.errors()
        # Named as a person fixes them: a key unknown here, then a key missing, then a value.
        first = min(problems, key=lambda p: (p["type"] != "unexpected_keyword_argument",
                                             p["type"] != "missing", p["loc"]))
        key = str(first["loc"][0])
        if first["type"] == "unexpected_keyword_argument":
            raise BadInputError(
                f"the journal records run option {key!r}, unknown to this pretuner; "
                f"the run was made by {who}",
                hint="resume it with that version, or start a new run",
            )
        if first["type"] == "missing":
            raise BadInputError(
                f"the journal's run options lack {key!r}; the run was made by {who}",
                hint="resume it with that version, or start a new run",
            )
        want = typing.get_type_hints(cls)[key]
        raise BadInputError(
            f"the journal records run option {key} = {data[key]!r}, not "
            f"{getattr(want, '__name__', str(want))}",
            hint=f"the run was made by {who} or edited: start a new run",
        )

    def check(self) -> None:
        """Refuse a bad value with a one-line error naming it (exit 2), before a launch or a run
        folder."""
        o = self
        if not o.model.strip():
            raise BadInputError("--model is empty", hint="pass a registry name or a model folder")
        v.layout(o.card_gib, o.util, o.tp, o.pp, o.block_size, o.headroom_gib)
        v.int_range("--max-model-len", o.max_model_len, 1)
        v.int_range("--min-model-len", o.min_model_len, 1)
        v.int_range("--nodes", o.nodes, 1)
        v.int_range("--cards-per-node", o.cards_per_node, 1)
        v.choice("--kv-cache-dtype", o.kv_cache_dtype, KV_DTYPES)
        v.non_negative("--reserve-gb", o.reserve_gib, example="1")
        v.int_range("--model-use-gb", o.model_use_gib, 1)
        v.int_range("--max-launches", o.max_launches, 1)
        v.int_range("--repeat-proof", o.repeat_proof, 1)
        if o.max_launches < 2 and o.validate:
            raise BadInputError(
                f"--max-launches {o.max_launches} leaves no launch for validation",
                hint="use 2 or more, or --no-validate",
            )
        if o.serve_cmd is not None:
            v.command_line("--serve-cmd", o.serve_cmd)
        for arg in o.server_args:
            v.command_line("--server-arg", arg)
        if o.out is not None and not v.path_text("--out", o.out).isprintable():
            # Its name is the run id that report.md and serve.sh print.
            raise BadInputError(f"--out {o.out!r} contains a newline or another control character",
                                hint="choose a folder name of printable characters")
        v.path_text("runs folder", o.runs_dir)
        v.positive("--ready-timeout", o.ready_timeout_s, example="1800")
        v.positive("--request-timeout", o.request_timeout_s, example="900")
        v.non_negative("--stop-grace", o.stop_grace_s, example="120")
        for flag, seconds in (("--ready-timeout", o.ready_timeout_s),
                              ("--request-timeout", o.request_timeout_s),
                              ("--stop-grace", o.stop_grace_s)):
            v.at_most(flag, seconds, v.MAX_WAIT_S, unit="s")
        if not o.host.strip():
            raise BadInputError("the server host is empty", hint="use 127.0.0.1")
        if o.limit_mm_per_prompt is not None:
            from pretuner.models.vision import parse_limit_mm_per_prompt

            parse_limit_mm_per_prompt(o.limit_mm_per_prompt)
        v.non_negative("--mm-processor-cache-gb", o.mm_processor_cache_gb, example="4")
        v.int_range("--soak", o.soak, 0)
        v.positive("--soak-minutes", o.soak_minutes, example="10")
        if o.quantization is not None:
            v.choice("--quantization", o.quantization, METHODS)
        v.non_negative("--cpu-offload-gb", o.cpu_offload_gib, example="14")
        v.non_negative("--swap-space", o.swap_space_gib, example="4")
        v.positive("--min-tokens-per-s", o.min_tokens_per_s, example="5")


# RunOptions field -> its `pretuner run` flag, in the fields' order (a re-tune command names
# them so): the flag is the field's name, but where the field names its unit or the flag is
# repeated; the fields that are no choice about the run have none.
_FLAGS = {"card_gib": "--card", "headroom_gib": "--headroom-gb", "reserve_gib": "--reserve-gb",
          "model_use_gib": "--model-use-gb", "server_args": "--server-arg",
          "ready_timeout_s": "--ready-timeout", "request_timeout_s": "--request-timeout",
          "stop_grace_s": "--stop-grace", "cpu_offload_gib": "--cpu-offload-gb",
          "swap_space_gib": "--swap-space"}
RETUNE_FLAGS = tuple((f.name, _FLAGS.get(f.name, "--" + f.name.replace("_", "-")))
                     for f in fields(RunOptions)
                     if f.name not in ("model", "runs_dir", "out", "host", "sim_env"))
_JOURNALED = pydantic.TypeAdapter(RunOptions)
