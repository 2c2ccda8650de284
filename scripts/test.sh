#!/usr/bin/env bash
# Set up .venv with the test dependencies and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k plan -x).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev,gzip,hf,torch,mcore
exec "$VPY" -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
