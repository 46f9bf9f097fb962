"""Build what `run_vllm_gpu.sh` installs on a GPU machine that has torch but no vllm and no
network, in parts small enough to carry one at a time.

1. The dependency closure of `vllm==VERSION` for CPython 3.12 on x86_64 Linux, skipping the
   packages the machine already has (`--have FILE`: one name per line or space-separated) and
   the CUDA kernel libraries that a dense bf16 model on Hopper never imports (`--skip`);
   every wheel is fetched with `pip download --no-deps` into OUT/light, with what pretuner
   itself needs newer than the machine has (`--also`).
2. The vllm wheel's own tree without the files named by `--drop` (FlashAttention 2 and the MoE
   kernels: FA3 serves Hopper, a dense model needs no MoE), as a tar.xz split into
   `--part-mb` parts (OUT/vllm.partNN).
3. OUT/qwen3-8b: the Qwen3-8B config with the word-level tokenizer of make_tiny_qwen3.py.
4. With `--moe`: OUT/moe.tar.xz, the MoE kernels apart (39 MB, one more carrying call;
   install_vllm.sh unpacks every *.tar.xz of the stage), and OUT/qwen3-30b-a3b beside
   qwen3-8b. Made tests/fixtures/real/vllm-0.24-h200-moe.

    python scripts/gpu/vllm_payload.py --have image-packages.txt --out /tmp/payload
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
          "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35, 39)]
PLATFORMS += ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
SKIP = ("flashinfer-python", "flashinfer-cubin", "tilelang", "nvidia-cutlass-dsl",
        "quack-kernels", "tokenspeed-mla", "humming-kernels", "fastsafetensors",
        "nvidia-cudnn-frontend", "torch", "torchaudio", "torchvision")
MOE_KERNELS = "vllm/_moe_C_stable_libtorch.abi3.so"
DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", MOE_KERNELS, "vllm/vllm-rs")
MODELS = {"qwen3-8b": "Qwen--Qwen3-8B.json", "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B.json"}


def download(spec: str, into: Path) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    *platforms, "-d", str(into), spec], check=True)


def wheel_of(name: str, folder: Path) -> Path | None:
    for wheel in folder.glob("*.whl"):
        if canonicalize_name(wheel.name.split("-")[0]) == name:
            return wheel
    return None


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    found = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(req.marker.evaluate({**TARGET, "extra": e})
                                         for e in ["", *sorted(extras)]):
                found.append(req)
    return found


def closure(roots: list[str], have: set[NormalizedName], skip: set[NormalizedName],
            into: Path) -> None:
    """Fetch `root` and every requirement the machine lacks, extras included, breadth first.
    A later requirement that the fetched version does not meet fetches again: vllm 0.24 pins
    apache-tvm-ffi 0.1.9 for flashinfer (skipped), xgrammar 0.2.8 needs 0.1.11 or later."""
    seen: dict[str, set[str]] = {}
    queue = [Requirement(r) for r in roots]
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if (name in have and not forced(name, roots)) or name in skip:
            continue
        wheel = wheel_of(name, into)
        if wheel is not None and not req.specifier.contains(wheel.name.split("-")[1],
                                                            prereleases=True):
            wheel.unlink()
            wheel = None
        elif name in seen and req.extras <= seen[name]:
            continue
        if wheel is None:
            download(f"{req.name}{req.specifier}", into)
            wheel = wheel_of(name, into)
        if wheel is None:
            raise SystemExit(f"pip downloaded no wheel named {name}")
        seen[name] = seen.get(name, set()) | set(req.extras)
        queue += requirements(wheel, seen[name])


def forced(name: str, roots: list[str]) -> bool:
    """A root is fetched even where the machine has it (a version pretuner needs)."""
    return any(canonicalize_name(Requirement(r).name) == name for r in roots)


def vllm_parts(wheel: Path, out: Path, drop: tuple[str, ...], part_bytes: int,
               moe: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)  # noqa: S202  (the wheel pip just fetched)
        if moe:
            with tarfile.open(out / "moe.tar.xz", "w:xz") as tar:
                tar.add(Path(tmp) / MOE_KERNELS, arcname=MOE_KERNELS)
        for name in drop:
            (Path(tmp) / name).unlink(missing_ok=True)
        packed = out / "vllm.tar.xz"
        with tarfile.open(packed, "w:xz") as tar:
            for item in sorted(Path(tmp).iterdir()):
                tar.add(item, arcname=item.name)
    data = packed.read_bytes()
    for i in range(0, len(data), part_bytes):
        (out / f"vllm.part{i // part_bytes:02d}").write_bytes(data[i:i + part_bytes])
    packed.unlink()


def model_folder(out: Path, name: str) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_qwen3

    folder = out / name
    make_tiny_qwen3.write(folder)
    config = ROOT.parent / "shared" / "model-configs" / MODELS[name]
    (folder / "config.json").write_text(json.dumps(json.loads(config.read_text()), indent=1)
                                        + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="0.24.0")
    parser.add_argument("--have", type=Path, required=True,
                        help="the names of the packages the GPU machine already has")
    parser.add_argument("--skip", nargs="*", default=list(SKIP))
    parser.add_argument("--drop", nargs="*", default=list(DROP))
    parser.add_argument("--also", nargs="*", default=["typer>=0.29"],
                        help="more roots, fetched even where the machine has an older one "
                        "(pretuner needs typer 0.29; the machine had 0.27)")
    parser.add_argument("--moe", action="store_true",
                        help="also the MoE kernels (moe.tar.xz) and the Qwen3-30B-A3B folder")
    parser.add_argument("--part-mb", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    have = {canonicalize_name(n) for n in args.have.read_text().split()}
    light = args.out / "light"
    light.mkdir(parents=True, exist_ok=True)
    closure([f"vllm=={args.vllm}", *args.also], have, {canonicalize_name(n) for n in args.skip}, light)
    wheel = wheel_of("vllm", light)
    if wheel is None:
        raise SystemExit("no vllm wheel was fetched")
    vllm_parts(wheel, args.out, tuple(args.drop), args.part_mb * 1_000_000, args.moe)
    wheel.unlink()
    for name in ("qwen3-8b", "qwen3-30b-a3b") if args.moe else ("qwen3-8b",):
        model_folder(args.out, name)
    for path in sorted(args.out.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size / 1e6:8.1f} MB  {path.relative_to(args.out)}")


if __name__ == "__main__":
    main()
