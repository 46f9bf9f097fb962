"""`pretuner presets export --format vllm-recipe`: a proven run as a vLLM recipes block, read
back as YAML with the recipes' keys (models/ORG/MODEL.yaml: meta.hardware, hardware_overrides
with extra_args / extra_env), from the real vLLM 0.24.0 run on an H200."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from pretuner.errors import BadInputError
from pretuner.presets.recipe import recipe_block
from pretuner.report.records import RunReport, read_report
from tests.helpers import invoke

RUN = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200" / "run8k"


def _real_run() -> RunReport:
    rep = read_report(RUN)
    assert isinstance(rep, RunReport)
    return rep


def test_export_parses_as_a_recipe_with_the_proofs_evidence(tmp_path: Path) -> None:
    """The rule: the block holds the recipes' keys for the tuned card, marked verified, its
    extra_args the flags the run proved, and the evidence that ties it to that report.json."""
    out = tmp_path / "qwen3-8b.yaml"
    done = invoke("presets", "export", str(RUN), "--format", "vllm-recipe",
                  "--hardware", "h200", "--out", str(out))
    assert done.returncode == 0, done.stderr
    recipe = yaml.safe_load(out.read_text())
    raw = json.loads((RUN / "report.json").read_text())
    assert recipe["meta"]["hardware"] == {"h200": "verified"}
    override = recipe["hardware_overrides"]["h200"]
    assert override["extra_args"] == raw["final"]["flags"]
    assert override["extra_env"] == raw["final"]["env"]
    evidence = override["evidence"]
    assert evidence["report_json_sha256"] == hashlib.sha256(
        (RUN / "report.json").read_bytes()).hexdigest()
    assert evidence["engine_version"] == raw["engine_version"]
    assert evidence["provenance"] == "measured"
    assert set(evidence) >= {"date", "run_id", "tool"}
    again = invoke("presets", "export", str(RUN), "--format", "vllm-recipe",
                   "--hardware", "h200", "--out", str(out))
    assert again.returncode == 2  # never overwritten
    assert "already exists" in again.stderr


def test_a_card_without_a_recipes_name_asks_for_hardware() -> None:
    """The rule: pretuner never guesses the recipes' profile; one line asks for --hardware."""
    done = invoke("presets", "export", str(RUN), "--format", "vllm-recipe")
    assert done.returncode == 2
    assert "pass --hardware ID" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_emulated_figures_are_not_marked_verified() -> None:
    """The rule: simulated figures never claim a verified card; the emulated card's name picks
    the profile."""
    rep = _real_run().model_copy(update={"simulated": True, "provenance": "simulated",
                                         "card_source": "emulated H100 80 GB"})
    block = recipe_block(rep, "0" * 64, None, "2026-11-28")
    assert block["meta"]["hardware"] == {"h100": "unverified"}


def test_an_unvalidated_run_is_refused() -> None:
    """The rule: only a configuration proven under full load is exported."""
    rep = _real_run().model_copy(update={"validated": False})
    with pytest.raises(BadInputError, match="NOT validated"):
        recipe_block(rep, "0" * 64, "h200", "2026-11-28")


def test_production_address_and_name_stay_out_of_the_card_override() -> None:
    """The rule: a card's override carries the flags that shape memory, not the site's
    --host/--port/--served-model-name (the recipe serves its own model name)."""
    rep = _real_run()
    flags = ["--port", "8000", "--served-model-name=qwen", *rep.final.flags, "--host", "10.0.0.5"]
    rep = rep.model_copy(update={"final": rep.final.model_copy(update={"flags": flags})})
    block = recipe_block(rep, "0" * 64, "h200", "2026-11-28")
    assert block["hardware_overrides"]["h200"]["extra_args"] == _real_run().final.flags
