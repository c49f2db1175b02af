#!/usr/bin/env bash
# SmolLM2-135M-Instruct on CUDA, end to end (docs/gpu.md): materialise the target and regenerate its chat data on
# the GPU (data/smollm2.py), distil the n = 4 and n = 8 heads there (configs/smollm2-n{4,8}.yaml), then time ar,
# pp and spd in one process with each head, in float32 and bfloat16 (spd-bench gpu --target).
#   bash scripts/gpu_smollm2.sh [DIR] [OUT_DIR]   # default smollm2/ and gpu-results/; PYTHON picks the interpreter
# Writes OUT_DIR/{smollm2.json,distill-smollm2-n4.json,distill-smollm2-n8.json,smollm2_gpu_{float32,bfloat16}.json}
# and their logs; stops at the first part that fails.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-smollm2}
out=${2:-gpu-results}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PROMPT="Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."

"$python" data/smollm2.py --out "$dir" 2>&1 | tee "$out/smollm2_data.log"
cp "$dir/smollm2.json" "$out/smollm2.json"
heads=()
for n in 4 8; do
    run="$dir/runs/smollm2-n$n"
    "$python" -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision no \
        --dynamo_backend no train/distill.py --config "configs/smollm2-n$n.yaml" target="$dir/target" \
        output_dir="$run" --resume 2>&1 | tee "$out/distill-smollm2-n$n.log"
    cp "$run/summary.json" "$out/distill-smollm2-n$n.json"
    heads+=("$run/final")
done
for dtype in float32 bfloat16; do
    "$python" -m spd.bench gpu --target "$dir/target" --speculator "${heads[@]}" --parts decode --dtype "$dtype" \
        --new-tokens 96 --prompt "$PROMPT" --out "$out/smollm2_gpu_$dtype.json" 2>&1 | tee "$out/smollm2_gpu_$dtype.log"
done
