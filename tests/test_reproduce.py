"""bench/reproduce.py as a user runs it, in miniature (n = 3 on 8 layers: an uneven cut): one capture, every missing head trained from it, one
benchmark, the Table-1-shaped markdown / JSON / plot; a second run reuses what exists; bad input is one line."""

import json

import pytest

from conftest import run_bench, run_main


def _reproduce(tiny_testbed, tmp_path, *extra, check=True):
    return run_bench("reproduce", *_args(tiny_testbed, tmp_path, *extra), check=check)


def _args(tiny_testbed, tmp_path, *extra):
    return (
        "--testbed",
        str(tiny_testbed),
        "--stages",
        "3",
        "--layers",
        "1",
        "--draft-steps",
        "2",
        "--steps",
        "2",
        "--prompts",
        str(tiny_testbed / "prompts.jsonl"),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--capture-tokens",
        "3000",
        "--max-length",
        "32",
        "--eval-rows",
        "8",
        "--runs",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "out"),
        *extra,
    )


@pytest.mark.slow
def test_reproduce_trains_what_is_missing_and_writes_the_table(tiny_testbed, tmp_path):
    proc = _reproduce(tiny_testbed, tmp_path)
    runs, out = tmp_path / "runs", tmp_path / "out"
    for name in ("spd-n3-ls1", "output-n3-ls1", "ppsd-n3", "eagle"):
        assert (runs / name / "final" / "config.json").is_file(), name
    # n = 3 does not divide the 8 layers: the balanced cut, in the capture, the heads and the benchmark.
    assert json.loads((runs / "spd-n3-ls1" / "final" / "config.json").read_text())["boundaries"] == [0, 3, 6, 8]
    assert json.loads((runs / "eagle" / "final" / "config.json").read_text())["schedule"] == "serial"
    assert json.loads((runs / "ppsd-n3" / "final" / "config.json").read_text())["max_depth"] == 1
    assert json.loads((runs / "output-n3-ls1" / "final" / "config.json").read_text())["schedule"] == "output"
    table = json.loads((out / "table.json").read_text())
    settings = {(r["method"], r["setting"]) for r in table["rows"]}
    assert settings == {
        ("EAGLE-style (sd)", "m=2"),
        ("SPD", "n=3 Ls=1"),
        ("SPD, output state", "n=3 Ls=1"),
        ("PPSD", "n=3"),
        ("SPD", "n=3 Ls=1 W=4"),
    }
    for row in table["rows"]:
        assert set(row) >= {"T=0", "T=1"} and row["T=0"]["identical_to_ar"] == 2  # every greedy run is lossless
        assert row["T=1"]["acceptance_length"] >= 1 and row["T=1"]["theoretical_speedup"] > 0
    assert "| EAGLE-style (sd) | m=2 |" in (out / "table.md").read_text() and (out / "table.png").stat().st_size
    # A second run (its main in this process) trains nothing and captures nothing new; its pipeline rows run
    # batched, still lossless.
    from spd.bench.reproduce import main

    again = run_main(
        main, *_args(tiny_testbed, tmp_path, "--temperatures", "0", "--batch", "2", "--out", str(tmp_path / "again"))
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("trained already") == 4 and "training " not in again.stdout
    table = json.loads((tmp_path / "again" / "table.json").read_text())
    assert "--batch 2" in table["bench_command"] and len(table["rows"]) == 5
    assert all(row["T=0"]["identical_to_ar"] == 2 for row in table["rows"])
    bad = run_main(main, *_args(tiny_testbed, tmp_path, "--stages", "9"))  # refused before anything runs
    assert (
        bad.returncode == 2 and bad.stderr.strip() == "error: --stages [9] must be between 1 and the target's 8 layers"
    )
    assert proc.returncode == 0


def test_a_prepared_target_s_conversations_are_its_training_text(tmp_path):
    """A directory written by data/smollm2.py (target/ and data/{train,validation}.jsonl) is a valid --testbed."""
    from spd.bench.reproduce import training_text

    assert training_text(tmp_path) is None
    (tmp_path / "data").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "data" / f"{split}.jsonl").write_text("{}\n")
    assert training_text(tmp_path) == {s: tmp_path / "data" / f"{s}.jsonl" for s in ("train", "validation")}
    (tmp_path / "corpus").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "corpus" / f"{split}.jsonl").write_text("{}\n")
    assert training_text(tmp_path)["train"] == tmp_path / "corpus" / "train.jsonl"  # a testbed's corpus first


def test_heads_checkpoint_every_40_steps_so_a_killed_run_resumes():
    """A long head saves every 40 steps (and a short one at its end), not only once it is done."""
    from spd.bench.reproduce import Head

    assert "save_every=40" in Head("spd-n8-ls1", "spd", 8, 1).overrides(240, 7, 30)
    assert "save_every=40" in Head("eagle", "eagle", 1, 1).overrides(800, 15, 8)
    assert "save_every=2" in Head("ppsd-n2", "ppsd", 2, 1).overrides(2, 2, 8)
