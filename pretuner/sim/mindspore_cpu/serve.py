"""The reference server: the emulated r0.1 server's interface over a real MindSpore network on CPU.

Same command line, environment and HTTP API; every memory figure is MindSpore's own: its pool
dump at a normal exit, its allocator's failure beyond the card (`card.py`). Exit codes: 0 after
a graceful stop, 1 on a startup error or an engine crash, 2 on usage."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from pretuner.errors import PretunerError
from pretuner.models import resolve
from pretuner.sim import memory as mem
from pretuner.sim.argv import Refused, serve_main
from pretuner.sim.engine import Engine
from pretuner.sim.mindspore_cpu import card
from pretuner.sim.mindspore_cpu.dims import Dims
from pretuner.sim.r01_checks import int_env, verify_vllm_config
from pretuner.sim.r01_config import VLLM_VERSION, build_parser, parse
from pretuner.sim.scheduler import SchedulerLimits
from pretuner.sim.serve import Server as R01Server
from pretuner.units import GIB

POOL_GROWTH = "1GB"
_WHERE = ('  File "pretuner/sim/mindspore_cpu/serve.py", in start\n')


class Server(R01Server):
    """The emulated r0.1 server's lifecycle (`pretuner.sim.serve.Server`) around a real
    network: MindSpore prints its own pool dump as the interpreter exits."""

    fatal = (Refused, RuntimeError, MemoryError)  # MindSpore's allocation failures raise these

    def failed_start(self, err: BaseException) -> int:
        if isinstance(err, Refused):
            return super().failed_start(err)
        sys.stderr.write(traceback.format_exc())
        return 1

    def _engine(self, limits: SchedulerLimits) -> Engine:
        from pretuner.sim.mindspore_cpu.engine import MsEngine  # imports MindSpore

        return MsEngine(self.net, limits, self.vlog, self._on_dead, seed=self.cfg.seed)

    def boot(self) -> SchedulerLimits:
        """MindSpore, the network, its KV cache and the card's limit, then the warm-up."""
        cfg, log = self.cfg, self.vlog
        log.info("api_server.py:712", f"vLLM API server version {VLLM_VERSION} "
                 "(pretuner mindspore-cpu reference server)")
        try:
            spec = resolve(cfg.model)
        except PretunerError as err:
            raise Refused("OSError", f"{cfg.model} is not a valid model identifier "
                          f"({err})", _WHERE) from None
        mml, batched = verify_vllm_config(cfg, spec)
        total_gb = self.total_gb(_WHERE)
        model_use = int_env(cfg.env, "vLLM_MODEL_MEMORY_USE_GB", _WHERE)
        log.info("ascend.py:116", f"max_device_memory for mindspore is: {total_gb * cfg.util}GB")

        card.keep_reservations_small()
        import mindspore as ms  # late: `--help` and usage errors do not pay for the import
        from mindspore import ops

        from pretuner.sim.mindspore_cpu.network import Seq, TinyLM

        ms.set_device("CPU")
        ms.set_context(mode=ms.PYNATIVE_MODE)
        cap_bytes = mem.pool_cap_bytes(total_gb, cfg.util)
        # MindSpore splits init_size evenly between its persistent and common pools: twice the
        # cap gives the common pool (where tensors live) one block of TOTAL x util, as
        # max_device_memory would on a card. The persistent half stays unused and is not
        # counted in the card.
        ms.runtime.set_memory(init_size=f"{2 * cap_bytes / GIB:.3f}GB",
                              increase_size=POOL_GROWTH)
        ops.add(ops.ones((8, 8), ms.float32), 1.0).asnumpy()  # pool and thread pools now exist
        dims = Dims.of(spec)
        net = TinyLM(dims, seed=cfg.seed)
        weights_gb = spec.weights_format(None).total_bytes / GIB
        log.info("model_runner.py:1099", f"Loading model weights took {weights_gb:.4f} GB")

        block_bytes = cfg.block_size * dims.kv_bytes_per_token()
        blocks = mem.r01_kv_blocks(total_gb, cfg.util, model_use, block_bytes)
        self.kv_blocks(blocks, 0, mml, _WHERE)
        net.allocate_cache(blocks, cfg.block_size)
        # The limit comes after weights and cache: both are in the pool, which the limit
        # counts once; what they left on the host side is part of the baseline.
        baseline = card.vm_size_bytes() - cap_bytes
        limit = card.limit_address_space(baseline, cap_bytes)
        log.info("card.py:60", f"pool capped at {cap_bytes >> 20} MiB (TOTAL x util) by "
                 f"RLIMIT_AS {limit >> 20} MiB = baseline {baseline >> 20} MiB + pool "
                 f"{cap_bytes >> 20} MiB + host allowance {card.HOST_ALLOWANCE_BYTES >> 20} MiB")

        warm = min(mem.WARMUP_TOKENS_CAP, mml)
        log.info("model_runner.py:1415", f"Warm-up with a dummy prefill of {warm} tokens.")
        net.forward([Seq([1] * warm, list(range(-(-warm // cfg.block_size))), 0)])

        self.net = net
        return SchedulerLimits(mml, cfg.max_num_seqs, batched, cfg.block_size, blocks,
                               pool_cap_bytes=cap_bytes)


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m pretuner.sim mindspore-cpu serve") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    args = args[1:] if args[:1] == ["serve"] else args
    return serve_main(args, prog, lambda: build_parser(prog), parse,
                      lambda cfg: Server(cfg).run())
