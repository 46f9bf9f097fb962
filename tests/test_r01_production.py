"""What production runs on each vLLM-MindSpore version, from the settings an r0.1 run proved
(`R01Engine.production`): the version facts live in the engine, the scripts only render them."""

from __future__ import annotations

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.mindspore_r01 import R01, R01Engine
from pretuner.errors import BadInputError

SETTINGS = LaunchSettings(Purpose.VALIDATE, card_gib=64, util=0.9, model_use_gib=46,
                          max_model_len=65536, max_num_seqs=12, max_num_batched_tokens=2048,
                          block_size=16, tp=16, kv_cache_bytes=15_000_000_000,
                          chunked_prefill=True)


def production(version: str | None, backend: str | None = None) -> tuple[dict[str, str],
                                                                          dict[str, str | None],
                                                                          tuple[str, ...]]:
    d = R01Engine(R01, False, version, "test", backend=backend).production(SETTINGS)
    return d.env, dict(d.flags), d.notes


@pytest.mark.parametrize(("version", "memory_vars", "chunk_flag", "kv_flag", "backend_var"), [
    (None, True, True, False, "vLLM_MODEL_BACKEND"),    # unknown: r0.1, what the run proved
    ("0.1", True, True, False, "vLLM_MODEL_BACKEND"),
    ("0.3.0", False, False, False, "vLLM_MODEL_BACKEND"),  # ignores the variables, always chunks
    ("0.4", False, False, False, "VLLM_MS_MODEL_BACKEND"),  # the backend variable's new name
    ("0.5.1", False, False, True, "VLLM_MS_MODEL_BACKEND"),  # the KV cache pinned in bytes
])  # fmt: skip
def test_each_version_gets_the_variables_and_flags_it_reads(
        version: str | None, memory_vars: bool, chunk_flag: bool, kv_flag: bool,
        backend_var: str) -> None:
    env, flags, notes = production(version, backend="MindFormers")
    assert env["GLOG_v"] == "2"  # production at WARNING: the pool dump is the tuner's
    assert ("ASCEND_TOTAL_MEMORY_GB" in env) is memory_vars
    assert (env.get("vLLM_MODEL_MEMORY_USE_GB") == "46") is memory_vars
    assert ("--enable-chunked-prefill" in flags) is chunk_flag
    assert (flags.get("--kv-cache-memory-bytes") == "15000000000") is kv_flag
    assert env[backend_var] == "MindFormers"
    assert flags["--gpu-memory-utilization"] == "0.9"
    # a later version says what it ignores, and where the KV cache is not pinned, why
    assert any("ignores" in n for n in notes) is (not memory_vars)
    assert any("sizes the KV cache by profiling" in n for n in notes) is (
        not memory_vars and not kv_flag)


def test_no_backend_sets_no_backend_variable() -> None:
    env, _, _ = production("0.4")
    assert not {"vLLM_MODEL_BACKEND", "VLLM_MS_MODEL_BACKEND"} & env.keys()


def test_a_version_that_is_not_one_is_refused() -> None:
    with pytest.raises(BadInputError, match="'next' is not understood"):
        production("next")


def test_from_0_5_no_pinned_bytes_means_no_kv_flag_and_no_profiling_excuse() -> None:
    """0.5 takes the flag; settings without a pinned KV cache leave it out, and the note that a
    version without the flag cannot enforce the KV figure does not apply to it."""
    from dataclasses import replace

    d = R01Engine(R01, False, "0.5", "test").production(replace(SETTINGS, kv_cache_bytes=None))
    assert "--kv-cache-memory-bytes" not in dict(d.flags)
    assert not any("profiling" in n for n in d.notes)
