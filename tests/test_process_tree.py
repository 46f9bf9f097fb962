"""A server's whole process tree is pretuner's: nothing it started outlives a SIGKILL of
pretuner, a Ctrl-C stops it without waiting out the stop grace, and every launch takes a model
folder whatever its name."""

from __future__ import annotations

import pytest

from pretuner.engines.base import LaunchSettings, Purpose, Target
from pretuner.engines.mindspore_r01 import R01Engine
from pretuner.engines.vllm_v1 import ROWS, V1Engine
from pretuner.sim.argv import server_parser

SETTINGS = LaunchSettings(Purpose.VALIDATE, card_gib=80, util=0.9, model_use_gib=0,
                          max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=8192,
                          block_size=16, tp=1, kv_cache_bytes=2**34)


@pytest.mark.parametrize("engine", [V1Engine(ROWS["vllm"], simulated=False),
                                    R01Engine("vllm-mindspore-r01", False, "0.1.0", "test")],
                         ids=["v1", "r01"])
def test_a_model_folder_named_like_a_flag_reaches_the_server_as_its_value(
        engine: V1Engine | R01Engine) -> None:
    # Seen: a folder named `-rf` is served under the name `-rf`, and `--served-model-name -rf`
    # made the server's parser (argparse, as vLLM's) take `-rf` for flags: every launch exit 2.
    cmd = engine.command(SETTINGS, Target("/models/-rf", "-rf", "127.0.0.1", 8000))
    start = cmd.argv.index("/models/-rf") if "/models/-rf" in cmd.argv else 0
    parser = server_parser("vllm serve", "", "")
    ns, _ = parser.parse_known_args(cmd.argv[start:])
    assert (ns.model or ns.model_tag) == "/models/-rf"
    assert ns.served_model_name == ["-rf"]
    assert ns.max_model_len == 4096
