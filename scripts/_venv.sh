# Sourced by demo.sh and test.sh: create or update .venv with the project and the extras in $1.
# torch is pinned to 2.13.0 unless .venv already has one: on these machines that is a local CPU
# build; a plain or newer torch would download several GB of CUDA packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"  # physical: venv records that one
cd "$ROOT"
PY="${PYTHON:-python3}"
VPY="$ROOT/.venv/bin/python"
# A .venv copied or moved with the clone still runs the original clone's code (its scripts'
# interpreter paths and the editable install point there), or fails to import packer_cli: it
# records the directory it was made for, and is made again elsewhere.
if [ -x .venv/bin/python ] && [ "$(cat .venv/.packer-root 2>/dev/null || true)" != "$ROOT" ]; then
  # No record: a .venv made here (by hand, say with the CUDA torch, or by an earlier version of
  # this script) is kept, unless packer_cli installed in it is another directory's.
  prefix="$("$VPY" -I -c 'import sys; print(sys.prefix)' 2>/dev/null || true)"
  elsewhere="$("$VPY" -I -c 'import os, packer_cli; print(os.path.dirname(os.path.dirname(os.path.abspath(packer_cli.__file__))))' 2>/dev/null || true)"
  if [ ! -f .venv/.packer-root ] && [ -n "$prefix" ] && [ "$prefix" -ef "$ROOT/.venv" ] \
     && { [ -z "$elsewhere" ] || [ "$elsewhere" -ef "$ROOT" ]; }; then
    printf '%s' "$ROOT" > .venv/.packer-root
  else
    echo "$ROOT/.venv was made for another directory: making it again" >&2
    rm -rf .venv
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  printf '%s' "$ROOT" > .venv/.packer-root
fi
need_install=0
IFS=',' read -ra extras <<< "$1"
for extra in "${extras[@]}"; do
  stamp=".venv/.packer-extra-$extra"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then need_install=1; fi
done
if [ "$need_install" = 1 ]; then
  "$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  # a torch already in .venv (the CUDA build you train with) is kept; otherwise the CPU pin
  torch_pin=("torch==2.13.0")
  if "$VPY" -c 'import torch' >/dev/null 2>&1; then torch_pin=(); fi
  "$VPY" -m pip install --quiet -e ".[$1]" ${torch_pin[@]+"${torch_pin[@]}"}
  for extra in "${extras[@]}"; do touch ".venv/.packer-extra-$extra"; done
fi
