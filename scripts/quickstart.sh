#!/usr/bin/env bash
# Install everything, build the testbed (cached after the first run, ~20 min on 2 CPU cores), then
# generate from the testbed target cut into 4 pipeline stages.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${SPD_VENV:-.venv}/bin
TESTBED=${SPD_TESTBED:-testbed}
"$PY/python" data/build_testbed.py --out "$TESTBED"
echo "[quickstart] greedy generation from $TESTBED/target (4 stages):"
"$PY/spd-generate" --target "$TESTBED/target" --mode ar --stages 4 --max-new-tokens 96 \
    --prompt $'import os\n\n\ndef read_config(path):'
