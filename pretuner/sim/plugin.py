"""The emulator as a plugin (`pretuner.emulation.Emulator`), registered in the `pretuner.emulators`
entry-point group (pyproject.toml): what production may ask of it."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from pretuner.devices.base import DeviceReader
from pretuner.devices.cpu import HostMemory
from pretuner.emulation import Personality
from pretuner.errors import BadInputError
from pretuner.sim.v1.memory import CUDA_PROFILES

# The emulated cards by --card size: Ascend for r0.1 (64 GB when none is given), CUDA for V1
# (80 GB, an H100, when none is given; the first row of a size in CUDA_PROFILES is its default).
R01_CARDS = {64: "910b-64", 32: "910b-32", 24: "310p-24"}
V1_CARDS = {p.card_gb: p.name for p in reversed(CUDA_PROFILES.values())}
PREFIX = "PRETUNER_SIM_"
COMMANDS: dict[Personality, tuple[str, ...]] = {
    # Behind the same kind of wrapper as r0.1 (a child via subprocess.run), so the process
    # handling meets the real trap.
    "r01": ("-m", "pretuner.sim", "launch", "vllm.entrypoints.openai.api_server"),
    "v1": ("-m", "pretuner.sim", "vllm", "serve"),
    "mindspore-cpu": ("-m", "pretuner.sim", "mindspore-cpu", "serve"),
}


def _profile(cards: dict[int, str], card_gib: int | None, default: int, what: str) -> str:
    """The profile of a --card size; `what` names the card and its unit (a CUDA card's size
    is sold in GB, as vLLM users say it)."""
    if card_gib is None:
        return cards[default]
    if card_gib not in cards:
        sizes = ", ".join(str(k) for k in sorted(cards, reverse=True))
        raise BadInputError(f"{what.format(card_gib)} profile", hint=f"use --card {sizes}")
    return cards[card_gib]


class SimEmulator:
    def server_command(self, personality: Personality) -> list[str]:
        return [sys.executable, *COMMANDS[personality]]

    def launch_env(self, personality: Personality, card_gib: int | None, seed: int,
                   exported: Mapping[str, str], *, weights_format: str | None = None,
                   nodes: int = 1) -> dict[str, str]:
        if personality == "mindspore-cpu":
            return {}  # real MindSpore on the host: no emulated card to pick
        knobs = {k: v for k, v in exported.items() if k.startswith(PREFIX)}
        if personality == "v1":
            profile = _profile(V1_CARDS, card_gib, 80, "the emulated CUDA card has no {} GB")
            # An exported CUDA profile picks among the cards of that size (a100-80 for 80);
            # another (an r0.1 profile) means nothing here.
            chosen = CUDA_PROFILES.get(knobs.pop(f"{PREFIX}PROFILE", ""))
            if chosen is not None and chosen.card_gb == CUDA_PROFILES[profile].card_gb:
                profile = chosen.name
            return {f"{PREFIX}PROFILE": profile, f"{PREFIX}SEED": str(seed), **knobs}
        profile = _profile(R01_CARDS, card_gib, 64, "the emulated card has no {} GiB")
        env = {f"{PREFIX}PROFILE": profile, f"{PREFIX}SEED": str(seed)}
        if weights_format is not None:
            env[f"{PREFIX}WEIGHTS_FORMAT"] = weights_format
        if nodes > 1:
            env[f"{PREFIX}NODES"] = str(nodes)
        return {**env, **knobs}  # the knobs the user exported (another profile...) win

    def server_flags(self, personality: Personality, argv: list[str]) -> list[str]:
        """A launch's argv without the emulated server's command (what an in-process run
        parses); a command that is not the emulator's (a --serve-cmd) is kept whole."""
        prefix = self.server_command(personality)
        return argv[len(prefix):] if argv[: len(prefix)] == prefix else argv

    def card_name(self, env: Mapping[str, str]) -> str | None:
        card = CUDA_PROFILES.get(env.get(f"{PREFIX}PROFILE", ""))
        return None if card is None else f"emulated {card.model} {card.card_gb} GB"

    def batch_defaults(self, env: Mapping[str, str]) -> tuple[int, int]:
        from pretuner.sim.v1 import config

        profile = CUDA_PROFILES[env.get(f"{PREFIX}PROFILE") or V1_CARDS[80]]
        return config.batch_defaults(profile, env)

    def smi_command(self) -> list[str]:
        return [sys.executable, "-m", "pretuner.sim", "npu-smi", "info"]

    def device_reader(self, env: Mapping[str, str], devices: frozenset[int]) -> DeviceReader:
        from pretuner.sim.reader import EmulatedReader

        return EmulatedReader(env, devices)

    def host_memory(self, env: Mapping[str, str]) -> HostMemory | None:
        from pretuner.sim.v1 import offload

        profile = env.get(f"{PREFIX}PROFILE") or V1_CARDS[80]
        if profile not in CUDA_PROFILES:
            return None
        raw = env.get(offload.HOST_ENV)
        host_mib = int(raw) if raw and raw.isdigit() else None
        return HostMemory(offload.host_available_bytes(profile, host_mib),
                          offload.host_total_bytes(profile, host_mib), "simulated",
                          "the emulated host")


EMULATOR = SimEmulator()
