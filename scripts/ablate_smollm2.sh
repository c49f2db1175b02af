#!/usr/bin/env bash
# The recipe's levers for the SmolLM2-135M-Instruct n = 8 head, one at a time, on the same data and budget:
# configs/smollm2-n8-text.yaml (plain text, online, bf16 teacher) stopped at the same number of steps, each run
# changing one setting. Every run is resumable (a killed script picks up where it stopped) and skipped once its
# head exists; the table at the end reads each run's summary.json (held-out top-1 on the target's own answers).
#   python data/smollm2.py --out smollm2 --text-only
#   bash scripts/ablate_smollm2.sh                 # STEPS=100 by default; RUNS="base vocab" picks some
# With smollm2/data/answers/greedy-bf16.jsonl present (data/regenerate.py, configs/smollm2-n8-mix.yaml says how),
# the data-mix runs "answers" and "mix" run as well.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SPD_VENV:-.venv}/bin
STEPS=${STEPS:-100}
OUT=${OUT:-runs/ablate}
ANSWERS=smollm2/data/answers/greedy-bf16.jsonl
TEXT='{target}/../data/text/train.jsonl'
RUNS=${RUNS:-"base layer vocab ls2 answers mix"}

declare -A ARGS=(
    [base]=""
    [layer]="layer_init=target"
    [vocab]="draft_vocab_size=0"
    [ls2]="num_layers=2"
    [answers]="data={target}/../data/answers/greedy-bf16.jsonl"
    [mix]="data=[\"$TEXT\",\"{target}/../data/answers/greedy-bf16.jsonl\",\"{target}/../data/answers/greedy-bf16.jsonl\"]"
)
for run in $RUNS; do
    [ -n "${ARGS[$run]+set}" ] || { echo "error: unknown run '$run'; expected some of: ${!ARGS[*]}" >&2; exit 2; }
    if [ -f "$OUT/$run/summary.json" ]; then echo "[ablate] $run: done"; continue; fi
    if [[ "$run" == answers || "$run" == mix ]] && [ ! -f "$ANSWERS" ]; then
        echo "[ablate] $run: skipped ($ANSWERS is missing)"; continue
    fi
    echo "[ablate] $run: ${ARGS[$run]:-the preset as it is}"
    # shellcheck disable=SC2086  # the overrides are separate words
    "$PY/accelerate" launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
        train/distill.py --config configs/smollm2-n8-text.yaml --resume max_steps="$STEPS" max_minutes=240 \
        eval_every="$STEPS" save_every=25 output_dir="$OUT/$run" ${ARGS[$run]}
done
# The table, and every run's summary in one file ($OUT/ablation.json: the results page cites a copy of it).
"$PY/python" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
from spd.files import write_json_atomic
out = Path(sys.argv[1])
runs = {path.parent.name: json.loads(path.read_text()) for path in sorted(out.glob("*/summary.json"))}
write_json_atomic(out / "ablation.json", runs, indent=1)
print("| run | steps | held-out top-1 | top-1 at fill 1 | L'_acc estimate | minutes |")
print("| --- | --- | --- | --- | --- | --- |")
for name, s in runs.items():
    e = s["eval"]
    print(f"| {name} | {s['step']} | {e['top1_full']:.3f} | {e['top1_by_fill']['1']:.3f} "
          f"| {e['L_acc_est']:.2f} | {s['train_minutes']:.1f} |")
EOF
