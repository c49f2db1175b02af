#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
set +e
"${SPD_VENV:-.venv}/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
