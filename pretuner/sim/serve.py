"""`pretuner sim serve`: an emulated vLLM-MindSpore r0.1 OpenAI server on an emulated Ascend card.

Same command line, environment, HTTP API, log lines and failure modes as r0.1; memory figures
are *simulated* (`pretuner.sim.memory`). Emulator knobs are `--sim-*` options or
`PRETUNER_SIM_*` variables. With `--sim-nodes N` the ranks split over N emulated nodes, node k
logging to `$GLOG_log_dir/node<k>`; with a Ray address they are placed on the cluster's nodes
(`pretuner.sim.raynodes`). Exit codes: 0 after a graceful stop, 1 on a startup error or crash."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from pretuner.errors import PretunerError
from pretuner.files import write_atomic
from pretuner.models import resolve
from pretuner.sim import memory as mem
from pretuner.sim.argv import Refused, serve_main
from pretuner.sim.engine import (
    LOAD_OOM,
    Engine,
    OutOfMemory,
    RankPool,
    check_step,
    log_oom,
)
from pretuner.sim.http import ANY_HOST, ApiConfig, print_routes, serve_in_thread, uvicorn_started
from pretuner.sim.logs import RankLog, VllmLog, glog_level
from pretuner.sim.r01_checks import (
    WHERE_CACHE,
    WHERE_CONFIG,
    WHERE_MODEL,
    WHERE_MS,
    WHERE_RAY,
    check_kv_blocks,
    chunked_prefill,
    int_env,
    traceback_text,
    verify_vllm_config,
)
from pretuner.sim.r01_config import (
    NODE_LOG_DIRS_ENV,
    VLLM_VERSION,
    ServeConfig,
    build_parser,
    parse,
)
from pretuner.sim.r01_http import SimHTTPServer
from pretuner.sim.scheduler import SchedulerLimits
from pretuner.sim.state import Published, boot_noise_mib, others_bytes, state_dir
from pretuner.sim.truth import truth
from pretuner.stopflag import StopFlag
from pretuner.units import GIB, MIB

if TYPE_CHECKING:
    from pretuner.sim.raynodes import RayRanks

ROUTES = (("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/health", "GET"),
          ("/tokenize", "POST"), ("/detokenize", "POST"), ("/v1/models", "GET"),
          ("/version", "GET"), ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
          ("/v1/embeddings", "POST"))


class Server:
    """One emulated server process: startup phases, HTTP, graceful stop, crash."""

    fatal: tuple[type[Exception], ...] = (Refused, OutOfMemory)  # a failed start

    def __init__(self, cfg: ServeConfig, stream: TextIO | None = None) -> None:
        self.cfg = cfg
        self.stream = stream  # where every line goes (stderr unless run in-process)
        self.vlog = VllmLog(stream)
        self.stop = StopFlag()
        self.profile = mem.PROFILES[cfg.profile]
        self.files = Published()  # what npu-smi shows of its cards
        self.peak_mib = 0  # what this server published for each of its cards
        self.pools: list[RankPool] = []
        self.pool_cap = 0
        self.dead: Exception | None = None
        self.crashed = threading.Event()
        self._phase_s = cfg.startup_s / 5
        self.remote: RayRanks | None = None  # ranks on a Ray cluster's nodes

    # -- helpers -----------------------------------------------------------------------------
    def _node_log_dir(self, node: int) -> Path | None:
        env = self.cfg.env
        if env.get("GLOG_logtostderr", "1") != "0":
            return None
        listed = env.get(NODE_LOG_DIRS_ENV)
        if listed:
            dirs = listed.split(os.pathsep)
            if node < len(dirs):
                return Path(dirs[node])
        base = env.get("GLOG_log_dir")
        if not base:
            return None
        return Path(base) / f"node{node}" if self.cfg.nodes > 1 else Path(base)

    def total_gb(self, where: str | None = None) -> int:
        """ASCEND_TOTAL_MEMORY_GB as vLLM-MindSpore's platform reads it (64 when unset)."""
        if self.cfg.env.get("ASCEND_TOTAL_MEMORY_GB"):
            return int_env(self.cfg.env, "ASCEND_TOTAL_MEMORY_GB", where)
        self.vlog.warning("ascend.py:110", "Total device memory should be set by environ "
                          "'ASCEND_TOTAL_MEMORY_GB', please check size by cmd(npu-smi info). For "
                          "now, we will try default size(64GB) which might not be correct "
                          "exactly.")
        return 64

    def kv_blocks(self, blocks: int, cpu_blocks: int, mml: int, where: str) -> None:
        """vLLM's checks on the KV blocks r0.1 computed, and the lines it prints after them."""
        max_seq = check_kv_blocks(blocks, self.cfg.block_size, mml, where)
        self.vlog.info("executor_base.py:92", f"# npu blocks: {blocks}, # CPU blocks: "
                       f"{cpu_blocks}")
        self.vlog.info("executor_base.py:97", f"Maximum concurrency for {mml} tokens per "
                       f"request: {max_seq / mml:.2f}x")

    def _visible_devices(self) -> list[int]:
        raw = self.cfg.env.get("ASCEND_RT_VISIBLE_DEVICES")
        if not raw:
            return list(range(self.profile.cards_per_node))
        try:
            return [int(x) for x in raw.split(",") if x.strip()]
        except ValueError:
            raise Refused("RuntimeError", f"Invalid ASCEND_RT_VISIBLE_DEVICES {raw!r}",
                          WHERE_MS) from None

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        self.stop.install()
        try:
            return self._run()
        finally:
            if self.remote is not None:  # what the ranks were sent lands on their nodes
                self.remote.close()

    def _run(self) -> int:
        try:
            limits = self.boot()
            server = None if limits is None else self._serve(limits)
        except self.fatal as err:
            return self.failed_start(err)
        if server is None:  # stopped during startup
            return self._graceful()
        while not self.stop.wait(0.1):
            if self.crashed.is_set():
                return self._crash_exit(server)
        return self._graceful(server)

    def boot(self) -> SchedulerLimits | None:
        """Everything before the socket opens; None when a stop signal came during it."""
        cfg, log = self.cfg, self.vlog
        log.info("api_server.py:712", f"vLLM API server version {VLLM_VERSION}")
        key = cfg.api_keys[0] if cfg.api_keys else None  # vLLM 0.6.6 logs its own --api-key
        log.info("api_server.py:713", f"args: Namespace(model={cfg.model!r}, host={cfg.host!r}, "
                 f"port={cfg.port}, api_key={key!r}, max_model_len={cfg.max_model_len}, "
                 f"max_num_seqs={cfg.max_num_seqs}, "
                 f"max_num_batched_tokens={cfg.max_num_batched_tokens}, "
                 f"gpu_memory_utilization={cfg.util}, tensor_parallel_size={cfg.tp}, "
                 f"pipeline_parallel_size={cfg.pp}, block_size={cfg.block_size}, "
                 f"served_model_name={list(cfg.served_names)!r})")
        try:
            spec = resolve(cfg.model)
            weights_fmt = spec.weights_format(cfg.weights_format)
        except PretunerError as err:
            raise Refused("OSError", f"{cfg.model} is not a local folder and is not a valid "
                          f"model identifier ({err})", WHERE_MODEL) from None
        mml, batched = verify_vllm_config(cfg, spec)
        chunked = chunked_prefill(cfg, mml)
        if chunked and cfg.chunked_prefill is None:
            log.warning("arg_utils.py:1099", "Chunked prefill is enabled by default for models "
                        "with max_model_len > 32K. Currently, chunked prefill might not work "
                        "with some features or models. If you encounter any issues, please "
                        "disable chunked prefill by setting --enable-chunked-prefill=False.")
        if chunked:
            log.info("config.py:1020", "Chunked prefill is enabled with "
                     f"max_num_batched_tokens={batched}.")
        env = cfg.env
        total_gb = self.total_gb()
        self.pool_cap = cap = mem.pool_cap_bytes(total_gb, cfg.util)
        log.info("ascend.py:116", f"max_device_memory for mindspore is: {total_gb * cfg.util}GB")
        log.info("config.py:510", "This model supports multiple tasks: {'generate', 'embed'}. "
                 "Defaulting to 'generate'.")
        log.info("llm_engine.py:234", f"Initializing an LLM engine (v{VLLM_VERSION}) with config: "
                 f"model={cfg.model!r}, dtype=torch.{spec.dtype}, max_seq_len={mml}, "
                 f"download_dir=None, load_format=LoadFormat.AUTO, "
                 f"tensor_parallel_size={cfg.tp}, pipeline_parallel_size={cfg.pp}, "
                 f"kv_cache_dtype={cfg.kv_dtype}, device_config=npu, seed=0, "
                 f"served_model_name={cfg.served_names[0]}, enable_prefix_caching=False, "
                 f"chunked_prefill_enabled={chunked}, use_async_output_proc=True")

        # Ranks, nodes, devices. (An int8 cache of an MLA model keeps MindSpore's layout: see
        # pretuner.sim.kvcache.)
        layout = mem.Layout(tp=cfg.tp, pp=cfg.pp, block_size=cfg.block_size,
                            kv_dtype=cfg.kv_dtype)
        world = layout.world
        rng = random.Random(os.getpid())  # noqa: S311 - fake thread ids
        pid = os.getpid()
        # Real ranks are separate processes: made-up pids and thread ids, rank 0 the server's.
        idents = [(i, pid if i == 0 else pid + 7 * i,
                   0x7F0000000000 + rng.randrange(1 << 36) * 0x40) for i in range(world)]
        if cfg.ray_address:
            self.remote = self._place_on_ray(cfg.ray_address, idents)
            counts = list(self.remote.placement.ranks_per_node)
        elif world % cfg.nodes:
            raise Refused("ValueError", f"world size {world} cannot be split evenly over "
                          f"{cfg.nodes} nodes", WHERE_CONFIG)
        else:
            counts = [world // cfg.nodes] * cfg.nodes
        per_node = max(counts)
        devices = self._visible_devices()
        if len(devices) < per_node:
            raise Refused(
                "RuntimeError", f"Device count {len(devices)} from ASCEND_RT_VISIBLE_DEVICES is "
                f"less than the {per_node} ranks this node must run", WHERE_MS)
        try:
            models = mem.card_models(spec, weights_fmt.total_bytes, layout, cfg.seed,
                                     cfg.rank_skew)
            noise = boot_noise_mib(state_dir(cfg.env), cfg.boot_noise_mib) * MIB
            models = [replace(m, noise_bytes=noise) for m in models]
            block_bytes = models[0].block_bytes
        except Refused as err:
            raise Refused(err.exc_type, err.message, WHERE_CONFIG) from None
        starts = [sum(counts[:k]) for k in range(len(counts))]
        for (idx, rank_pid, tid), model in zip(idents, models, strict=True):
            node = max(k for k, first in enumerate(starts) if first <= idx)
            writer: RankLog = (self.remote.logs[idx] if self.remote is not None else
                                  RankLog(idx, rank_pid, tid, self._node_log_dir(node),
                                          self.stream, glog_level(cfg.env)))
            self.pools.append(RankPool(model, writer, devices[idx - starts[node]], 0, node=node))

        blocks = 0  # without a valid vLLM_MODEL_MEMORY_USE_GB r0.1 fails at the KV cache
        with contextlib.suppress(KeyError, ValueError):
            blocks = mem.r01_kv_blocks(total_gb, cfg.util,
                                       int(env["vLLM_MODEL_MEMORY_USE_GB"]), block_bytes)
        if cfg.truth:
            doc = truth(models, self.profile, seed=cfg.seed, total_gb=total_gb, util=cfg.util,
                        kv_blocks=blocks, max_model_len=mml, max_num_seqs=cfg.max_num_seqs,
                        batched=batched, chunked=chunked, occupied_mib=cfg.occupied_mib)
            write_atomic(Path(cfg.truth), json.dumps(doc, indent=2) + "\n", overwrite=True)

        self._init_pool(cap, total_gb * cfg.util)
        if self.stop.wait(self._phase_s):
            return None

        # Weights.
        for pool in self.pools:
            if pool.model.static_bytes > cap:
                raise self._load_oom(pool, "Default/model/embedding-Embedding/Gather-op0",
                                     pool.model.weights_bytes // 61 + 512)
        if self.stop.wait(2 * self._phase_s):
            return None
        weights_gb = self.pools[0].model.weights_bytes / GIB
        log.info("model_runner.py:1099", f"Loading model weights took {weights_gb:.4f} GB")

        # KV cache: r0.1's formula, then vLLM's checks, then the allocation in the pool.
        int_env(env, "vLLM_MODEL_MEMORY_USE_GB")  # r0.1's calc_block_num refuses it here
        self.kv_blocks(blocks, (4 * GIB) // block_bytes, mml, WHERE_CACHE)
        kv = blocks * block_bytes
        for pool in self.pools:
            if pool.model.static_bytes + kv > cap:
                raise self._load_oom(pool, "kv_cache", kv // max(1, pool.model.spec.num_layers))
            pool.kv_bytes = kv
        if self.stop.wait(self._phase_s):
            return None

        # r0.1 warm-up prefill.
        warm = min(mem.WARMUP_TOKENS_CAP, mml, batched)
        log.info("model_runner.py:1415", f"Capturing the model for warm-up with a dummy prefill "
                 f"of {warm} tokens.")
        try:
            check_step(self.pools, cap, mem.whole([warm]), 1)
        except OutOfMemory as oom:
            pool = self.pools[oom.rank]
            log_oom(pool.log, oom, pool.stats(), cfg.pool_format)
            raise
        if self.stop.wait(self._phase_s):
            return None

        return SchedulerLimits(mml, cfg.max_num_seqs, batched, cfg.block_size, blocks, chunked,
                               cap)

    def _load_oom(self, pool: RankPool, kernel: str, alloc_size: int) -> OutOfMemory:
        """MindSpore's OOM while loading and its pool dump: what the rank holds, or the whole cap
        when that is less (the KV cache did not fit beside the weights)."""
        pool.peak_dynamic = max(0, self.pool_cap - pool.in_used)
        oom = OutOfMemory(pool.log.rank, pool.device_id, kernel, alloc_size)
        log_oom(pool.log, oom, pool.stats(), self.cfg.pool_format, LOAD_OOM)
        return oom

    def _init_pool(self, cap: int, user_gb: float) -> None:
        """MindSpore's device init: the pool cap must fit in the card's free memory, which
        another tenant, or another live server on the same card (a leftover pre-run, say), has
        taken its share of; then the whole pool is the server's (`enable_vmm:False`)."""
        p, ranks, state = self.profile, self.pools, state_dir(self.cfg.env)
        others = others_bytes(state, "npu", [(r.node, r.device_id) for r in ranks])
        free = p.free_bytes - self.cfg.occupied_mib * MIB - others
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
        self.peak_mib = p.driver_reserved_mib + p.cann_mib + cap // MIB
        for r in ranks:
            r.log.py("WARNING", "For 'context.set_context', the parameter 'max_device_memory' "
                     "will be deprecated and removed in a future version. Please use the api "
                     "mindspore.set_device() instead.")
            r.log.adapter_init(p.total_mib, free, cap, user_gb)
            r.log.noise("start", 24)
            self.files.hold(state, "npu", r.node, r.device_id,
                            self.peak_mib - p.driver_reserved_mib, r.log.pid)

    def _serve(self, limits: SchedulerLimits) -> SimHTTPServer:
        """Engine + HTTP. The socket opens only now, like the real server after its warm-up."""
        cfg, log, mml = self.cfg, self.vlog, limits.max_model_len
        self.engine = self._engine(limits)
        self.engine.start()
        api = ApiConfig(cfg.served_names, cfg.model, mml, cfg.api_keys)
        host = cfg.host or ANY_HOST
        try:
            server = SimHTTPServer((host, cfg.port), self.engine, api, log, self._health)
        except OSError as err:
            log.error("launcher.py:60", f"[Errno {err.errno}] error while attempting to bind on "
                      f"address ({host!r}, {cfg.port}): {err.strerror}")
            raise Refused("OSError", f"[Errno {err.errno}] {err.strerror}",
                          WHERE_MS) from None
        port = server.server_address[1]
        log.info("api_server.py:640", "Using supplied chat template:\nNone")
        print_routes(log.info, ("launcher.py:19", "launcher.py:27"), ROUTES)
        serve_in_thread(server)
        uvicorn_started(log, os.getpid())
        log.uvicorn(f"Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)")
        return server

    def _engine(self, limits: SchedulerLimits) -> Engine:
        return Engine(self.pools, limits, self.vlog, self._on_dead,
                      pool_format=self.cfg.pool_format, seed=self.cfg.seed)

    def _on_dead(self, oom: Exception) -> None:
        self.dead = oom
        self.crashed.set()

    def _place_on_ray(self, address: str, idents: list[tuple[int, int, int]]) -> RayRanks:
        """vLLM's Ray executor: one NPU per rank on the cluster, this node first."""
        try:
            from pretuner.sim.raynodes import PlacementFailed, RayRanks
        except ImportError as err:
            raise Refused("ModuleNotFoundError", str(err), WHERE_RAY) from None
        try:
            remote = RayRanks(address, idents)
        except PlacementFailed as err:
            raise Refused("ValueError", str(err), WHERE_RAY) from None
        except PretunerError as err:  # Ray missing or the cluster unreachable
            raise Refused("ConnectionError", err.message, WHERE_RAY) from None
        # Ray's core installs its own SIGTERM handler (it dies at once, printing nothing);
        # vLLM's uvicorn installs its handlers after Ray starts, and so does the emulator.
        self.stop.install()
        remote.watch(lambda why: self.crashed.set())
        self.vlog.info("ray_gpu_executor.py:221", "Ray ranks: " + remote.placement.describe())
        return remote

    def _health(self) -> str | None:
        return self.remote.lost if self.remote is not None else None

    def _graceful(self, server: SimHTTPServer | None = None) -> int:
        """SIGINT/SIGTERM: stop serving, release the devices, every rank dumps its pool."""
        self.vlog.uvicorn("Shutting down")
        if server is not None:
            server.shutdown()
            server.server_close()
            self.engine.stop()
        for line in ("Waiting for application shutdown.", "Application shutdown complete.",
                     f"Finished server process [{os.getpid()}]"):
            self.vlog.uvicorn(line)
        time.sleep(self.cfg.teardown_s)  # device release takes seconds on a real card
        for pool in self.pools:
            stats = pool.stats()
            pool.log.pool_dump(stats, self.cfg.pool_format)
            pool.log.deinit(self.profile.total_mib, self.pool_cap, stats)
            pool.log.close()
        self.files.remove()
        return 0

    def failed_start(self, err: Exception) -> int:
        """The traceback the real server dies with before it serves; its exit code."""
        self.files.remove()
        out = self.stream or sys.stderr
        out.write(traceback_text(err.exc_type, err.message, err.where)
                  if isinstance(err, Refused)
                  else traceback_text("RuntimeError", str(err), WHERE_MS))
        out.flush()
        return 1

    def print_crash(self, why: object) -> None:
        self.vlog.error("engine.py:135", f"RuntimeError('{why}')")
        self.vlog.error("launcher.py:101", "AsyncLLMEngine has failed, terminating server process")

    def _crash_exit(self, server: SimHTTPServer) -> int:
        self.print_crash(self.dead or self._health())
        time.sleep(0.2)  # let the handlers send their 500s
        server.shutdown()
        server.server_close()
        self.vlog.uvicorn("Shutting down")
        self.vlog.uvicorn(f"Finished server process [{os.getpid()}]")
        self.files.remove()
        return 1


def main(argv: Sequence[str] | None = None, prog: str = "pretuner sim serve") -> int:
    """Run the emulated server until a signal or a crash; returns the exit code."""
    return serve_main(sys.argv[1:] if argv is None else argv, prog, lambda: build_parser(prog),
                      parse, lambda cfg: Server(cfg).run())
