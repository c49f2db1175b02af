#!/usr/bin/env bash
# Install (if needed), lint (ruff check, ruff format --check), type-check (mypy) and run the test suite. Extra
# arguments go to pytest (e.g. -m "not slow").
# Two pytest-xdist workers by default (the CI machine has 2 cores); SPD_TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Lint and format first (ruff, configured in pyproject.toml): a failure here stops before the tests.
"${SPD_VENV:-.venv}/bin/ruff" check .
"${SPD_VENV:-.venv}/bin/ruff" format --check .
# The type checker on the decoding engine and the heads (configured in pyproject.toml's [tool.mypy])
"${SPD_VENV:-.venv}/bin/mypy"
set +e
"${SPD_VENV:-.venv}/bin/python" -m pytest -n "${SPD_TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
