"""infer/reproduce.py as a user runs it, in miniature: one capture, every missing head trained from it, one
benchmark, the Table-1-shaped markdown / JSON / plot; a second run reuses what exists; bad input is one line."""

import json

from conftest import run_script


def _reproduce(tiny_testbed, tmp_path, *extra, check=True):
    return run_script("infer/reproduce.py", "--testbed", str(tiny_testbed), "--stages", "2", "--layers", "1",
                      "--draft-steps", "2", "--steps", "2", "--prompts", str(tiny_testbed / "prompts.jsonl"),
                      "--num-prompts", "2", "--max-new-tokens", "6", "--capture-tokens", "3000",
                      "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *extra, check=check)


def test_reproduce_trains_what_is_missing_and_writes_the_table(tiny_testbed, tmp_path):
    proc = _reproduce(tiny_testbed, tmp_path)
    runs, out = tmp_path / "runs", tmp_path / "out"
    for name in ("spd-n2-ls1", "output-n2-ls1", "ppsd-n2", "eagle"):
        assert (runs / name / "final" / "config.json").is_file(), name
    assert json.loads((runs / "eagle" / "final" / "config.json").read_text())["schedule"] == "serial"
    assert json.loads((runs / "ppsd-n2" / "final" / "config.json").read_text())["max_depth"] == 1
    assert json.loads((runs / "output-n2-ls1" / "final" / "config.json").read_text())["schedule"] == "output"
    table = json.loads((out / "table.json").read_text())
    settings = {(r["method"], r["setting"]) for r in table["rows"]}
    assert settings == {("EAGLE-style (sd)", "m=2"), ("SPD", "n=2 Ls=1"), ("SPD, output state", "n=2 Ls=1"),
                        ("PPSD", "n=2"), ("SPD", "n=2 Ls=1 W=4")}
    for row in table["rows"]:
        assert set(row) >= {"T=0", "T=1"} and row["T=0"]["identical_to_ar"] == 2  # every greedy run is lossless
        assert row["T=1"]["acceptance_length"] >= 1 and row["T=1"]["theoretical_speedup"] > 0
    assert "| EAGLE-style (sd) | m=2 |" in (out / "table.md").read_text() and (out / "table.png").stat().st_size
    # A second run trains nothing and captures nothing new.
    again = _reproduce(tiny_testbed, tmp_path, "--temperatures", "0")
    assert again.stdout.count("trained already") == 4 and "training " not in again.stdout
    bad = _reproduce(tiny_testbed, tmp_path, "--stages", "3", check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --stages [3] must divide the target's 8 layers"
    assert proc.returncode == 0
