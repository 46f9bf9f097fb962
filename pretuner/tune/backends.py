"""Which server pretuner drives, which engine version is installed, and what card it runs on."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass

from pretuner.devices.npu_table import NpuCard, decode_output, parse_npu_processes, parse_npu_smi
from pretuner.engines.registry import installed_version
from pretuner.errors import BadInputError
from pretuner.tune.loop import LEN_LADDER, CardInfo
from pretuner.tune.settings import Backend

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lengths:
    """A backend's default --max-model-len / --min-model-len, its fallback ladder, and how many
    tokens each validation request decodes after its prompt (prompt + decode = max_model_len)."""

    max_model_len: int
    min_model_len: int
    ladder: tuple[int, ...]
    decode_tokens: int = 16


# The CPU reference server's models prefill on 2 cores: its ladder starts where a validation
# under full load still takes well under a minute per launch there.
LENGTHS = {
    Backend.MINDSPORE_CPU: Lengths(1024, 256, (1024, 512, 256), decode_tokens=4),
}
DEFAULT_LENGTHS = Lengths(16384, 4096, LEN_LADDER)


def lengths_for(backend: Backend) -> Lengths:
    return LENGTHS.get(backend, DEFAULT_LENGTHS)


@dataclass(frozen=True, slots=True)
class BackendChoice:
    backend: Backend
    simulated: bool
    engine_version: str | None
    reason: str


def engine_version() -> str | None:
    return installed_version("vllm-mindspore", "vllm_mindspore")


def choose_backend(requested: str) -> BackendChoice:
    """`auto`: vLLM-MindSpore when installed and npu-smi shows cards, else the emulated card."""
    try:
        wanted = Backend(requested) if requested != "auto" else None
    except ValueError:
        choices = ", ".join(["auto", *(b.value for b in Backend)])
        raise BadInputError(
            f"unknown backend {requested!r}", hint=f"choose one of: {choices}"
        ) from None
    version = engine_version()
    if wanted is Backend.VLLM_MINDSPORE:
        return BackendChoice(wanted, False, version, "--backend vllm-mindspore")
    if wanted is Backend.SIM:
        return BackendChoice(wanted, True, None, "--backend sim")
    if wanted is Backend.MINDSPORE_CPU:
        ms_version = installed_version("mindspore")
        if ms_version is None:
            raise BadInputError(
                "--backend mindspore-cpu needs MindSpore, which is not installed",
                hint="pip install 'pretuner[mindspore]' (MindSpore runs on CPU), or --backend sim",
            )
        # The reference server speaks r0.1: no vLLM-MindSpore version to adapt to.
        return BackendChoice(wanted, False, None, f"MindSpore {ms_version} on CPU")
    cards = read_cards([shutil.which("npu-smi") or "npu-smi", "info"])
    if version is not None and cards:
        return BackendChoice(
            Backend.VLLM_MINDSPORE,
            False,
            version,
            f"vllm-mindspore {version} and {len(cards)} NPU(s)",
        )
    why = "vLLM-MindSpore is not installed" if version is None else "npu-smi shows no card"
    return BackendChoice(Backend.SIM, True, None, f"{why}: using the emulated card")


def read_cards(argv: list[str], env: dict[str, str] | None = None) -> tuple[NpuCard, ...]:
    """Run an `npu-smi info` command and parse it; nothing when it is missing or fails."""
    return parse_npu_smi(_npu_smi_text(argv, env))


def _npu_smi_text(argv: list[str], env: dict[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(
            argv, capture_output=True, timeout=30, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        log.debug("npu-smi not usable: %s", err)
        return ""
    if proc.returncode != 0:
        return ""
    return decode_output(proc.stdout)  # non-UTF-8 bytes must not kill `pretuner run`


def detect_card(choice: BackendChoice, card_gib: int | None, sim_env: dict[str, str]) -> CardInfo:
    """Card size and free memory: from npu-smi (the emulated one for the sim) unless given."""
    if card_gib is not None and card_gib < 1:
        raise BadInputError(f"card size {card_gib} GiB is invalid", hint="e.g. --card 64")
    text, source = "", "given"
    if choice.backend is Backend.SIM:
        from pretuner.emulation import emulator

        text = _npu_smi_text(emulator().smi_command(), env=sim_env)
        source = "emulated npu-smi"
    elif choice.backend is Backend.VLLM_MINDSPORE:
        text, source = _npu_smi_text([shutil.which("npu-smi") or "npu-smi", "info"]), "npu-smi"
    cards = parse_npu_smi(text)
    if cards:
        total = min(c.hbm_total_mib for c in cards)
        free = min(c.hbm_total_mib - c.hbm_used_mib for c in cards)
        measured = round(total / 1024)
        if card_gib is not None and card_gib != measured:
            log.warning("--card %d differs from the %d GiB npu-smi reports", card_gib, measured)
        # Only the processes on the cards this run sizes for: every chip npu-smi listed.
        return CardInfo(card_gib or measured, free, source, parse_npu_processes(text))
    if card_gib is None:
        raise BadInputError(
            "no card size: npu-smi is not available here", hint="pass --card (e.g. --card 64)"
        )
    return CardInfo(card_gib, None, "given")
