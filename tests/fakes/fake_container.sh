#!/usr/bin/env bash
# A fake `docker run` / `podman run` for `pretuner run --serve-cmd`: it drops the runner's own
# options, gives the "container" only the environment named with -e (NAME=VALUE, or NAME to copy
# the runner's value, as docker does), checks that a -p mapping publishes the server's --port to a
# server listening on all interfaces (127.0.0.1 inside a container is unreachable through -p),
# and runs the image's entrypoint from the image's own interpreter ($IMAGE_PYTHON, baked in by
# the test) with the server's output on its stdout, as `docker run` shows it.
set -euo pipefail
IMAGE_PYTHON=@IMAGE_PYTHON@
[[ ${1:-} == run ]] || { echo "fake container: only 'run' is known" >&2; exit 125; }
shift
envs=()
ports=()
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    -e|--env) envs+=("$2"); shift 2 ;;
    --env=*) envs+=("${1#--env=}"); shift ;;
    -p|--publish) ports+=("$2"); shift 2 ;;
    --publish=*) ports+=("${1#--publish=}"); shift ;;
    --gpus|--ipc|--name|-v|--volume|--device|--shm-size) shift 2 ;;
    *) shift ;;  # --rm, --init, --gpus=all, --ipc=host, --device=...
  esac
done
image=$1
shift
case $image in
  vllm/*) entry=(-m pretuner.sim vllm serve) ;;
  *) entry=(-m pretuner.sim serve) ;;  # an r0.1 image: the vLLM-MindSpore r0.1 server
esac
inside=(PATH=/usr/bin:/bin HOME=/nonexistent)
for e in "${envs[@]}"; do
  if [[ $e == *=* ]]; then
    inside+=("$e")
  elif [[ -n ${!e+set} ]]; then
    inside+=("$e=${!e}")
  fi
done
host="" port=""
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
  [[ ${args[i]} == --host ]] && host=${args[i+1]}
  [[ ${args[i]} == --port ]] && port=${args[i+1]}
done
if ((${#ports[@]})); then
  published=no
  for p in "${ports[@]}"; do
    [[ $p == *:$port:$port || $p == $port:$port ]] && published=yes
  done
  if [[ $published == no || $host != 0.0.0.0 ]]; then
    echo "fake container: -p ${ports[*]} does not reach a server on $host:$port" >&2
    exit 125
  fi
fi
echo "fake container: $image on $IMAGE_PYTHON with ${#envs[@]} variables"
exec env -i "${inside[@]}" "$IMAGE_PYTHON" "${entry[@]}" "$@" 2>&1
