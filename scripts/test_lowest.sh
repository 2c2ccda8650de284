#!/usr/bin/env bash
# Run the whole test suite against the lowest dependency versions packer declares
# (scripts/lowest.txt), in .venv-lowest, without pandas, torch or datasets: the tests that need
# those skip; numba's bounds checks are on (below). Extra arguments go to pytest. .ci/run calls
# this after scripts/test.sh.
#
# If pip cannot install those versions (an index without them), it says so and exits 0: that
# is this machine's index, not packer. Set PACKER_LOWEST_REQUIRED=1 to make it an error.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-lowest"
stamp="$VENV/.packer-lowest"  # holds the directory it was made for: a copied clone's is another's
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$ROOT" ] || [ scripts/lowest.txt -nt "$stamp" ] \
   || [ pyproject.toml -nt "$stamp" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # wheels only for the compiled ones: an interpreter they have no wheel for (numpy 1.24 stops at
  # Python 3.11) fails here at once instead of building them from source for many minutes
  if ! log=$("$VENV/bin/python" -m pip install --quiet -c scripts/lowest.txt -r scripts/lowest.txt \
                 --only-binary numpy,numba,llvmlite,pyarrow,orjson,xxhash,zstandard \
                 -e . pytest hypothesis pytest-xdist 2>&1); then
    echo "$log" | grep -v "^WARNING: Location" | tail -5 >&2
    rm -rf "$VENV"
    if [ "${PACKER_LOWEST_REQUIRED:-0}" = 1 ]; then
      echo "test_lowest: cannot install the lowest versions" >&2
      exit 1
    fi
    echo "test_lowest: skipped: pip cannot install the lowest versions from this index" >&2
    exit 0
  fi
  printf '%s' "$ROOT" > "$stamp"
fi
# Its own kernel cache: numba keeps one index per kernel, so two numba versions sharing the
# package's __pycache__ would each throw the other's machine code away and compile again.
# Every kernel is compiled afresh here anyway, so they are compiled with bounds checks: a read or
# write outside an array is an IndexError in this pass, where the main one (like a user's run)
# reads whatever lies beyond it or crashes only sometimes. numba's cache does not tell kernels
# compiled with checks from those without, hence a directory of their own.
export NUMBA_BOUNDSCHECK=1
export NUMBA_CACHE_DIR="$VENV/numba-cache-boundscheck"
# The demo test sets up and runs the main .venv (scripts/test.sh covers it), not this one.
exec "$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" -p no:cacheprovider \
  --deselect tests/test_scripts.py::test_demo_script_runs "$@"
