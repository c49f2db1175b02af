#!/usr/bin/env bash
# Install everything, build the testbed (cached after the first run, ~20 min on 2 CPU cores), then
# decode from the testbed target cut into 4 pipeline stages: the exact autoregressive baseline, and the
# training-free token-tree mode (the testbed's draft model feeds the pipeline; same output, fewer steps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${SPD_VENV:-.venv}/bin
TESTBED=${SPD_TESTBED:-testbed}
PROMPT=$'import os\n\n\ndef read_config(path):'
"$PY/python" data/build_testbed.py --out "$TESTBED"
echo "[quickstart] autoregressive, greedy, from $TESTBED/target (4 stages):"
"$PY/spd-generate" --target "$TESTBED/target" --mode ar --stages 4 --max-new-tokens 96 --prompt "$PROMPT"
echo "[quickstart] pipelined token tree fed by $TESTBED/draft (4 stages, width 4; identical text):"
"$PY/spd-generate" --target "$TESTBED/target" --mode tree --draft-model "$TESTBED/draft" --stages 4 \
    --tree-width 4 --max-new-tokens 96 --prompt "$PROMPT"
