"""The model clock (one device per stage) from a run's recorded stage times, and spd-generate's summary line."""

import json
import re

import pytest

from helpers.cli import spd_generate_main
from spd.decoding.model_clock import model_clock, step_ms
from spd.decoding.stats import PipelineStats


def test_step_is_as_long_as_its_busiest_stage():
    """The benchmarks' a + b * tokens per stage call, idle stages free; a per stage or one for all."""
    assert step_ms([0, 3, 1], 10.0, 0.5) == 11.5
    assert step_ms([0, 0], 10.0, 0.5) == 0.0
    assert step_ms([1, 1, 0], [2.0, 5.0, 9.0]) == 5.0


def _stats(schedule: str, speculator_time_s: float) -> PipelineStats:
    # A cut of 2 + 1 layers, three decode steps: stage 1 alone, both, stage 2 alone (6 layer calls in 6 ms: 1 ms a
    # layer); two tokens committed, verified in 2 ms (1 ms each, the last stage's).
    return PipelineStats(
        mode="spd",
        prompt_tokens=4,
        stages=2,
        decode_tokens=2,
        steps=3,
        stage_layers=[2, 1],
        stage_tokens=[[1, 0], [1, 1], [0, 1]],
        stage_time_s=0.006,
        verify_time_s=0.002,
        speculator_time_s=speculator_time_s,
        schedule=schedule,
    )


def test_model_clock_from_recorded_stage_times():
    clock = model_clock(_stats("input", 0.0045))  # the head: 1.5 ms a step, hidden behind the 2 ms stages
    assert clock.stage_ms == pytest.approx([2.0, 2.0]) and clock.head_ms == pytest.approx(1.5)
    assert clock.decode_ms == pytest.approx(6.0)
    assert clock.tokens_per_s == pytest.approx(2 / 0.006)
    assert clock.pp_tokens_per_s == pytest.approx(1000 / 4)  # one token through both stages: 2 + 2 ms
    slow_head = model_clock(_stats("input", 0.009))  # 3 ms a step: the head sets the pace
    assert slow_head.decode_ms == pytest.approx(9.0)
    output_state = model_clock(_stats("output", 0.0045))  # after the stages, serially
    assert output_state.decode_ms == pytest.approx(3 * (2.0 + 1.5))
    assert output_state.as_dict() == {
        "stage_ms": [2.0, 2.0],
        "head_ms": 1.5,
        "tokens_per_s": round(2 / 0.0105, 2),
        "pp_tokens_per_s": 250.0,
    }
    tree = _stats("input", 0.0)
    tree.stage_tokens = [[3, 0], [2, 3]]  # stage calls of several tokens: no per-call time to share out
    assert model_clock(tree) is None
    assert model_clock(PipelineStats(mode="pp", prompt_tokens=4)) is None  # no decode step


def test_summary_line_says_what_it_measured_and_the_model_clock(tiny_testbed, tiny_heads):
    """A real run: the summary line names the one process and its stages in turn, and gives the model clock, the
    figure --json's stats.model_clock holds (pp's: one call of every stage per token)."""
    common = ["--target", str(tiny_testbed / "target"), "--prompt", "import os\n", "--max-new-tokens", "12"]
    spd = spd_generate_main(*common, "--speculator", str(tiny_heads[4]))
    assert spd.returncode == 0, spd.stderr
    loaded, summary = spd.stderr.strip().splitlines()
    assert loaded.startswith(f"[spd] loaded {tiny_testbed / 'target'}: spd, 4 stages of 2, 2, 2, 2 layers, head ")
    match = re.fullmatch(
        r"\[spd\] 12 tokens in [\d.]+ s \([\d.]+ tokens/s, one process, its 4 stages in turn\), stop: max_new_tokens; "
        r"4 stages, \d+ steps, \d+ flushes, L'_acc [\d.]+, theoretical speedup [\d.]+; "
        r"model clock \(one device per stage, this run's stage times\): ([\d.]+) decode tokens/s, pp ([\d.]+)",
        summary,
    )
    assert match and float(match[1]) > 0 and float(match[2]) > 0, summary
    stats = json.loads(spd_generate_main(*common, "--speculator", str(tiny_heads[4]), "--json").stdout)["stats"]
    clock = stats["model_clock"]
    assert len(clock["stage_ms"]) == 4 and clock["tokens_per_s"] > 0
    assert clock["pp_tokens_per_s"] == pytest.approx(1000 / sum(clock["stage_ms"]), rel=1e-3)
    pp = spd_generate_main(*common, "--mode", "pp", "--stages", "4")
    assert re.search(
        r"model clock \(one device per stage, this run's stage times\): [\d.]+ decode tokens/s$", pp.stderr
    )
    ar = spd_generate_main(*common, "--mode", "ar")
    assert re.search(r"\(([\d.]+) tokens/s, one process\), stop: max_new_tokens$", ar.stderr.strip())
    assert "model clock" not in ar.stderr
