# Sourced by the scripts of scripts/gpu/ on a GPU machine that has torch but no vllm and no
# network: the payload (scripts/gpu/vllm_payload.py) in $STAGE (default /tmp/stage) as
# `vllm.part*` (a split tar.xz of the vllm wheel's tree) and `light/*.whl` (its pure-Python
# dependencies) is installed under $SITE (default /tmp/site), with PATH and PYTHONPATH set.
export PYTHONUNBUFFERED=1
stage=${STAGE:-/tmp/stage}
site=${SITE:-/tmp/site}
mkdir -p "$site/bin"
t0=$(date +%s)
cat "$stage"/vllm.part* | xz -dc -T0 | tar -x -C "$site" || { echo "untar failed" >&2; exit 11; }
# Kernels carried apart (vllm_payload.py --moe writes moe.tar.xz: the MoE kernels, 39 MB).
for extra in "$stage"/*.tar.xz; do
  [ -e "$extra" ] && { tar -xJf "$extra" -C "$site" || { echo "untar $extra failed" >&2; exit 11; }; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  "$stage"/light/*.whl 2>&1 | grep -v "already exists"
# `pip --target` writes no console script for a tree that was untarred: vllm's own, by hand.
printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > "$site/bin/vllm"
chmod +x "$site/bin/vllm"
export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
echo "install $(( $(date +%s) - t0 )) s"
python3 -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
