"""Self-written instructions (the Magpie method): the user-turn prefix, the benchmark-overlap filter, and a real
sampling run on the testbed's chat template that resumes without losing or repeating a row."""

import json

import pytest

from conftest import run_script
from spd.data.self_instruct import BenchmarkFilter, benchmark_texts, shingles, user_turn_ids, write_instructions
from spd.errors import SpdInputError


@pytest.fixture(scope="module")
def chat_model(tiny_testbed):
    from spd.target.loading import load_causal_lm
    from spd.target.tokenizer import load_tokenizer

    target = tiny_testbed / "target"
    return load_causal_lm(target).eval(), load_tokenizer(target)


def test_user_turn_prefix_ends_where_a_request_begins(chat_model):
    _, tokenizer = chat_model
    plain = tokenizer.decode(user_turn_ids(tokenizer, None))
    assert plain.endswith("<|user|>\n") and "<|system|>" not in plain
    steered = tokenizer.decode(user_turn_ids(tokenizer, "You write Python."))
    assert steered.endswith("<|user|>\n") and "<|system|>\nYou write Python." in steered


def test_no_benchmark_prompt_passes_the_filter_and_the_stdlib_instructions_do():
    """Every HumanEval problem, and a request quoting eight of its words in a row, is caught; none of the standard
    library instructions that train the heads overlaps a HumanEval problem."""
    from spd.data.instructions import stdlib_instructions

    humaneval = benchmark_texts()
    assert len(humaneval) == 164
    bench = BenchmarkFilter(humaneval)
    assert all(bench.overlaps(text) for text in humaneval if len(shingles(text)) > 0)
    words = " ".join(shingles(humaneval[0]).pop())
    assert bench.overlaps(f"Please help: {words}, thanks")
    assert not bench.overlaps("Write a function that returns the n-th Fibonacci number using memoisation.")
    assert not any(bench.overlaps(row["prompt"]) for row in stdlib_instructions())


def test_mt_bench_and_gsm8k_files_join_the_filter(tmp_path):
    mt, gsm = tmp_path / "question.jsonl", tmp_path / "test.jsonl"
    mt.write_text(
        json.dumps(
            {
                "question_id": 81,
                "turns": [
                    "Compose an engaging travel blog post about a recent trip "
                    "to Hawaii, highlighting cultural experiences."
                ],
            }
        )
        + "\n"
    )
    gsm.write_text(
        json.dumps(
            {
                "question": "Janet's ducks lay 16 eggs per day and she eats three for breakfast every morning.",
                "answer": "18",
            }
        )
        + "\n"
    )
    bench = BenchmarkFilter(benchmark_texts(str(mt), str(gsm)))
    assert bench.overlaps("compose an engaging travel blog post about a recent trip to Hawaii please")
    assert bench.overlaps("Janet's ducks lay 16 eggs per day and she eats three for breakfast")


def test_sampling_resumes_without_losing_or_repeating_a_row(chat_model, tmp_path, capsys):
    """Eight requests in batches of four, written at once or as four then (after a torn line) eight: the same rows,
    each id once; rejected samples stay in the file with their reason, kept ones are unique."""
    model, tokenizer = chat_model
    bench = BenchmarkFilter([])
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    write_instructions(model, tokenizer, "code", 8, straight, bench, batch_size=4, max_new_tokens=12, progress=False)
    write_instructions(model, tokenizer, "code", 4, resumed, bench, batch_size=4, max_new_tokens=12, progress=False)
    with open(resumed, "a") as f:
        f.write('{"id": "code-0-4", "pro')  # a kill in the middle of a line
    stats = write_instructions(
        model, tokenizer, "code", 8, resumed, bench, batch_size=4, max_new_tokens=12, progress=False
    )
    assert stats["skipped_done"] == 4 and stats["sampled"] == 4
    assert f"warning: {resumed}: dropped a last line that a kill cut short (23 bytes)" in capsys.readouterr().err
    rows = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert rows == [json.loads(line) for line in straight.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"code-0-{i}" for i in range(8)]
    kept = [" ".join(r["prompt"].lower().split()) for r in rows if r["keep"]]
    assert len(kept) == len(set(kept))
    assert all(r["why"] in (None, "cut off", "too short", "duplicate", "benchmark overlap") for r in rows)
    assert all((r["why"] is None) == r["keep"] for r in rows)


def test_regenerate_skips_rejected_samples_and_bad_topics_are_one_error(tmp_path):
    from spd.data.prompt_rows import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "prompt": "Sort a list.", "keep": True, "why": None},
                {"id": "b", "prompt": "Sort a list.", "keep": False, "why": "duplicate"},
            ]
        )
        + "\n"
    )
    assert [r["id"] for r in read_prompts(str(prompts))] == ["a"]
    # An evaluation set's rows (docs/results/self-eval/): the first user turn of "messages" is the prompt.
    chats = tmp_path / "chats.jsonl"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    chats.write_text(json.dumps({"id": "c", "messages": turns}) + "\n" + json.dumps({"messages": turns[:1]}) + "\n")
    with pytest.raises(SpdInputError, match=r'chats.jsonl:2 has no non-empty "prompt" string \(or "messages"'):
        read_prompts(str(chats))
    chats.write_text(json.dumps({"id": "c", "messages": turns}) + "\n")
    assert read_prompts(str(chats)) == [{"id": "c", "prompt": "Hi?"}]
    with pytest.raises(SpdInputError, match="unknown topic"):
        write_instructions(None, None, "poetry", 1, tmp_path / "x.jsonl", BenchmarkFilter([]))
    for topics in ("code:0", "poetry:3"):
        out = str(tmp_path / "x.jsonl")
        proc = run_script(
            "data/self_instruct.py", "--target", str(tmp_path), "--topics", topics, "--out", out, check=False
        )
        assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: --topics {topics}"), proc.stderr


def test_own_evaluation_prompts_are_excluded_also_from_rows_written_before(tmp_path):
    """--exclude: the prompts of one's own evaluation set (even a short one, compared whole) join the filter, and a
    kept row written before that overlaps one is turned away in place; a file without prompts is one error."""
    from spd.data.self_instruct import prompt_texts, recheck

    evals = tmp_path / "chat.jsonl"
    evals.write_text(
        json.dumps({"messages": [{"role": "user", "content": "How do I bake a cake?"}], "id": "chat-7-0"})
        + "\n"
        + json.dumps({"prompt": "Explain the difference between a list and a tuple in Python, with examples."})
        + "\n"
    )
    out = tmp_path / "self.jsonl"
    rows = [
        {"id": "chat-1-0", "topic": "chat", "prompt": "how do I bake a cake", "keep": True, "why": None},
        {"id": "chat-1-1", "topic": "chat", "prompt": "How do I bake bread?", "keep": True, "why": None},
        {"id": "code-1-0", "topic": "code", "prompt": "Explain the difference between a list and a tuple in Python"},
        {"id": "code-1-1", "topic": "code", "prompt": "cut", "keep": False, "why": "cut off"},
    ]
    rows[2].update(keep=True, why=None)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = BenchmarkFilter(prompt_texts(evals))
    assert recheck(out, bench) == 2
    after = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["keep"] for r in after] == [False, True, False, False]
    assert [r["why"] for r in after] == ["benchmark overlap", None, "benchmark overlap", "cut off"]
    assert recheck(out, bench) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no prompt here"}\n')
    with pytest.raises(SpdInputError, match="line 1 has no prompt"):
        prompt_texts(bad)


@pytest.mark.slow
def test_the_self_data_job_writes_every_topic_and_holds_out_the_eval_sets(tiny_testbed, tmp_path):
    """scripts/smollm2_self_data.sh on the testbed's chat target, tiny counts: requests, greedy and sampled answers and
    the held-out answers per topic, and no kept request overlaps docs/results/self-eval/ (each step's resume is the
    scripts' own, tested beside them)."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from spd.data.self_instruct import prompt_texts

    (tmp_path / "target").symlink_to(tiny_testbed / "target")
    env = {
        **os.environ,
        "SPD_SMOLLM2": str(tmp_path),
        "SPD_VENV": str(__import__("pathlib").Path(sys.executable).parents[1]),
        "SPD_SELF_COUNTS": "chat:6 math:4 code:4",
        "ROUNDS": "1",
        "SPD_THREADS": "1",
    }

    def job():
        return subprocess.run(
            ["bash", str(REPO / "scripts" / "smollm2_self_data.sh")],
            capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
        )  # fmt: skip

    # A random tiny model seldom ends a request within 64 tokens, so most of its samples are cut off: the first rows
    # of each topic are written as if sampled before, one of them a held-out evaluation request, which the job must
    # turn away ("rows already in --out are checked again").
    out = tmp_path / "data" / "self"
    out.mkdir(parents=True)
    evals = {t: prompt_texts(REPO / "docs" / "results" / "self-eval" / f"{t}.jsonl") for t in ("chat", "math", "code")}
    for topic in ("chat", "math", "code"):
        rows = [
            {
                "id": f"{topic}-1-{i}",
                "topic": topic,
                "prompt": f"Question {i} about {topic}?",
                "keep": True,
                "why": None,
            }
            for i in range(3)
        ]
        rows[0]["prompt"] = evals[topic][-1]
        (out / f"prompts-{topic}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = job()
    assert proc.returncode == 0, proc.stderr[-3000:]
    held_out = BenchmarkFilter([text for texts in evals.values() for text in texts])
    for topic, count in (("chat", 6), ("math", 4), ("code", 4)):
        rows = [json.loads(line) for line in (out / f"prompts-{topic}.jsonl").read_text().splitlines()]
        assert len(rows) == count and all(r["topic"] == topic for r in rows)
        assert (rows[0]["keep"], rows[0]["why"]) == (False, "benchmark overlap")
        kept = {r["id"] for r in rows if r["keep"]}
        assert {f"{topic}-1-1", f"{topic}-1-2"} <= kept
        assert not any(held_out.overlaps(r["prompt"]) for r in rows if r["keep"])
        for answers in (f"greedy-{topic}.jsonl", f"t0.8-{topic}.jsonl"):
            ids = [json.loads(line)["id"] for line in (out / answers).read_text().splitlines()]
            assert sorted(ids) == sorted(kept)
        heldout = [json.loads(line)["id"] for line in (out / f"heldout-{topic}.jsonl").read_text().splitlines()]
        assert len(heldout) == len(evals[topic])
