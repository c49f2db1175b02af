"""The Python API as a user meets it: ``Engine.from_pretrained(..., n_stages=)``, ``generate`` and ``chat`` with
``.text``, ``.token_ids`` and ``.stats``, a streamer of text, and one SpdInputError sentence for every wrong
argument. Lossless: the reply is the target's own greedy reply (Hugging Face ``model.generate``)."""

import warnings

import pytest
import torch

from conftest import tiny_model
from spd import Engine, SamplingParams, SpdInputError
from spd.decoding.request import Detokenizer
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

N = 24  # new tokens per request
CHAT = [{"role": "user", "content": "def add(a, b):"}]
OTHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]


@pytest.fixture(scope="module")
def engine(tiny_testbed, tiny_heads) -> Engine:
    """The miniature testbed's target in 2 stages with an (untrained) SPD head."""
    return Engine.from_pretrained(str(tiny_testbed / "target"), speculator=str(tiny_heads[2]))


@pytest.fixture(scope="module")
def varied(engine) -> Engine:
    """A random target of the testbed's vocabulary in 4 stages with an untrained head and the testbed's tokenizer:
    its replies vary from token to token (the testbed's repeats one), flush the pipeline at almost every step, and
    hold byte tokens that are no whole UTF-8 character."""
    staged = StagedModel(tiny_model("llama", vocab=len(engine.tokenizer)), 4)
    torch.manual_seed(0)
    return Engine.chain(staged, new_head(staged, DistillConfig(n_stages=4)).eval(), tokenizer=engine.tokenizer)


def greedy_reply(engine: Engine, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The chat prompt's ids, rendered as a user would for ``model.generate``, and the target's greedy new tokens."""
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = engine.staged.model.generate(
        torch.tensor([prompt]), max_new_tokens=N, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return prompt, out[0, len(prompt) :].tolist()


# ------------------------------------------------------------------------------------------ chat and text


@pytest.mark.parametrize("which", ["testbed", "varied"])
def test_chat_text_is_the_targets_greedy_reply(engine, varied, which):
    engine = engine if which == "testbed" else varied
    prompt, want = greedy_reply(engine, CHAT)
    for mode in ("spd", "pp", "ar"):
        out = engine.chat(CHAT, max_new_tokens=N, mode=mode)
        assert out.prompt_ids == prompt and out.token_ids == want, mode
        assert out.text == engine.tokenizer.decode(want, skip_special_tokens=True), mode
        assert out.stats.mode == mode and out.stats.new_tokens == len(want)
    assert out.text and "<|" not in out.text  # the text of the reply, special tokens skipped
    assert engine.chat(CHAT, max_new_tokens=N).stats.equivalent_accept_length > 0  # spd's statistics


def test_generate_text_and_lists(engine):
    out = engine.generate("def main():\n", max_new_tokens=N)
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert engine.generate(out.prompt_ids, max_new_tokens=N).token_ids == out.token_ids  # token ids, as before
    assert engine.generate(torch.tensor([out.prompt_ids]), max_new_tokens=N).text == out.text
    # A list of prompts or of conversations: a list of outputs, each the one a single call gives.
    outs = engine.generate(["def main():\n", [5, 6, 7]], max_new_tokens=N)
    assert [o.token_ids for o in outs] == [out.token_ids, engine.generate([5, 6, 7], max_new_tokens=N).token_ids]
    replies = engine.chat([CHAT, OTHER], max_new_tokens=N)
    assert [r.text for r in replies] == [engine.chat(m, max_new_tokens=N).text for m in (CHAT, OTHER)]


def test_chat_in_a_token_tree_and_serial_drafting(tiny_testbed):
    """Every engine has chat: the tree engine with a draft model, and serial drafting (SpeculativeDecoder)."""
    from spd import SpeculativeDecoder

    target, draft = str(tiny_testbed / "target"), str(tiny_testbed / "draft")
    tree = Engine.from_pretrained(target, draft_model=draft, n_stages=2, width=2, children=2)
    want = greedy_reply(tree, CHAT)[1]
    assert tree.chat(CHAT, max_new_tokens=N).token_ids == want
    sd = SpeculativeDecoder.from_pretrained(target, draft)
    assert sd.chat(CHAT, max_new_tokens=N).text == tree.tokenizer.decode(want, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------- streaming


def test_streamed_pieces_concatenate_to_the_text(engine, varied, capsys):
    for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1), (1.0, 2)):
        pieces, ids = [], []
        out = varied.chat(
            CHAT,
            max_new_tokens=40,
            temperature=temperature,
            seed=seed,
            streamer=pieces.append,
            on_token=lambda t, a: ids.append(t),  # noqa: B023 - on_token runs inside this chat call
        )
        assert "".join(pieces) == out.text and ids == out.token_ids and all(pieces)
    out = engine.chat(CHAT, max_new_tokens=N)
    engine.chat(CHAT, max_new_tokens=N, streamer=lambda piece: print(piece, end=""))
    assert capsys.readouterr().out == out.text


def test_detokenizer_holds_back_split_characters(engine):
    """Byte-level tokens split multi-byte characters: no piece shows half of one, and the pieces are the text."""
    tokenizer = engine.tokenizer
    text = "héllo wörld: 日本語 ✓ 🙂 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids] + [detokenizer.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces[:-1]  # some token completed no character (the case this guards)
    # A character cut off by the end of the generation ends the text as U+FFFD, as decoding the whole does.
    cut = tokenizer("🙂", add_special_tokens=False)["input_ids"][:-1]
    detokenizer = Detokenizer(tokenizer)
    assert "".join([detokenizer.add(t) for t in cut] + [detokenizer.finish()]) == tokenizer.decode(cut)


# --------------------------------------------------------------------------------------- wrong arguments


@pytest.mark.parametrize(
    "call,kwargs,message",
    [
        ("generate", {"temperature": -1}, "temperature must be a finite number >= 0"),
        ("generate", {"temperature": float("nan")}, "temperature must be"),
        ("generate", {"temperature": "0.7"}, "temperature must be"),
        ("generate", {"top_p": 0}, r"top_p must be a number in \(0, 1\]"),
        ("generate", {"top_p": 1.5}, "top_p must be"),
        ("generate", {"top_k": -1}, "top_k must be an integer >= 0"),
        ("generate", {"top_k": 2.5}, "top_k must be"),
        ("generate", {"seed": "a"}, "seed must be None or an integer"),
        ("generate", {"seed": 2**64}, "seed must be"),
        ("generate", {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ("generate", {"max_new_tokens": "5"}, "max_new_tokens must be an integer"),
        ("generate", {"mode": "sd"}, "unknown mode 'sd'"),
        ("generate", {"eos_token_id": "eos"}, "eos_token_id must be a token id"),
        ("generate", {"streamer": 5}, "streamer must be a callable"),
        ("generate", {"on_token": 5}, "on_token must be a callable"),
        ("generate", {"prompt": ""}, "the prompt is empty"),
        ("generate", {"prompt": []}, "the prompt is empty"),
        ("generate", {"prompt": None}, "the prompt must be text or a sequence of token ids"),
        ("generate", {"prompt": [1.5, 2]}, "prompt token ids must be integers"),
        ("generate", {"prompt": [10**9]}, "prompt token id 1000000000 is outside the vocabulary"),
        ("generate", {"prompt": torch.zeros(2, 3, dtype=torch.long)}, r"must have shape \(T,\) or \(1, T\)"),
        ("generate", {"prompt": CHAT}, r"call chat\(messages\)"),
        ("generate", {"prompt": ["a", "b"], "streamer": print}, "pass one prompt per call to stream"),
        ("chat", {"messages": []}, "messages must be a non-empty list"),
        ("chat", {"messages": "hi"}, "messages must be a non-empty list"),
        ("chat", {"messages": [{"role": "user"}]}, r"messages\[0\] must be a dict with a string 'role'"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, r"messages\[0\] must be a dict"),
        ("chat", {"temperature": -1}, "temperature must be"),
    ],
)
def test_each_wrong_argument_is_one_sentence(engine, call, kwargs, message):
    kwargs = {("messages" if call == "chat" else "prompt"): CHAT if call == "chat" else "x", **kwargs}
    with pytest.raises(SpdInputError, match=message) as error:
        getattr(engine, call)(**kwargs)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value) and "--" not in str(error.value)


def test_sampling_settings_as_one_object(engine):
    """``sampling=SamplingParams(...)`` gives what its keywords give; both at once, or another object, is one
    sentence."""
    settings = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3}
    for call, first in (("generate", "def add(a, b):"), ("chat", CHAT)):
        want = getattr(engine, call)(first, max_new_tokens=12, **settings).token_ids
        assert getattr(engine, call)(first, max_new_tokens=12, sampling=SamplingParams(**settings)).token_ids == want
        with pytest.raises(SpdInputError, match="or as keywords, not both; got sampling= and temperature=$"):
            getattr(engine, call)(first, sampling=SamplingParams(), temperature=0.5)
    with pytest.raises(SpdInputError, match="sampling must be a SamplingParams, got {'temperature': 1}"):
        engine.generate("x", sampling={"temperature": 1})


def test_sampling_params_raise_spd_input_error():
    with pytest.raises(SpdInputError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):  # SpdInputError is a ValueError: old callers still catch it
        SamplingParams(top_p=2.0)
    assert SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=-1).seed == -1


def test_chat_needs_a_tokenizer_with_a_template(engine):
    with pytest.raises(SpdInputError, match="chat needs a tokenizer"):
        Engine.chain(engine.staged).chat(CHAT)
    tokenizer = type(engine.tokenizer).from_pretrained(engine.tokenizer.name_or_path)
    tokenizer.chat_template = None
    with pytest.raises(SpdInputError, match="has no chat template; pass the prompt as text to generate"):
        Engine.chain(engine.staged, tokenizer=tokenizer).chat(CHAT)


# ---------------------------------------------------------------------------------------------- n_stages


def test_n_stages_and_python_worded_cut_errors(tiny_testbed, tiny_heads):
    target, head = str(tiny_testbed / "target"), str(tiny_heads[2])
    engine = Engine.from_pretrained(target, n_stages=4)
    assert engine.staged.n_stages == 4 and engine.mode == "pp"
    assert engine.generate("x", max_new_tokens=4).stats.stages == 4
    assert Engine.from_pretrained(target, n_stages=3).staged.boundaries == [0, 3, 6, 8]  # the larger stages first
    with pytest.raises(SpdInputError, match="9 stages need at least 9 layers, but the model has 8"):
        Engine.from_pretrained(target, n_stages=9)
    with pytest.raises(SpdInputError) as error:
        Engine.from_pretrained(target, speculator=head, n_stages=4)
    assert str(error.value) == (
        "the speculator does not fit this target: it was trained for n = 2 stages of 4, 4 layers (boundaries=[4]) "
        "but n_stages=4 asks for 4 stages of 2, 2, 2, 2 layers; leave n_stages and boundaries out (the head's cut "
        "is the default) or use a head trained for that cut"
    )
    for n_stages in (0, 2.0, "2"):
        with pytest.raises(SpdInputError, match="n_stages must be a positive integer"):
            Engine.from_pretrained(target, n_stages=n_stages)
    with pytest.raises(SpdInputError, match="boundaries must be a list of layer indices"):
        Engine.from_pretrained(target, boundaries="2,4")
    assert Engine.from_pretrained(target, boundaries=[0, 3, 8]).staged.boundaries == [0, 3, 8]
    with warnings.catch_warnings(record=True) as caught:  # the old name still works, and says so
        warnings.simplefilter("always")
        assert Engine.from_pretrained(target, stages=2).staged.n_stages == 2
    assert any("n_stages" in str(w.message) for w in caught)


def test_flags_in_shared_messages_become_argument_names():
    from spd.decoding.modes import in_python_terms

    message = (
        "pass --stages 8 or --boundaries 4,8,12 (or leave --stages and --boundaries out), --mode spd, --draft-model"
    )
    assert in_python_terms(message) == (
        "pass n_stages=8 or boundaries=[4, 8, 12] (or leave n_stages and boundaries out), mode 'spd', draft_model"
    )
    path = "the file '/hub/models--owner--name/x.pt' is damaged"  # the hub cache's names are no flags
    assert in_python_terms(path) == path
