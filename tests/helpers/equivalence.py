"""The equality checks every target family passes (hybrid and mixture-of-experts targets: tests/test_hybrid.py,
tests/test_moe.py): ar, pp and spd equal ``model.generate``, and stage processes equal the single process."""

import torch

from helpers.proposers import ScriptedEngine
from spd.decoding.batch import BatchedPipeline
from spd.decoding.engine import Engine
from spd.decoding.generation import default_eos, generate_ar
from spd.decoding.proposers import SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

PROMPT = [3 + (7 * i) % 120 for i in range(40)]  # long enough for many flushes at every fill


def generate_reference(model, prompt, max_new):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def check_ar_pp_spd_equal_generate(model, n: int, prompt: list[int], reference: list[int]) -> None:
    """ar, pp and spd (a random head, and the same head scripted right and wrong in a pattern: flushes at every
    fill, each rolling back a different number of tokens) give ``model.generate``'s greedy ``reference``."""
    staged = StagedModel(model, n)
    torch.manual_seed(1)
    engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=n)).eval())
    new = len(reference)
    assert generate_ar(staged, prompt, new).token_ids == reference
    assert engine.run(prompt, new, SamplingParams(), use_head=False).token_ids == reference
    assert engine.run(prompt, new, SamplingParams()).token_ids == reference
    scripted = ScriptedEngine(engine, reference, len(prompt), right=lambda pos: pos % 5 not in (0, 2))
    out = scripted.run(prompt, new, SamplingParams())
    assert out.token_ids == reference
    assert out.stats.flushes >= new // 6 and out.stats.accepted >= new // 5
    assert len({i for i, v in enumerate(out.stats.verified_by_position) if v}) >= min(n, 3)


def check_distributed_equals_single_process(
    target, tmp_path, temperature: float = 0.0, early: bool = False, max_batch: int = 0
) -> None:
    """Stage processes (torchrun, n = 4) give the single-process engines' tokens in spd, pp and a W = 2 tree with a
    random head on ``target`` (many flushes: each rolls every stage back). ``max_batch``: the prompts as requests of
    the batched pipeline (``--max-batch``), equal to the in-process batched pipeline's."""
    import json

    from helpers.runtime import PROMPTS, torchrun
    from spd.heads.loading import load_speculator
    from spd.target.tokenizer import load_tokenizer

    n = 4
    staged = StagedModel.from_pretrained(target, n_stages=n)
    torch.manual_seed(7)
    new_head(staged, DistillConfig(n_stages=n, target=str(target))).save_pretrained(tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    proc = torchrun(
        n,
        "--target",
        str(target),
        "--speculator",
        str(tmp_path / "head"),
        "--mode",
        "spd",
        "pp",
        "tree",
        "--tree-width",
        "2",
        "--tree-children",
        "2",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "20",
        "--temperature",
        str(temperature),
        "--top-k",
        "20",
        "--seed",
        "5",
        "--out",
        str(out),
        *(["--early-launch"] if early else []),
        *(["--max-batch", str(max_batch)] if max_batch else []),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not max_batch or f"largest batch {max_batch}" in proc.stderr
    report = json.loads(out.read_text())
    tok = load_tokenizer(target)
    head = load_speculator(tmp_path / "head")
    engine = Engine.chain(staged, head, tok)
    tree = Engine.tree(staged, SpdHeadProposer(head, staged, 2), 2, tok)
    torch.set_num_threads(1)  # as each stage process
    for mode, eng in (("spd", engine), ("pp", engine), ("tree", tree)):
        ids = [tok(p)["input_ids"] for p in PROMPTS]
        if max_batch:
            sampling = [SamplingParams(temperature, 20, 1.0, 5 + i) for i in range(len(ids))]
            want = [
                o.token_ids
                for o in BatchedPipeline(eng, max_batch).generate(
                    ids, 20, sampling, default_eos(staged.model, tok), mode=mode
                )
            ]
        else:
            want = [
                eng.generate(p, 20, mode=mode, temperature=temperature, top_k=20, seed=5 + i).token_ids
                for i, p in enumerate(ids)
            ]
        assert [r["token_ids"] for r in report["results"][mode]] == want, mode
    assert sum(r["stats"]["flushes"] for r in report["results"]["spd"]) > 5
