# Sourced by demo.sh and test.sh: create or update .venv with the project and the extras in $1.
# torch is pinned to 2.13.0: on these machines that is a local CPU build; a plain or newer
# torch would download several GB of CUDA packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
need_install=0
IFS=',' read -ra extras <<< "$1"
for extra in "${extras[@]}"; do
  stamp=".venv/.packer-extra-$extra"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then need_install=1; fi
done
if [ "$need_install" = 1 ]; then
  "$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$VPY" -m pip install --quiet -e ".[$1]" "torch==2.13.0"
  for extra in "${extras[@]}"; do touch ".venv/.packer-extra-$extra"; done
fi
