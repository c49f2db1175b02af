"""Print the --json outputs of spd-generate --mode pp and --mode spd side by side; fail unless their tokens agree.

python scripts/compare.py pp.json spd.json
"""

import json
import sys

NAMES = {"pp": "standard pipeline, one token in flight", "spd": "speculative pipeline decoding"}


def main(paths: list[str]) -> int:
    runs = [json.load(open(path)) for path in paths]
    for run in runs:
        s = run["stats"]
        print(f"\n--- --mode {s['mode']} ({NAMES[s['mode']]}) ---")
        print(run["text"])
        print(
            f"--- [{s['mode']}] {s['new_tokens']} new tokens; {s['steps']} pipeline steps for the "
            f"{s['decode_tokens']} tokens after the prefill's first: {s['steps'] / s['decode_tokens']:.2f} steps "
            f"per token, L'_acc {s['equivalent_accept_length']:.2f} (= {s['stages']} stages / steps per token), "
            f"{s['flushes']} flushes"
        )
    pp, spd = runs
    if pp["token_ids"] != spd["token_ids"]:
        print("[compare] ERROR: --mode spd produced different tokens than --mode pp", file=sys.stderr)
        return 1
    print(
        f"\n[compare] identical output: both modes produced the same {len(pp['token_ids'])} token ids; "
        f"SPD needed {spd['stats']['steps']} pipeline steps where the standard pipeline needed "
        f"{pp['stats']['steps']} ({pp['stats']['steps'] / spd['stats']['steps']:.2f}x fewer)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
