"""A proven run as a vLLM recipes block (github.com/vllm-project/recipes, `models/ORG/MODEL.yaml`):
`meta.hardware.<profile>` marks the card verified, `hardware_overrides.<profile>.extra_args`
(and `extra_env`) carry the proven flags, and `evidence` says what proved them. Pure."""

from __future__ import annotations

import re
from typing import Any

import yaml

from pretuner.engines.vllm_v1 import PRODUCTION_FLAGS, ROWS
from pretuner.errors import BadInputError
from pretuner.report.records import PinnedDerivation, RunReport

# The recipes' hardware profiles (their taxonomy.yaml) by the card's name as pretuner knows it
# (an emulated card's name, or --hardware).
RECIPE_HARDWARE = {"H100": "h100", "H200": "h200", "B200": "b200", "B300": "b300",
                   "GB200": "gb200", "GB300": "gb300", "MI300X": "mi300x", "MI325X": "mi325x",
                   "MI355X": "mi355x", "910C": "ascend_910c"}


def recipe_hardware(rep: RunReport, given: str | None) -> str:
    """The recipes' profile id of the run's card: `given`, else found in the card's name."""
    if given is not None:
        if not re.fullmatch(r"[a-z0-9_]+", given):
            raise BadInputError(f"--hardware {given!r} is not a recipes hardware profile id",
                                hint=f"e.g. {', '.join(sorted(set(RECIPE_HARDWARE.values())))}")
        return given
    words = set(re.findall(r"[A-Za-z0-9]+", rep.card_source.upper()))
    found = [v for k, v in RECIPE_HARDWARE.items() if k in words]
    if len(found) != 1:
        raise BadInputError(
            f"the run does not name its card as a recipes hardware profile "
            f"(card: {rep.card_source!r})",
            hint=f"pass --hardware ID, e.g. {', '.join(sorted(set(RECIPE_HARDWARE.values())))}",
        )
    return found[0]


def _skip_flags(flags: list[str]) -> list[str]:
    """The flags without production's address and name: a recipe's card override sets neither."""
    out: list[str] = []
    skip = False
    for word in flags:
        if skip:
            skip = False
            continue
        if word.partition("=")[0] in PRODUCTION_FLAGS:
            skip = "=" not in word
            continue
        out.append(word)
    return out


def recipe_block(rep: RunReport, report_sha256: str, hardware: str | None,
                 date: str) -> dict[str, Any]:
    """The recipe keys for the run's card: marked verified where a real device proved it
    ("unverified" for the emulated card's simulated figures)."""
    if rep.engine not in ROWS or not isinstance(rep.derivation, PinnedDerivation):
        raise BadInputError(f"run {rep.run_id} tuned {rep.engine}, not a vLLM V1 engine",
                            hint=f"export a run of --engine {', '.join(ROWS)}")
    if not rep.validated:
        raise BadInputError(f"run {rep.run_id} was NOT validated under full load",
                            hint="export a validated run; a recipe marks its flags verified")
    profile = recipe_hardware(rep, hardware)
    override: dict[str, Any] = {"extra_args": _skip_flags(list(rep.final.flags))}
    if rep.final.env:
        override["extra_env"] = dict(rep.final.env)
    override["evidence"] = {
        "tool": f"pretuner {rep.pretuner_version}",
        "run_id": rep.run_id,
        "report_json_sha256": report_sha256,
        "engine": rep.engine,
        "engine_version": rep.engine_version or "not recorded",
        "date": date,
        "provenance": rep.provenance,
        "proof": f"validated under full load, TP{rep.tp} x PP{rep.pp}, max-model-len "
                 f"{rep.final.max_model_len}, max-num-seqs {rep.final.max_num_seqs}",
    }
    status = "unverified" if rep.simulated else "verified"
    return {"meta": {"hardware": {profile: status}}, "hardware_overrides": {profile: override}}


def recipe_yaml(block: dict[str, Any]) -> str:
    """The block as YAML, headed by where it goes."""
    head = ("# pretuner presets export --format vllm-recipe: merge into the model's recipe "
            "(vllm-project/recipes, models/ORG/MODEL.yaml)\n")
    return head + yaml.safe_dump(block, sort_keys=False, default_flow_style=False)
