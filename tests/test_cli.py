"""spd-generate as a user runs it: the installed console script in a fresh process."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from helpers.cli import spd_generate, spd_generate_command, spd_generate_main


def test_json_output(tiny_testbed):
    proc = spd_generate(
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "ar",
        "--stages",
        "2",
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "stats"}
    stats = out["stats"]
    assert stats["mode"] == "ar" and stats["new_tokens"] == len(out["token_ids"]) <= 12
    assert stats["wall_time_s"] > 0 and stats["tokens_per_s"] > 0
    assert stats["stop_reason"] in ("eos", "max_new_tokens")
    assert stats["token_acceptance"] == [False] * stats["new_tokens"]  # ar speculates nothing


@pytest.mark.slow
def test_streams_text_and_matches_json(tiny_testbed, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def main():\n")
    common = ["--target", str(tiny_testbed / "target"), "--prompt-file", str(prompt), "--max-new-tokens", "16"]
    streamed = spd_generate(*common)
    as_json = spd_generate(*common, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout == json.loads(as_json.stdout)["text"] + "\n"
    assert "tokens/s" in streamed.stderr


@pytest.mark.slow
def test_sampling_with_seed_is_reproducible(tiny_testbed):
    args = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompt",
        "x = ",
        "--max-new-tokens",
        "10",
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--json",
    ]
    a, b = spd_generate(*args), spd_generate(*args)
    assert a.returncode == 0
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_chat_prompt(tiny_testbed):
    proc = spd_generate(
        "--target", str(tiny_testbed / "target"), "--prompt", "hi", "--chat", "--max-new-tokens", "4", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_testbed / "target")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"
    assert json.loads(proc.stdout)["stats"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--target", "/no/such/dir", "--prompt", "x"], "does not exist"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "   \n"], "prompt is empty"),
        (["--prompt", "x", "--mode", "warp"], "unknown --mode 'warp'"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["--prompt", "x", "--temperature", "nan"], "finite"),
        (["--prompt", "x", "--top-p", "1.5"], "--top-p"),
        (["--prompt", "x", "--top-k", "-3"], "--top-k"),
        (["--prompt", "x", "--max-new-tokens", "0"], "positive integer"),
        (["--prompt", "x", "--max-new-tokens", "ten"], "positive integer"),
        (["--prompt", "x", "--stages", "9"], "9 stages need at least 9 layers, but the model has 8"),
        (["--prompt-file", "/no/such/file.txt"], "does not exist"),
        ([], "no prompt given"),
        (["--prompt", "x", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tiny_testbed, args, expected):
    if "--target" not in args:
        args = ["--target", str(tiny_testbed / "target"), *args]
    proc = spd_generate_main(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and expected in lines[0]
    assert "Traceback" not in proc.stderr


def test_prompt_longer_than_the_context(tiny_testbed):
    proc = spd_generate("--target", str(tiny_testbed / "target"), "--prompt", "x = 1\n" * 2000)
    assert proc.returncode == 2
    loaded, error = proc.stderr.strip().splitlines()  # (the engine checks the prompt once it is loaded)
    assert loaded.startswith("[spd] loaded") and error.startswith("error: the prompt has") and "context" in error


def _help_entries(text: str) -> dict[str, str]:
    """Each option of a --help output and its help text, joined across lines."""
    entries, flag = {}, None
    for line in text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = re.findall(r"--[\w-]+", line)[0]
            entries[flag] = (re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""])[1]
        elif flag is not None and line.strip():
            entries[flag] += " " + line.strip()
    return entries


@pytest.mark.parametrize("program", ["spd.cli.generate", "spd.cli.serve"])
def test_help_gives_every_flag_a_text_and_its_default(program):
    """--help: every flag has help that shows its default (or says it is required), and the description is plain
    text (no reST markup) listing every mode."""
    from importlib import import_module

    from conftest import run_main

    proc = run_main(import_module(program).main, "--help")
    assert proc.returncode == 0
    entries = _help_entries(proc.stdout)
    assert {"--max-new-tokens", "--stages", "--mode"} & set(entries) and "--stages" in entries
    for flag, text in entries.items():
        if flag != "--help":
            assert re.search(r"\bdefault: \S|\brequired\b", text), f"{program} {flag}: {text!r}"
    assert "``" not in proc.stdout and ":func:" not in proc.stdout
    description = proc.stdout.split("\noptions:\n", 1)[0]
    assert all(re.search(rf"\b{mode}\b", description) for mode in ("ar", "pp", "spd", "tree", "sd"))


def test_loading_line(tiny_testbed, tiny_heads):
    """One line on stderr once the pipeline has loaded: the target, the mode, the cut, the head and the time."""
    target = str(tiny_testbed / "target")
    proc = spd_generate_main(
        "--target", target, "--speculator", str(tiny_heads[2]), "--prompt", "x", "--json", "--max-new-tokens", "2"
    )
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(
        rf"\[spd\] loaded {re.escape(target)}: spd, 2 stages of 4, 4 layers, head {re.escape(str(tiny_heads[2]))}; "
        r"[\d.]+ s\n",
        proc.stderr,
    ), proc.stderr


@pytest.mark.slow
def test_target_without_tokenizer(tiny_testbed, tmp_path):
    model_only = tmp_path / "model_only"
    model_only.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_testbed / "target" / f, model_only / f)
    proc = spd_generate("--target", str(model_only), "--prompt", "x")
    assert proc.returncode == 2 and "--tokenizer" in proc.stderr
    ok = spd_generate(
        "--target",
        str(model_only),
        "--tokenizer",
        str(tiny_testbed / "tokenizer"),
        "--prompt",
        "x",
        "--max-new-tokens",
        "3",
        "--json",
    )
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_show_acceptance_colours_exactly_the_accepted_tokens(tiny_testbed):
    """Each streamed piece is green exactly when its token was an accepted speculation (stats.token_acceptance)."""
    from transformers import AutoTokenizer

    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "tree",
        "--draft-model",
        str(tiny_testbed / "draft"),
        "--stages",
        "2",
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "24",
    ]
    as_json = spd_generate(*common, "--json")
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    ids, flags = out["token_ids"], out["stats"]["token_acceptance"]
    assert len(flags) == len(ids) and sum(flags) == out["stats"]["accepted"] > 0 and not flags[0]
    tok = AutoTokenizer.from_pretrained(tiny_testbed / "target")
    text = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    pieces = [text[i + 1][len(text[i]) :] for i in range(len(ids))]
    expected = "".join(f"\x1b[32m{p}\x1b[0m" if a and p else p for p, a in zip(pieces, flags)) + "\n"
    proc = spd_generate(*common, "--show-acceptance")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected
    assert proc.stdout.replace("\x1b[32m", "").replace("\x1b[0m", "") == out["text"] + "\n"


def _fake_hub_cache(root: Path, repo_id: str, source: Path) -> str:
    """Lay out a Hugging Face hub cache entry for ``repo_id`` at branch ``main`` (no network needed)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / ("models--" + repo_id.replace("/", "--"))
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(source, entry / "snapshots" / commit)
    return commit


@pytest.mark.slow
def test_hub_id_with_revision_resolves_through_the_hub_cache(tiny_testbed, tmp_path):
    """The hub code path for real: a repo id and a revision, resolved offline from a hub cache."""
    import os

    commit = _fake_hub_cache(tmp_path / "hub", "spd-tests/tiny-target", tiny_testbed / "target")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    for revision in ("main", commit):
        proc = subprocess.run(
            [
                *spd_generate_command(),
                "--target",
                "spd-tests/tiny-target",
                "--revision",
                revision,
                "--prompt",
                "x",
                "--max-new-tokens",
                "3",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
    missing = subprocess.run(
        [*spd_generate_command(), "--target", "spd-tests/no-such-model", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert missing.returncode == 2 and missing.stderr.startswith("error:")
    assert len(missing.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------- spd and pp modes


@pytest.mark.slow
def test_spd_mode_is_lossless_and_reports_pipeline_stats(tiny_testbed, tiny_heads):
    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompt",
        "def main(argv):\n",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    ar = json.loads(spd_generate_main(*common).stdout)
    proc = spd_generate(*common, "--mode", "spd", "--speculator", str(tiny_heads[4]))  # --stages from the head
    assert proc.returncode == 0, proc.stderr
    spd = json.loads(proc.stdout)
    assert spd["token_ids"] == ar["token_ids"] and spd["text"] == ar["text"]
    stats = spd["stats"]
    assert stats["mode"] == "spd" and stats["stages"] == 4
    for key in ("steps", "accepted", "flushes", "acceptance_rate", "equivalent_accept_length", "theoretical_speedup"):
        assert key in stats
    assert stats["equivalent_accept_length"] == pytest.approx(4 * (stats["new_tokens"] - 1) / stats["steps"], abs=1e-3)
    assert len(stats["token_acceptance"]) == stats["new_tokens"] and sum(stats["token_acceptance"]) == stats["accepted"]
    pp = json.loads(spd_generate_main(*common, "--mode", "pp", "--stages", "4").stdout)
    assert pp["token_ids"] == ar["token_ids"]
    assert pp["stats"]["steps"] == 4 * (pp["stats"]["new_tokens"] - 1)


def test_spd_mode_streams_text(tiny_testbed, tiny_heads):
    proc = spd_generate(
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "spd",
        "--speculator",
        str(tiny_heads[2]),
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "10",
    )
    assert proc.returncode == 0, proc.stderr
    assert "L'_acc" in proc.stderr and "2 stages" in proc.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--mode", "spd"], "--mode spd needs --speculator"),
        (["--mode", "spd", "--speculator", "/no/such/head"], "speculator directory '/no/such/head' does not exist"),
        (
            ["--mode", "spd", "--speculator", "HEAD4", "--stages", "2"],
            "trained for n = 4 stages of 2, 2, 2, 2 layers (--boundaries 2,4,6) but --stages 2 asks for 2 stages "
            "of 4, 4 layers",
        ),
        (["--mode", "spd", "--speculator", "TARGET"], "not an SPD speculation head"),
        (["--mode", "pp", "--speculator", "HEAD4"], "only used by --mode spd"),
    ],
)
def test_bad_speculator_input_is_one_clear_line_and_exit_2(tiny_testbed, tiny_heads, args, expected):
    subs = {"HEAD4": str(tiny_heads[4]), "TARGET": str(tiny_testbed / "target")}
    args = [subs.get(a, a) for a in args]
    proc = spd_generate_main("--target", str(tiny_testbed / "target"), "--prompt", "x", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], proc.stderr


def test_head_for_another_target_is_refused(tiny_testbed, tiny_heads, tmp_path):
    """A head trained for a different target (the testbed's draft model: other hidden size and depth)."""
    proc = spd_generate(
        "--target",
        str(tiny_testbed / "draft"),
        "--tokenizer",
        str(tiny_testbed / "tokenizer"),
        "--mode",
        "spd",
        "--speculator",
        str(tiny_heads[2]),
        "--prompt",
        "x",
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the speculator does not fit this target"), proc.stderr


@pytest.mark.slow
def test_bench_runs_modes_and_heads(tiny_testbed, tiny_heads, tmp_path):
    """Every kind of run, solo and (side by side) with --batch: the batched pipeline gives every prompt the numbers
    it gets alone, at T = 0 and sampled."""
    from conftest import run_bench, two_at_a_time

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "import os\n"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"prompt": "def f(x):\n    return"})
        + "\n"
    )
    out, png, batched = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "batched.json"
    args = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(prompts),
        "--run",
        "pp:2",
        "--run",
        f"h2=spd:{tiny_heads[2]}",
        "--run",
        f"spd:{tiny_heads[4]}",
        "--run",
        f"t2=tree:{tiny_heads[2]}:2:2:2",
        "--temperatures",
        "0",
        "1",
        "--max-new-tokens",
        "12",
    ]
    proc, _ = two_at_a_time(
        lambda extra: run_bench("decode", *args, *extra),
        [["--out", str(out), "--plot", str(png)], ["--out", str(batched), "--batch", "2"]],
    )
    assert "| 0 | h2 | spd-input | 2 |" in proc.stdout
    report = json.loads(out.read_text())
    greedy = report["results"]["T=0"]
    assert set(greedy) == {"pp n=2", "h2", str(tiny_heads[4]), "t2", "ar"}  # ar added as the lossless reference
    for name in ("pp n=2", "h2", str(tiny_heads[4]), "t2"):
        assert greedy[name]["summary"]["identical_to_ar"] == 3
        assert greedy[name]["summary"]["differences_from_ar"] == []
    assert greedy["pp n=2"]["summary"]["L_acc"] == 1.0
    assert len(greedy["h2"]["per_prompt"]) == 3 and "T=1" in report["results"]
    assert png.stat().st_size > 10_000

    def numbers(results):  # the method's, not the machine's
        return {
            (t, name): [
                {k: v for k, v in r.items() if not k.endswith(("time_s", "_per_s", "_ms"))} for r in run["per_prompt"]
            ]
            for t, runs in results.items()
            for name, run in runs.items()
        }

    together = json.loads(batched.read_text())["results"]
    assert numbers(together) == numbers(report["results"])
    for t in ("T=0", "T=1"):
        for name in ("pp n=2", "h2", "t2"):
            assert together[t][name]["summary"]["batch"] == 2 and together[t][name]["summary"]["mean_batch_size"] > 1
        assert "batch" not in together[t]["ar"]["summary"]  # the reference runs alone
    from conftest import run_main
    from spd.bench.decode import main as bench_main

    bad = run_main(bench_main, "--run", "spd", "--prompts", str(prompts))
    assert bad.returncode == 2 and bad.stderr.startswith("error: --run 'spd' is not a run")
    bad = run_main(bench_main, *args, "--batch", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --batch must be a positive number"), bad.stderr


@pytest.mark.slow
def test_killed_bench_resumes_to_the_same_numbers(tiny_testbed, tiny_heads, tmp_path):
    """A benchmark killed mid-way and run again gives the numbers of an unbroken run (T = 0 and sampled)."""
    from conftest import run_bench, run_main
    from spd.bench.decode import main as bench_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"import os\nx = {i}\n"}) + "\n" for i in range(8)))
    args = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(prompts),
        "--run",
        f"h2=spd:{tiny_heads[2]}",
        "--run",
        f"t2=tree:{tiny_heads[2]}:2:2:2",
        "--temperatures",
        "0",
        "1",
        "--max-new-tokens",
        "12",
    ]
    whole = tmp_path / "whole.json"
    run_bench("decode", *args, "--out", str(whole))
    out = tmp_path / "broken.json"
    journal = tmp_path / "broken.json.progress.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spd.bench", "decode", *args, "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and (not journal.exists() or journal.read_text().count("\n") < 4):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and journal.exists(), "the benchmark finished before it could be killed"
    with open(journal, "a") as f:
        f.write('{"T": "T=0", "prom')  # a line the kill cut short
    other = run_main(bench_main, *args, "--out", str(out), "--seed", "7")  # refused before anything runs
    assert other.returncode == 2 and "other settings (seed: 0 there, 7 now)" in other.stderr, other.stderr
    resumed = run_bench("decode", *args, "--out", str(out))
    assert "[bench] resuming" in resumed.stderr and not journal.exists()
    assert "dropped a last line that a kill cut short (" in other.stderr  # the first to read it

    def timing(key):  # the machine's, not the method's
        return key.endswith(("time_s", "_per_s", "_ms"))

    def numbers(path):
        results = json.loads(path.read_text())["results"]
        return {
            (t, name): (
                [{k: v for k, v in r.items() if not timing(k)} for r in run["per_prompt"]],
                {k: v for k, v in run["summary"].items() if not timing(k)},
            )
            for t, runs in results.items()
            for name, run in runs.items()
        }

    assert numbers(out) == numbers(whole)
