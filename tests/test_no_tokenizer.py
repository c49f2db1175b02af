"""A target directory without a tokenizer: token-id prompts (Python API and ``spd-generate --prompt-ids``), and
generation stopping at the EOS of the model's generation config exactly where ``model.generate`` stops."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model, two_at_a_time
from helpers.cli import spd_generate, spd_generate_main
from spd.decoding.engine import Engine
from spd.decoding.generation import default_eos, generate_ar
from spd.errors import SpdInputError
from spd.target.staging import StagedModel

PROMPT = [5, 17, 3, 99, 42, 8, 11, 12]
MAX_NEW = 32
GREEN, RESET = "\x1b[32m", "\x1b[0m"


@pytest.fixture(scope="module")
def model_only(tmp_path_factory) -> SimpleNamespace:
    """A tiny Qwen3 target saved without tokenizer files, whose generation config's EOS (a list) is a token its
    greedy output reaches after about a dozen tokens; an SPD head (n = 2) and a draft model (a noisy copy)."""
    from spd.training.distill import DistillConfig, new_head

    root = tmp_path_factory.mktemp("model_only")
    model = tiny_model("qwen3", seed=0, layers=4)
    free = generate_ar(StagedModel(model, 1), PROMPT, MAX_NEW).token_ids  # no EOS
    stop = next(i for i in range(10, MAX_NEW) if free.index(free[i]) == i)  # the first occurrence of its token
    unused = next(t for t in range(3, model.config.vocab_size) if t not in free)
    assert model.config.eos_token_id not in free  # config.json's EOS never comes: only the generation config's
    model.generation_config.eos_token_id = [unused, free[stop]]
    model.save_pretrained(root / "target")

    torch.manual_seed(1)
    staged = StagedModel(model, 2)
    new_head(staged, DistillConfig(n_stages=2, target=str(root / "target"))).save_pretrained(root / "head")
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=gen))
    draft.save_pretrained(root / "draft")

    hf_model = type(model).from_pretrained(root / "target").eval()
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(PROMPT) :]
    expected = hf.tolist()
    assert expected == free[: stop + 1]  # model.generate stops at the generation config's EOS
    assert not any((root / "target" / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    return SimpleNamespace(
        root=root, target=root / "target", head=root / "head", draft=root / "draft", expected=expected
    )


def test_default_eos_follows_model_generate():
    """Explicit > the generation config's EOS (what model.generate uses, even with a tokenizer) > the tokenizer's."""
    tok = SimpleNamespace(eos_token_id=7)
    assert default_eos(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 6])), tok) == [5, 6]
    assert default_eos(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)), tok) == 7
    assert default_eos(SimpleNamespace(generation_config=None), None) is None


def test_python_api_without_a_tokenizer_stops_where_model_generate_stops(model_only):
    engine = Engine.from_pretrained(str(model_only.target), speculator=str(model_only.head))
    assert engine.tokenizer is None
    for mode in ("ar", "pp", "spd"):
        out = engine.generate(PROMPT, max_new_tokens=MAX_NEW, mode=mode)
        assert out.token_ids == model_only.expected, mode
        assert out.stats.stop_reason == "eos" and len(out.stats.token_acceptance) == out.stats.new_tokens
    # An explicit EOS wins; an empty list means none.
    assert len(engine.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_id=[]).token_ids) == MAX_NEW
    tree = Engine.from_pretrained(
        str(model_only.target), draft_model=str(model_only.draft), n_stages=2, width=2, children=2
    )
    assert tree.tokenizer is None
    out = tree.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert out.token_ids == model_only.expected and out.stats.stop_reason == "eos"
    with pytest.raises(SpdInputError, match="text prompt needs a tokenizer"):
        engine.generate("def main():")
    with pytest.raises(SpdInputError, match="text prompt needs a tokenizer"):
        tree.generate("def main():")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "pp", "spd", "tree"])
def test_cli_prompt_ids_stop_where_model_generate_stops(model_only, mode):
    args = {
        "ar": [],
        "pp": ["--stages", "2"],
        "spd": ["--speculator", str(model_only.head)],
        "tree": ["--draft-model", str(model_only.draft), "--stages", "2", "--tree-width", "2"],
    }[mode]
    proc = spd_generate(
        "--target",
        str(model_only.target),
        "--mode",
        mode,
        *args,
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        str(MAX_NEW),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] is None and out["token_ids"] == model_only.expected
    stats = out["stats"]
    assert stats["stop_reason"] == "eos" and stats["mode"] == mode
    flags = stats["token_acceptance"]
    assert len(flags) == stats["new_tokens"] and sum(flags) == stats.get("accepted", 0)


@pytest.mark.slow
def test_cli_streams_token_ids_and_colours_exactly_the_accepted_ones(model_only):
    common = [
        "--target",
        str(model_only.target),
        "--mode",
        "tree",
        "--draft-model",
        str(model_only.draft),
        "--stages",
        "2",
        "--tree-width",
        "2",
        "--prompt-ids",
        " ".join(map(str, PROMPT)),
        "--max-new-tokens",
        str(MAX_NEW),
    ]
    as_json = spd_generate(*common, "--json")
    assert as_json.returncode == 0, as_json.stderr
    flags = json.loads(as_json.stdout)["stats"]["token_acceptance"]
    assert any(flags) and not all(flags[1:])  # both kinds of token
    plain = spd_generate(*common)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == " ".join(map(str, model_only.expected)) + "\n"
    assert "tokens/s" in plain.stderr
    coloured = spd_generate(*common, "--show-acceptance")
    assert coloured.returncode == 0, coloured.stderr
    expected = " ".join(f"{GREEN}{t}{RESET}" if a else str(t) for t, a in zip(model_only.expected, flags))
    assert coloured.stdout == expected + "\n"


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--prompt-ids", "1,x,3"], "expects comma-separated integers, got 'x'"),
        (["--prompt-ids", "1.5"], "expects comma-separated integers"),
        (["--prompt-ids", ""], "--prompt-ids is empty"),
        (["--prompt-ids", " , "], "--prompt-ids is empty"),
        (["--prompt-ids=-4,2"], "non-negative token ids, got -4"),
        (["--prompt-ids", "1,128"], "token id 128, outside the target's vocabulary (0..127)"),
        (["--prompt-ids", "1,2", "--chat"], "--chat"),
        (["--prompt-ids", "1,2", "--prompt", "x"], "not allowed with argument"),
        (["--prompt-ids", "1,2", "--json", "--show-acceptance"], "--show-acceptance"),
        (["--prompt-ids", "1,2", "--tokenizer", "/no/such/tokenizer"], "does not exist"),
        (["--prompt", "x"], "--tokenizer"),
    ],
)
def test_bad_prompt_ids_are_one_clear_line_and_exit_2(model_only, args, expected):
    proc = spd_generate_main("--target", str(model_only.target), *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], proc.stderr


@pytest.mark.slow
def test_spd_generate_distributed_with_prompt_ids_and_no_tokenizer(model_only):
    """A target without a tokenizer across processes: token-id prompt, the generation config's EOS (rank 0 loads
    only its part of the model, generation_config.json included), acceptance flags in JSON and in colour."""
    from helpers.cli import spd_generate

    common = [
        "--target",
        str(model_only.target),
        "--mode",
        "tree",
        "--draft-model",
        str(model_only.draft),
        "--stages",
        "2",
        "--tree-width",
        "2",
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "32",
        "--runtime",
        "distributed",
    ]
    proc, coloured = two_at_a_time(lambda flag: spd_generate(*common, flag), ["--json", "--show-acceptance"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] is None and out["token_ids"] == model_only.expected
    assert out["stats"]["stop_reason"] == "eos"
    flags = out["stats"]["token_acceptance"]
    assert len(flags) == len(model_only.expected) and sum(flags) == out["stats"]["accepted"]
    assert coloured.returncode == 0, coloured.stderr
    expected = " ".join(f"\x1b[32m{t}\x1b[0m" if a else str(t) for t, a in zip(model_only.expected, flags))
    assert coloured.stdout == expected + "\n"
