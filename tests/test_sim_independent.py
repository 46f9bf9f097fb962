"""The emulator keeps a truth of its own: it never imports the tuner's arithmetic, and its own KV
sizing (`pretuner.sim.kvcache`) agrees with the tuner's (`pretuner.kvmath`) on every model the
project registers: two implementations of the engines' rules, checked against each other and
against figures from real runs (REFERENCE.md section 5)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import pretuner
from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import builtin_specs, resolve
from pretuner.models.spec import ModelSpec
from pretuner.sim import memory as mem
from pretuner.sim.argv import Refused
from pretuner.sim.kvcache import cache_layout, stage_layers
from pretuner.sim.v1.boot import check_args
from pretuner.sim.v1.config import parse
from pretuner.sim.v1.memory import V1Card, perturbed

# The tuner's arithmetic: what the emulator grades, so what it must never share.
TUNER = ("pretuner.kvmath", "pretuner.method", "pretuner.pinned")
PACKAGE = Path(pretuner.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(encoding="utf-8"), package)


def imports_in(source: str, package: str) -> set[str]:
    """Every module a source file of `package` imports, anywhere in it (function-level and
    relative imports resolved; `from a import b` counts as both `a` and `a.b`, since b may be a
    module; a dotted name in a string, for importlib, counts too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"[\w.]+", node.value):
            found.add(node.value)
    return found


def is_tuner(module: str) -> bool:
    return any(module == t or module.startswith(f"{t}.") for t in TUNER)


def source_of(module: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# The harness that runs the tuner against the emulator in this process (benchmarks, decision
# tests) imports the tuner by design; it is not the emulator's truth, and nothing else in the
# emulator may import it.
HARNESS = ("pretuner.sim.executor",)
SIM_FILES = sorted(p for p in (PACKAGE / "sim").rglob("*.py") if module_name(p) not in HARNESS)


@pytest.mark.parametrize(("code", "module"), [
    ("import pretuner.kvmath", "pretuner.kvmath"),
    ("import pretuner.kvmath as k", "pretuner.kvmath"),
    ("from pretuner import kvmath", "pretuner.kvmath"),
    ("from pretuner.method import derive", "pretuner.method"),
    ("from ... import pinned", "pretuner.pinned"),  # relative, from pretuner.sim.v1
    ("from ...kvmath import kv_tokens", "pretuner.kvmath"),
    ("def f():\n    from pretuner import pinned", "pretuner.pinned"),
    ("importlib.import_module('pretuner.method')", "pretuner.method"),
])
def test_the_import_walk_sees_every_form(code: str, module: str) -> None:
    found = imports_in(code, "pretuner.sim.v1")
    assert module in found
    assert any(is_tuner(m) for m in found)


@pytest.mark.parametrize("path", SIM_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_sim_module_imports_the_tuners_arithmetic(path: Path) -> None:
    assert not {m for m in imported(path) if is_tuner(m)}


def test_the_emulator_does_not_reach_the_harness() -> None:
    assert len(SIM_FILES) > 40
    assert not {module_name(p): sorted(set(HARNESS) & imported(p)) for p in SIM_FILES
                if set(HARNESS) & imported(p)}


def test_nor_does_anything_the_sim_imports() -> None:
    # Through helpers: follow every pretuner module the emulator imports (and their packages'
    # __init__), transitively, and never reach the tuner's arithmetic.
    todo = [module_name(p) for p in SIM_FILES]
    seen: dict[str, set[str]] = {}
    while todo:
        module = todo.pop()
        source = source_of(module)
        if module in seen or source is None:
            continue
        seen[module] = imported(source)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [m for m in seen[module] if m.startswith("pretuner")]
    reached = {m: sorted(filter(is_tuner, imps)) for m, imps in seen.items()}
    assert not {m: t for m, t in reached.items() if t}
    assert "pretuner.sim.kvcache" in seen  # the walk did follow the emulator's own imports


# -- the sim's KV sizing against the tuner's -------------------------------------------------


def layouts(spec: ModelSpec) -> list[tuple[int, int]]:
    """Every (tp, pp) the tuner's arithmetic accepts for this model, up to 16 x 4."""
    found = []
    for tp in (1, 2, 4, 8, 16):
        for pp in (1, 2, 3, 4):
            try:
                kv_bytes_per_token(spec, tp=tp, pp=pp)
            except BadInputError:
                continue
            found.append((tp, pp))
    return found


@pytest.mark.parametrize("spec", builtin_specs(), ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["auto", "bf16", "fp8", "int8"])
def test_the_sims_kv_per_token_agrees_with_the_tuners(spec: ModelSpec, dtype: str) -> None:
    # MindSpore's int8 cache of an MLA model is what the tuner calls int8-mla.
    tuner_dtype = "int8-mla" if dtype == "int8" and spec.kv_lora_rank else dtype
    checked = layouts(spec)
    assert checked
    for tp, pp in checked:
        mine = cache_layout(spec, tp=tp, pp=pp, cache_dtype=dtype).bytes_per_token
        assert mine == kv_bytes_per_token(spec, tp=tp, pp=pp, kv_dtype=tuner_dtype), (tp, pp)


@pytest.mark.parametrize(("model", "tp", "pp", "dtype", "expected"), [
    ("deepseek-v3", 1, 1, "auto", 70_272),  # 61 x (512 + 64) x 2 B, REFERENCE section 5
    ("deepseek-v3", 16, 1, "auto", 70_272),  # the latent is not split by TP
    ("deepseek-r1", 16, 1, "int8", 39_040),  # 61 x (512 x 1 + 64 x 2): MindSpore's int8 MLA
    ("deepseek-v3", 8, 2, "auto", 31 * 576 * 2),  # 61 layers over 2 stages: 31 + 30
    ("qwen3-vl-8b", 2, 1, "auto", 73_728),  # REFERENCE section 5, the real TP2 check
    ("qwen3-8b", 1, 1, "auto", 147_456),  # 36 x 2 (K, V) x 8 x 128 x 2 B
    ("qwen3-8b", 1, 1, "fp8", 73_728),
    ("qwen3-8b", 2, 5, "auto", 8 * 2 * 4 * 128 * 2),  # 36 over 5 stages: 7, 7, 7, 8, 7
    ("deepseek-r1-distill-llama-70b", 8, 1, "auto", 80 * 2 * 1 * 128 * 2),
    ("qwen2.5-72b", 16, 1, "auto", 80 * 2 * 1 * 128 * 2),  # 8 KV heads replicated over 16
    ("qwen3-235b-a22b", 8, 1, "auto", 94 * 2 * 1 * 128 * 2),  # 4 KV heads over 8 ranks
])
def test_kv_per_token_of_real_models(model: str, tp: int, pp: int, dtype: str,
                                     expected: int) -> None:
    assert cache_layout(resolve(model), tp=tp, pp=pp, cache_dtype=dtype).bytes_per_token \
        == expected


def test_stages_split_as_vllm_does() -> None:
    assert stage_layers(36, 1) == (36,)
    assert stage_layers(36, 5) == (7, 7, 7, 8, 7)  # the remainder goes to the second-last
    assert stage_layers(61, 4) == (15, 15, 16, 15)
    assert stage_layers(94, 8) == (11, 12, 12, 12, 12, 12, 12, 11)
    with pytest.raises(Refused, match="larger than the number of hidden layers"):
        stage_layers(4, 5)


def test_a_block_is_a_page_per_layer() -> None:
    layout = cache_layout(resolve("qwen3-8b"), tp=2)
    assert layout.slot_bytes == 2 * 512 * 2  # a key and a value plane of 4 x 128 bf16 values
    assert layout.block_bytes(128) == 36 * 128 * layout.slot_bytes


def test_both_emulated_cards_size_blocks_with_the_sims_own_rule() -> None:
    spec = resolve("qwen3-vl-8b")
    weights = spec.weights_format(None).total_bytes
    r01 = mem.card_models(spec, weights, mem.Layout(tp=2, block_size=128), 0)[0]
    v1 = V1Card(spec, weights, perturbed(0), tp=2, block_size=128)
    for card in (r01, v1):
        assert card.kv_bytes_per_token == 73_728
        assert card.block_bytes == 128 * 73_728
    assert v1.kv_tokens(int(44.30 * 2**30)) == 645_120  # REFERENCE section 5's real run


def test_kv_heads_that_do_not_split_over_the_ranks_are_refused() -> None:
    # Qwen2.5-7B: 28 heads split over 7 ranks, but its 4 KV heads neither split nor replicate.
    spec = resolve("qwen2.5-7b")
    with pytest.raises(Refused, match="7 is not divisible by 4"):
        cache_layout(spec, tp=7)
    card = mem.card_models(spec, spec.weights_format(None).total_bytes, mem.Layout(tp=7), 0)[0]
    with pytest.raises(Refused):
        _ = card.block_bytes
    cfg = parse(["--model", "qwen2.5-7b", "--tensor-parallel-size", "7"], {})
    with pytest.raises(Refused, match="7 is not divisible by 4"):
        check_args(cfg, spec)
