"""What the emulated r0.1 server writes beside its log: what it holds on its cards, for the
emulated `npu-smi` (`pretuner.sim.state`), and the truth file
(`--sim-truth`) a benchmark scores against."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pretuner.files import write_atomic
from pretuner.sim import memory as mem
from pretuner.sim.argv import Refused
from pretuner.sim.logs import RankWriter
from pretuner.sim.r01_checks import WHERE_MS
from pretuner.sim.state import Published, others_bytes, state_dir
from pretuner.sim.truth import max_safe_kv
from pretuner.units import GIB, MIB


@dataclass
class Rank:
    """One emulated rank: where it runs, its process, its log and its memory model."""

    rank: int
    node: int
    device_id: int
    pid: int
    log: RankWriter
    model: mem.CardModel


class CardState:
    """The server's use of its cards, published while it lives and removed when it ends."""

    def __init__(self, env: Mapping[str, str], profile: mem.CardProfile) -> None:
        self.env = env
        self.profile = profile
        self.files = Published()
        self.peak_mib = 0  # the most this server published for one of its cards

    def publish(self, ranks: Sequence[Rank], used_bytes: int) -> None:
        self.peak_mib = max(self.peak_mib, used_bytes // MIB)
        for r in ranks:
            self.files.hold(state_dir(self.env), "npu", r.node, r.device_id,
                            used_bytes // MIB - self.profile.driver_reserved_mib, r.pid)

    def init_pool(self, ranks: Sequence[Rank], cap: int, user_gb: float,
                  occupied_mib: int) -> None:
        """MindSpore's device init: the pool cap must fit in the card's free memory, which
        another tenant, or another live server on the same card (a leftover pre-run, say), has
        taken its share of; then the whole pool is the server's (`enable_vmm:False`)."""
        p = self.profile
        others = others_bytes(state_dir(self.env), "npu", [(r.node, r.device_id) for r in ranks])
        free = p.free_bytes - occupied_mib * MIB - others
        total = p.total_bytes
        if free < total // 2:
            msg = ("Malloc device memory failed, free memory size is less than half of total "
                   f"memory size.Device {ranks[0].device_id} Device HBM total size:{total} "
                   f"Device HBM free size:{free} may be other processes occupying this card, "
                   "check as: ps -ef|grep python")
            raise Refused("RuntimeError", msg, WHERE_MS)
        if cap >= free:
            msg = (f"The Free Device Memory Size is {free / GIB:g} GB, max_device_memory should "
                   f"be in range (0-{free / MIB:g}]MB, but got {cap / MIB:g}MB, please set the "
                   "context key max_device_memory in valid range.")
            for r in ranks:
                r.log.log("ERROR", "DEVICE", "mindspore/ccsrc/plugin/device/ascend/hal/device/"
                          "ascend_memory_adapter.cc:142", "Initialize",
                          f"#umsg#Framework Error Message:#umsg#{msg}")
            raise Refused("RuntimeError", msg, WHERE_MS)
        for r in ranks:
            r.log.py("WARNING", "For 'context.set_context', the parameter 'max_device_memory' "
                     "will be deprecated and removed in a future version. Please use the api "
                     "mindspore.set_device() instead.")
            r.log.adapter_init(p.total_mib, free, cap, user_gb)
            r.log.noise("start", 24)
        self.publish(ranks, (p.driver_reserved_mib + p.cann_mib) * MIB + cap)


def write_truth(path: Path, models: list[mem.CardModel], profile: mem.CardProfile, *,
                seed: int, total_gb: int, util: float, blocks: int, mml: int, seqs: int,
                batched: int, chunked: bool, occupied_mib: int) -> None:
    """The emulator's truth for this configuration, written atomically as JSON."""
    t = mem.truth(models, profile, seed, total_gb=total_gb, util=util, kv_blocks=blocks,
                  max_model_len=mml, max_num_seqs=seqs, batched=batched, chunked=chunked)
    data = asdict(t)
    free = profile.free_bytes - occupied_mib * MIB
    for name, integer in (("r01", True), ("physical", False)):
        fit = max_safe_kv(models, free, mml, batched=batched, chunked=chunked,
                          integer_model_use=integer)
        data[f"max_safe_kv_{name}"] = asdict(fit) if fit else None
    data["max_model_len"] = mml
    data["max_num_seqs"] = seqs
    data["max_num_batched_tokens"] = batched
    data["kv_blocks"] = blocks
    write_atomic(path, json.dumps(data, indent=2) + "\n", overwrite=True)
