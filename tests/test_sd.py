"""--mode sd (serial speculative decoding on the whole target), with a draft model and with a head trained with
variant=eagle: greedy output equals AR for every m, sampled output follows the target's distribution
(chi-square, with a negative control), budgets and EOS inside an iteration, acceptance statistics, the eagle
variant trained by train/distill.py and run from the CLI and the bench, and clear errors."""

import json

import pytest
import torch

from conftest import run_bench, tiny_model, two_at_a_time
from helpers.cli import spd_generate, spd_generate_main
from helpers.distill import distill_args, train
from helpers.proposers import noisy_copy
from helpers.stats import chi_square_p_value, sample_outcomes, sequence_probs
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import Proposer
from spd.decoding.proposers.serial_head import SerialHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.decoding.sd import SpeculativeDecoder
from spd.errors import SpdInputError
from spd.heads.speculator import Speculator
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

PROMPTS = [[5, 17, 3, 99, 42, 8], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def target_model():
    return tiny_model("llama", seed=0, layers=4)


@pytest.mark.parametrize("m", [1, 3, 7])
@pytest.mark.parametrize("noise", [0.0, 0.5, 3.0])
def test_greedy_sd_equals_ar(target_model, m, noise):
    """A perfect draft (noise 0: every draft accepted, bonus tokens), a partial one and a bad one."""
    target = StagedModel(target_model, 1)
    sd = SpeculativeDecoder(target, StagedModel(noisy_copy(target_model, noise), 1), m)
    for prompt in PROMPTS:
        out = sd.run(prompt, 30, SamplingParams())
        assert out.token_ids == generate_ar(target, prompt, 30).token_ids
        s = out.stats
        assert s.decode_tokens == 29 and sum(s.token_acceptance) == s.accepted
        assert s.accepted == sum(s.accepted_by_position) and sum(s.verified_by_position) <= s.drafted
        assert s.mean_acceptance_length == pytest.approx(29 / s.iterations)
        if noise == 0.0:
            assert s.accepted == s.drafted and s.iterations == -(-29 // (m + 1))  # only the last one is short


def _eagle_head(target: StagedModel, draft_steps: int, seed: int = 4, spread: float = 0.5) -> Speculator:
    """An untrained variant=eagle head whose LM head is redrawn: its q differs from p (rejections, residuals)."""
    torch.manual_seed(seed)
    head = new_head(target, DistillConfig(variant="eagle", draft_steps=draft_steps)).eval()
    with torch.no_grad():
        head.lm_head.weight.normal_(0, spread)
    return head


def _small_vocab_target(vocab: int = 6, scale: float = 1.0) -> tuple[torch.nn.Module, StagedModel]:
    model = tiny_model("llama", seed=3, layers=2, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    target = StagedModel(model, 1)
    with torch.no_grad():
        target.lm_head.weight.mul_(scale)
    return model, target


@pytest.mark.parametrize("m", [1, 3, 7])
def test_greedy_sd_with_an_eagle_head_equals_ar(m):
    """The head drafts from its memory of the rows the target ran plus the rows in flight at depth 0."""
    _, target = _small_vocab_target()
    sd = SpeculativeDecoder(target, SerialHeadProposer(_eagle_head(target, m), target), m)
    accepted = 0
    for prompt in ([1, 4, 2], [3], [5, 1, 1, 2, 3, 4, 0, 2]):
        out = sd.run(prompt, 30, SamplingParams())
        assert out.token_ids == generate_ar(target, prompt, 30).token_ids
        s = out.stats
        assert s.source == "head" and s.draft_layers == 1 and s.decode_tokens == 29
        assert s.accepted == sum(s.token_acceptance) == sum(s.accepted_by_position)
        accepted += s.accepted
    assert 0 < accepted  # some drafts were right (6 tokens), so the cache commits accepted rows too


def test_the_head_drafter_reads_the_target_rows_and_its_drafts():
    """Draft j equals the head's training forward at the newest committed position with fill j (its own earlier
    drafts at depth 0): incremental drafting is the computation the head was trained for."""
    _, target = _small_vocab_target()
    head = _eagle_head(target, 4)
    sd = SpeculativeDecoder(target, SerialHeadProposer(head, target), 4)
    assert isinstance(sd.proposer, Proposer)
    prompt, m = [1, 4, 2, 5, 3], 4
    caches = target.new_caches(capacity=16)
    prefill = target.forward_stages(torch.tensor([prompt]), caches, anchors=sd.proposer.prefill_anchors)
    sd.proposer.start(prompt, prefill.anchors, 16)
    first = int(torch.argmax(target.logits(prefill.hidden_BTD[:, -1])))
    drafts, _ = sd._draft(prompt + [first], m, SamplingParams(), None)
    sequence = prompt + [first] + drafts
    hidden = target.hidden_states(torch.tensor([sequence]), sorted(set(head.needed_anchors())))
    for j, token in enumerate(drafts):
        t = len(prompt) + j  # the query position of draft j + 1: the first committed-but-unrun token plus j drafts
        out = head.forward_train(hidden, torch.tensor([j + 1]))
        assert int(torch.argmax(head.vocab_logits(out[:, t]))) == token


def test_greedy_sd_on_the_testbed(tiny_testbed):
    sd = SpeculativeDecoder.from_pretrained(str(tiny_testbed / "target"), str(tiny_testbed / "draft"), draft_steps=3)
    out = sd.generate("def main():\n", max_new_tokens=24)
    assert out.token_ids == sd.generate("def main():\n", max_new_tokens=24, mode="ar").token_ids
    s = out.stats.as_dict()
    assert s["mode"] == "sd" and s["draft_steps"] == 3 and s["iterations"] > 0
    assert s["theoretical_speedup"] == pytest.approx(
        s["mean_acceptance_length"] * s["target_layers"] / (s["draft_layers"] * 3 + s["target_layers"]), abs=1e-3
    )


@pytest.mark.parametrize("max_new", [1, 2, 4, 5, 9])
def test_budget_and_eos_inside_an_iteration(target_model, max_new):
    target = StagedModel(target_model, 1)
    sd = SpeculativeDecoder(target, StagedModel(target_model, 1), 4)  # every draft right
    prompt = [5, 17, 3]
    out = sd.run(prompt, max_new, SamplingParams())
    assert out.token_ids == generate_ar(target, prompt, max_new).token_ids and len(out.token_ids) == max_new
    free = generate_ar(target, prompt, 12).token_ids
    eos = free[6]
    out = sd.run(prompt, 12, SamplingParams(), eos_token_id=eos)
    assert out.token_ids == free[: free.index(eos) + 1] and out.stats.stop_reason == "eos"


def test_context_full(target_model):
    target = StagedModel(target_model, 1)  # max_position_embeddings = 256
    sd = SpeculativeDecoder(target, StagedModel(noisy_copy(target_model, 0.5), 1), 7)
    prompt = [3 + i % 100 for i in range(250)]
    out = sd.run(prompt, 40, SamplingParams())
    assert out.token_ids == generate_ar(target, prompt, 40).token_ids
    assert len(out.token_ids) == 6 and out.stats.stop_reason == "context_full"


class NoResidual(SpeculativeDecoder):
    """Negative control: on a rejection the replacement is drawn from p instead of normalise(max(p - q, 0)) -
    the tokens q over-proposes come out too often; not lossless."""

    @staticmethod
    def _accept(p_V, token, q_V, generator):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q_V[token]) < float(p_V[token]):
            return 0, token
        return None, int(torch.multinomial(p_V, 1, generator=generator))


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls,params,kind",
    [
        (SpeculativeDecoder, SamplingParams(temperature=1.0), "draft"),
        (SpeculativeDecoder, SamplingParams(temperature=0.7, top_k=4, top_p=0.9), "draft"),
        (NoResidual, SamplingParams(temperature=1.0), "draft"),
        (SpeculativeDecoder, SamplingParams(temperature=1.0), "head"),
        (SpeculativeDecoder, SamplingParams(temperature=0.7, top_k=4, top_p=0.9), "head"),
        (NoResidual, SamplingParams(temperature=1.0), "head"),
    ],
)
def test_sampled_sd_follows_the_target_distribution(cls, params, kind):
    """3-token continuations from 800 seeds vs the exact warped target distribution (p > 1e-3; the control fails),
    with a draft model and with an eagle head drafting."""
    length, samples = 3, 800
    model, target = _small_vocab_target()
    drafter = (
        StagedModel(noisy_copy(model, 1.0), 1)
        if kind == "draft"
        else SerialHeadProposer(_eagle_head(target, 2, spread=0.2), target)
    )
    sd = cls(target, drafter, 2)
    prompt = [1, 4, 2]
    counts, stats = sample_outcomes(sd, prompt, params, length, samples)
    p_value = chi_square_p_value(counts, sequence_probs(target, prompt, params, length), samples)
    if cls is NoResidual:
        assert p_value < 1e-3
        return
    accepted, drafted = sum(s.accepted for s in stats), sum(s.drafted for s in stats)
    assert 0.1 * drafted < accepted < 0.9 * drafted  # acceptances and rejections both occur
    assert p_value > 1e-3


def test_sampling_is_reproducible_for_a_seed(target_model):
    sd = SpeculativeDecoder(StagedModel(target_model, 1), StagedModel(noisy_copy(target_model, 0.5), 1), 3)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    assert sd.run([5, 6, 7], 30, params).token_ids == sd.run([5, 6, 7], 30, params).token_ids


def test_bad_input_is_refused(target_model):
    target = StagedModel(target_model, 1)
    with pytest.raises(SpdInputError, match="draft steps must be a positive integer"):
        SpeculativeDecoder(target, StagedModel(target_model, 1), 0)
    with pytest.raises(SpdInputError, match="draft model's vocabulary has 64 tokens but the target's has 128"):
        SpeculativeDecoder(target, StagedModel(tiny_model("llama", layers=2, vocab=64), 1), 2)
    sd = SpeculativeDecoder(target, StagedModel(target_model, 1), 2)
    with pytest.raises(SpdInputError, match="unknown mode 'tree'"):
        sd.generate([5], mode="tree")


def _cli_common(tiny_testbed) -> list[str]:
    return ["--target", str(tiny_testbed / "target"), "--prompt", "class A:\n", "--max-new-tokens", "16", "--json"]


def _cli_sd_equals_ar(tiny_testbed, *drafter: str) -> dict:
    """spd-generate --mode sd with ``drafter``'s flags and m = 3: the tokens of --mode ar; returns its stats."""
    common = _cli_common(tiny_testbed)
    sd = spd_generate(*common, "--mode", "sd", *drafter, "--draft-steps", "3")
    assert sd.returncode == 0, sd.stderr
    got = json.loads(sd.stdout)
    assert got["token_ids"] == json.loads(spd_generate_main(*common).stdout)["token_ids"]
    assert got["stats"]["mode"] == "sd" and got["stats"]["draft_steps"] == 3
    return got["stats"]


def _refused_in_one_line(tiny_testbed, cases) -> None:
    """Each case's spd-generate exits 2 with one line naming the problem (two processes at a time)."""
    procs = two_at_a_time(lambda args: spd_generate(*_cli_common(tiny_testbed), *args), [args for args, _ in cases])
    for (_, expected), bad in zip(cases, procs):
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and expected in lines[0], bad.stderr


@pytest.mark.slow
def test_cli_and_bench(tiny_testbed, tmp_path):
    assert _cli_sd_equals_ar(tiny_testbed, "--draft-model", str(tiny_testbed / "draft"))["source"] == "draft"
    draft = ["--mode", "sd", "--draft-model", str(tiny_testbed / "draft")]
    _refused_in_one_line(
        tiny_testbed,
        [
            (["--mode", "sd"], "--mode sd takes one drafter"),
            (draft + ["--stages", "2"], "--stages must be 1"),
            (draft + ["--draft-steps", "0"], "--draft-steps: expected a positive integer"),
        ],
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n"}) + "\n" + json.dumps({"prompt": "def f(x):\n"}) + "\n")
    out = tmp_path / "bench.json"
    run_bench(
        "decode",
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(prompts),
        "--run",
        f"sd3=sd:{tiny_testbed / 'draft'}:3",
        "--temperatures",
        "0",
        "1",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
    )
    results = json.loads(out.read_text())["results"]
    greedy = results["T=0"]["sd3"]["summary"]
    assert greedy["identical_to_ar"] == 2 and greedy["L_acc"] >= 1.0 and len(greedy["acceptance_by_position"]) == 3
    assert results["T=1"]["sd3"]["summary"]["theoretical_speedup"] > 0


@pytest.mark.slow
def test_eagle_variant_trains_loads_and_drafts(tiny_testbed, tmp_path):
    """train/distill.py variant=eagle: a one-stage head trained for 1..draft_steps drafts in flight, with the
    expected acceptance length in its summary; spd-generate / the bench run it in --mode sd (greedy == ar), and
    the modes that take other heads refuse it (and sd refuses a pipeline head) with one line."""
    out = tmp_path / "eagle"
    train(*distill_args(tiny_testbed, out, "variant=eagle", "draft_steps=3", "max_steps=3", "save_every=0"))
    head = Speculator.from_pretrained(out / "final")
    cfg = head.config
    assert (cfg.schedule, cfg.n_stages, cfg.max_depth, cfg.draft_steps) == ("serial", 1, 1, 3)  # n_stages=4 ignored
    assert sorted(head.fc) == ["0", "1"] and cfg.anchors[1] == [0, 4, 8]
    ev = json.loads((out / "summary.json").read_text())["eval"]
    agree = [ev["top1_by_fill"][str(a)] for a in (1, 2, 3)]
    assert ev["top1_full"] == agree[0]
    assert ev["L_acc_est"] == pytest.approx(
        1 + agree[0] + agree[0] * agree[1] + agree[0] * agree[1] * agree[2], abs=1e-3
    )
    stats = _cli_sd_equals_ar(tiny_testbed, "--speculator", str(out / "final"))
    assert stats["source"] == "head" and stats["draft_layers"] == 1
    spd_head = tmp_path / "spd"  # a pipeline head (untrained: only its refusal is tested)
    new_head(
        StagedModel.from_pretrained(tiny_testbed / "target", n_stages=2),
        DistillConfig(n_stages=2, target=str(tiny_testbed / "target")),
    ).save_pretrained(spd_head / "final")
    eagle = ["--speculator", str(out / "final")]
    _refused_in_one_line(
        tiny_testbed,
        [
            (["--mode", "spd", *eagle], "variant=eagle, a serial drafter"),
            (["--mode", "tree", *eagle], "variant=eagle, a serial drafter"),
            (["--mode", "sd", "--speculator", str(spd_head / "final")], "takes a head trained with variant=eagle"),
            (["--mode", "sd", *eagle, "--draft-model", str(tiny_testbed / "draft")], "--mode sd takes one drafter"),
        ],
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n"}) + "\n")
    bench = tmp_path / "bench.json"
    run_bench(
        "decode",
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(prompts),
        "--run",
        f"eagle=sd:{out / 'final'}:3",
        "--max-new-tokens",
        "12",
        "--out",
        str(bench),
    )
    report = json.loads(bench.read_text())
    assert report["results"]["T=0"]["eagle"]["summary"]["identical_to_ar"] == 1
