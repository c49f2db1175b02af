#!/usr/bin/env bash
# Install everything, build the testbed (cached; ~20 min on 2 CPU cores the first time), distil a small
# SPD head for the testbed target cut into 4 stages (configs/quickstart-n4.yaml: cached; ~3 min on 2 cores
# the first time; a run that was killed resumes from its last checkpoint), then decode one prompt with
# the standard pipeline (--mode pp) and with SPD (--mode spd): the same text, token for token, in fewer
# pipeline steps per token.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${SPD_VENV:-.venv}/bin
TESTBED=${SPD_TESTBED:-testbed}
HEAD=runs/quickstart-n4   # output_dir of configs/quickstart-n4.yaml
PROMPT=$'import os\n\n\ndef read_config(path):'
TOKENS=96

"$PY/python" data/build_testbed.py --out "$TESTBED"   # does nothing once the testbed is complete

if [ -d "$HEAD/final" ]; then
    echo "[quickstart] SPD head: $HEAD/final (already trained)"
else
    echo "[quickstart] distilling the quickstart SPD head into $HEAD (n = 4)"
    # --resume continues the newest checkpoint in $HEAD/checkpoints, or starts from scratch if there is none.
    "$PY/accelerate" launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
        train/distill.py --config configs/quickstart-n4.yaml --resume   # the target and data: $SPD_TESTBED or ./testbed
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "[quickstart] greedy decoding of the same prompt from $TESTBED/target cut into 4 stages:"
"$PY/spd-generate" --target "$TESTBED/target" --mode pp --stages 4 --max-new-tokens "$TOKENS" \
    --prompt "$PROMPT" --json > "$OUT/pp.json"
"$PY/spd-generate" --target "$TESTBED/target" --mode spd --speculator "$HEAD/final" --max-new-tokens "$TOKENS" \
    --prompt "$PROMPT" --json > "$OUT/spd.json"

"$PY/python" scripts/compare.py "$OUT/pp.json" "$OUT/spd.json"   # fails unless both produced the same tokens
echo "[quickstart] streamed, accepted speculations in green: $PY/spd-generate --target $TESTBED/target --mode spd \\
    --speculator $HEAD/final --prompt 'import os' --show-acceptance"
echo "[quickstart] serve it (OpenAI-compatible): $PY/spd-serve --target $TESTBED/target --mode spd --speculator $HEAD/final"
