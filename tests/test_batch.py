"""Many requests in one pipeline (spd.decoding.batch, docs/method.md §9): a batch of one is the single-request engine;
16 mixed requests (lengths, budgets, temperatures, a stop, a cancel, a failure) each get their own answer under a
KV memory bound; greedy output equals each request's solo output except at near-ties (reported); sampled output
follows the target's distribution in a batch of mixed requests (chi-square, with a negative control); the ragged
stage call; clear errors."""

import os
import random

import pytest
import torch

from conftest import differences_are_near_ties, tiny_model
from helpers.proposers import ScriptedProposer, noisy_copy
from helpers.stats import chi_square_p_value, sequence_probs
from spd.decoding.batch import BatchedPipeline
from spd.decoding.driver import answer_many
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import DraftModelProposer, SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.errors import SpdInputError
from spd.target import ragged
from spd.target.kv_pool import KVPool
from spd.target.linear_state import StackedStates
from spd.target.ragged import run_ragged
from spd.target.segments import Segment
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head


@pytest.fixture(scope="module")
def target_model():
    return tiny_model("llama", seed=0, layers=4)


def _tree_engine(model, n=4, width=4, noise=0.5):
    staged = StagedModel(model, n)
    return Engine.tree(staged, DraftModelProposer(StagedModel(noisy_copy(model, noise), 1), staged, 4), width)


def _prompt(i: int) -> list[int]:
    """Prompts of 1 to 38 tokens."""
    return [(7 * i + 3 * j) % 120 + 1 for j in range(1 + (i * 5) % 38)]


def test_where_two_outputs_part_the_solo_run_s_margin_is_measured(target_model):
    """spd.testing.ties: no difference for equal outputs; else the first differing token and the solo run's
    top-two margin there, a near tie only below the tolerance."""
    from spd.testing.ties import NEAR_TIE, first_difference

    staged, prompt = StagedModel(target_model, 1), _prompt(4)
    solo = generate_ar(staged, prompt, 8).token_ids
    assert first_difference(staged, prompt, solo, list(solo)) is None
    other = solo[:5] + [(solo[5] + 1) % 128] + solo[6:]
    found = first_difference(staged, prompt, solo, other)
    with torch.no_grad():
        top2 = torch.topk(target_model(torch.tensor([prompt + solo[:5]])).logits[0, -1], 2).values
    assert found.token == 5 and found.margin == pytest.approx(float(top2[0] - top2[1]), abs=1e-6)
    assert found.tolerance == NEAR_TIE and found.near_tie == (found.margin < NEAR_TIE)
    assert first_difference(staged, prompt, solo, solo[:6]).near_tie is False  # cut short: never a near tie


@pytest.mark.parametrize("width,temperature", [(1, 0.0), (4, 0.0), (1, 1.0), (4, 0.8)])
def test_a_batch_of_one_is_the_single_request_engine(target_model, width, temperature):
    """Same tokens and the same steps, hits and flushes as the engine's own run, greedy and seeded sampling."""
    engine = _tree_engine(target_model, width=width)
    batched = BatchedPipeline(engine, max_batch=1, kv_rows=512)
    for prompt in (_prompt(0), _prompt(3), _prompt(11)):
        sampling = SamplingParams(temperature=temperature, seed=5)
        solo = engine.run(prompt, 25, sampling)
        out = batched.generate([prompt], 25, sampling)[0]
        assert out.token_ids == solo.token_ids
        for key in ("steps", "accepted", "flushes", "verified", "proposals"):
            assert getattr(out.stats, key) == getattr(solo.stats, key), key
    assert max(batched.batch_sizes) == 1 and batched.pool.free_rows == 512


def test_sixteen_mixed_requests_each_get_their_own_answer(target_model):
    """16 requests of different lengths, budgets and sampling settings, one ended by a stop token, one cancelled,
    one failing in its own callback, through a tree engine whose flushes differ per request, with at most 6 in
    flight and a KV pool that holds only 4 of the longest at once (the others wait): every request gets its solo answer (greedy:
    solo ar up to near-ties; seeded sampling: the engine's own seeded run), nobody is dropped."""
    engine = _tree_engine(target_model)
    staged = engine.staged
    batched = BatchedPipeline(engine, max_batch=6, kv_rows=4 * (38 + 30 + 4 * 4 + 1), prefill_chunk=8)
    stop_token, seen_stop = None, []
    settings = []
    for i in range(16):
        temperature = (0.0, 0.0, 1.0, 0.7)[i % 4]
        settings.append(
            (
                _prompt(i),
                5 + (i * 7) % 26,
                SamplingParams(temperature=temperature, top_k=8 if i % 8 == 3 else 0, seed=100 + i),
            )
        )
    solo_stop = engine.run(settings[5][0], settings[5][1], settings[5][2])
    stop_token = solo_stop.token_ids[4]  # request 5 stops at its fifth token, as a stop string would

    def stopper(token, accepted):
        seen_stop.append(token)
        return token == stop_token

    cancelled_tokens = []

    def canceller(token, accepted):
        cancelled_tokens.append(token)
        if len(cancelled_tokens) == 4:
            requests[9].cancel()

    def failing(token, accepted):
        if token is not None and len(failed_tokens) == 2:
            raise ValueError("the client went away")
        failed_tokens.append(token)

    failed_tokens = []
    callbacks = {5: stopper, 9: canceller, 12: failing}
    requests = [
        batched.submit(prompt, budget, sampling, on_token=callbacks.get(i))
        for i, (prompt, budget, sampling) in enumerate(settings)
    ]
    batched.run()

    assert batched.kv_waits > 0 and max(batched.batch_sizes) <= 6  # the KV bound held requests back; none dropped
    assert batched.pool.free_rows == batched.pool.rows and not batched.active and not batched.queue
    assert requests[12].state == "failed" and "went away" in str(requests[12].error)
    near_ties, flushes = 0, 0
    for i, (request, (prompt, budget, sampling)) in enumerate(zip(requests, settings)):
        if i == 12:
            continue
        assert request.state == "done", (i, request.state, request.error)
        out = request.output
        flushes += out.stats.flushes
        if i == 9:
            assert out.stats.stop_reason == "stopped" and out.token_ids == cancelled_tokens
            assert len(out.token_ids) == 4
        if sampling.greedy and i not in (5, 9):
            solo = generate_ar(staged, prompt, budget).token_ids
            near_ties += differences_are_near_ties(staged, prompt, solo, out.token_ids)
        elif i == 5:
            assert out.token_ids == solo_stop.token_ids[:5] == seen_stop and out.stats.stop_reason == "stopped"
        elif i != 9:
            assert out.token_ids == engine.run(prompt, budget, sampling).token_ids, i
    assert flushes > 10  # rejections happened, each flushing only its own request
    print(f"{near_ties} near-tie difference(s)")


def test_a_batch_without_a_head_runs_pp_by_default(target_model):
    staged = StagedModel(target_model, 4)
    (out,) = BatchedPipeline(Engine.chain(staged)).generate([_prompt(3)], 12)
    assert out.stats.mode == "pp" and out.token_ids == generate_ar(staged, _prompt(3), 12).token_ids


def test_pp_and_spd_share_a_batch(target_model):
    """The standard pipeline and SPD requests in one batch, each equal to its solo greedy output."""
    staged = StagedModel(target_model, 4)
    torch.manual_seed(0)
    engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=4)).eval())
    batched = BatchedPipeline(engine, max_batch=8, kv_rows=1024, prefill_chunk=16)
    requests = [batched.submit(_prompt(i), 20, mode="pp" if i % 2 else "spd") for i in range(8)]
    batched.run()
    for i, request in enumerate(requests):
        assert request.output.stats.mode == ("pp" if i % 2 else "spd")
        differences_are_near_ties(
            staged, _prompt(i), generate_ar(staged, _prompt(i), 20).token_ids, request.output.token_ids
        )


def test_the_head_s_memory_slots_are_taken_and_given_back(target_model):
    """An SPD head's requests keep its memory in the batch's pool, a slot each: 8 requests through 3 slots, one
    cancelled in flight and one failing in its own callback; every slot is back in the pool at the end, and every
    other request equals its solo greedy output up to near-ties."""
    staged = StagedModel(target_model, 4)
    torch.manual_seed(0)
    engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=4)).eval())
    batched = BatchedPipeline(engine, max_batch=3, kv_rows=1024, prefill_chunk=16)
    slots_seen, counts = set(), [0] * 8

    def watch(i):
        def on_token(token, accepted):
            counts[i] += 1
            slots_seen.add(requests[i].proposer.cache.slot)
            if i == 2 and counts[i] == 3:
                raise ValueError("the client went away")
            if i == 5 and counts[i] == 3:
                requests[5].cancel()

        return on_token

    requests = [batched.submit(_prompt(i), 12, on_token=watch(i)) for i in range(8)]
    batched.run()
    assert type(batched.proposer_pool).__name__ == "SpeculatorPool"
    assert slots_seen == {0, 1, 2} and batched.proposer_pool.free == [0, 1, 2]
    assert requests[2].state == "failed" and "went away" in str(requests[2].error)
    assert requests[5].state == "done" and requests[5].output.stats.stop_reason == "stopped"
    for i, request in enumerate(requests):
        if i not in (2, 5):
            assert request.state == "done", (i, request.state, request.error)
            differences_are_near_ties(
                staged, _prompt(i), generate_ar(staged, _prompt(i), 12).token_ids, request.output.token_ids
            )


def _fails_once(monkeypatch, owner, name, after: int = 0):
    """``owner.name`` raises on its call number ``after`` (from 0), and works before and after."""
    original, calls = getattr(owner, name), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise RuntimeError(f"{name} failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)
    return calls


def test_a_stage_call_that_raises_fails_the_requests_in_it_and_the_batch_goes_on(target_model, monkeypatch):
    """The requests in a step whose stage call raised fail with its error and give their regions and head slots
    back; the step raises; the next requests run as usual. A request whose admission raises fails alone."""
    import spd.decoding.backend as batch_module

    staged = StagedModel(target_model, 4)
    torch.manual_seed(0)
    engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=4)).eval())
    batched = BatchedPipeline(engine, max_batch=4, kv_rows=1024, prefill_chunk=16)
    ended = []
    first = [batched.submit(_prompt(i), 12, on_done=ended.append) for i in range(3)]
    _fails_once(monkeypatch, batch_module, "run_ragged", after=6)
    with pytest.raises(RuntimeError, match="run_ragged failed"):
        batched.run()
    assert [r.state for r in first] == ["failed"] * 3 and ended == first and not batched.busy
    assert all("run_ragged failed" in str(r.error) for r in first)
    assert batched.pool.free_rows == batched.pool.rows and batched.proposer_pool.free == [0, 1, 2, 3]
    _fails_once(monkeypatch, batched.backend, "open")
    again = [batched.submit(_prompt(i), 12) for i in range(3)]
    batched.run()
    assert again[0].state == "failed" and "open failed" in str(again[0].error)
    for i, request in list(enumerate(again))[1:]:
        assert request.state == "done"
        differences_are_near_ties(
            staged, _prompt(i), generate_ar(staged, _prompt(i), 12).token_ids, request.output.token_ids
        )
    assert batched.pool.free_rows == batched.pool.rows


@pytest.mark.parametrize("proposer", ["head", "draft"])
def test_a_joint_proposal_that_raises_is_asked_again_alone(target_model, monkeypatch, proposer):
    """When the proposers' joint call raises part-way (the SPD head's memory, as it takes the rows committed since
    each request's last query; the draft model's LM head, after its ragged call ran the new nodes), each request is
    asked alone from where it was, and every request equals its solo greedy output."""
    staged = StagedModel(target_model, 4)
    if proposer == "head":
        torch.manual_seed(0)
        head = new_head(staged, DistillConfig(n_stages=4)).eval()
        engine = Engine.chain(staged, head)
        fail_at, calls = 2, _fails_once(monkeypatch, head, "append_memory_many", after=2)
    else:
        engine = _tree_engine(target_model, n=4, width=2)
        fail_at, calls = 12, _fails_once(monkeypatch, engine.proposer.draft, "logits", after=12)
    outs = BatchedPipeline(engine, max_batch=4, kv_rows=1024, prefill_chunk=16).generate(
        [_prompt(i) for i in range(4)], 14
    )
    assert calls[0] > fail_at + 1  # called again after the failure
    for i, out in enumerate(outs):
        differences_are_near_ties(staged, _prompt(i), generate_ar(staged, _prompt(i), 14).token_ids, out.token_ids)


class CheckedBatch(BatchedPipeline):
    """Also asks every question of a joint call alone (the proposers' queries, the verifications' logits), and
    records the largest difference of the answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.joint: list[tuple[str, int, float]] = []  # (kind, questions asked together, max |joint - alone|)

    def _answer(self, requests):
        if len(requests) > 1:
            items = [request.work for request in requests]
            alone = [item.answer() for item in items]
            joint = answer_many(items)
            assert [a.shape for a in alone] == [j.shape for j in joint]
            # (equal entries count as no difference: -inf outside a draft vocabulary)
            self.joint.append(
                (
                    type(items[0]).__name__,
                    len(items),
                    max(float(torch.where(a == j, 0, a - j).abs().max()) for a, j in zip(alone, joint)),
                )
            )
        super()._answer(requests)


@pytest.mark.parametrize("width,memory_proj", [(1, False), (4, False), (1, True)])
def test_the_head_and_the_lm_head_answer_every_request_in_one_call(target_model, width, memory_proj):
    """SPD chain and W = 4 tree: the head's joint query over every running request (each with its own cache
    length, path and tree) gives each request what its own query gives, and so do the verifications' logits from
    one LM-head call, up to fp32 rounding; sampled and greedy requests mixed; greedy output equals solo ar up to
    near-ties. With per-depth memory projections (made unlike each other here) the joint query projects each
    depth's rows with its own."""
    staged = StagedModel(target_model, 4)
    torch.manual_seed(1)
    head = new_head(staged, DistillConfig(n_stages=4, memory_proj=memory_proj)).eval()
    if memory_proj:
        with torch.no_grad():
            for layer in head.layers:
                for proj in layer.memory_proj.values():
                    proj.weight.add_(0.3 * torch.randn_like(proj.weight))
    engine = Engine.chain(staged, head) if width == 1 else Engine.tree(staged, SpdHeadProposer(head, staged, 4), 4)
    batched = CheckedBatch(engine, max_batch=6, kv_rows=2048, prefill_chunk=8)
    settings = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i) for i in range(8)]
    outs = batched.generate([_prompt(i) for i in range(8)], 18, settings)
    for kind in ("Propose", "TargetLogits"):
        calls = [(size, diff) for k, size, diff in batched.joint if k == kind]
        assert len(calls) > 5 and max(size for size, _ in calls) >= 3, kind  # roots leave stage n at various steps
        assert max(diff for _, diff in calls) < 1e-4, calls
    for i in range(0, 8, 2):
        differences_are_near_ties(staged, _prompt(i), generate_ar(staged, _prompt(i), 18).token_ids, outs[i].token_ids)


def test_a_draft_model_proposes_for_every_request_in_one_call(target_model, monkeypatch):
    """Tree mode with a draft model: each request's draft cache is a region of one pool, and the draft runs for every
    running request in one ragged call per step. Every joint answer equals the draft's own full forward over the
    request's committed tokens and each bottom node's path (an independent reference), greedy and sampled requests
    mixed; greedy output equals solo ar up to near-ties."""
    engine = _tree_engine(target_model, n=4, width=4)
    draft = engine.proposer.draft
    joint, checked = [], []
    original = DraftModelProposer.expand_many

    def checked_expand_many(items):
        answers = original(items)
        joint.append(len(items))
        for item, answer_LX in list(zip(items, answers))[:2]:  # two requests of every joint call
            mask_NN, bottom = item.tree.mask(), item.tree.bottom_level()
            for row, node in enumerate(bottom.tolist()):
                ids = item.context + item.tree.tokens_N[mask_NN[node]].tolist()
                want_X = torch.log_softmax(draft.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                checked.append(float((answer_LX[row] - want_X[: answer_LX.shape[1]]).abs().max()))
        return answers

    monkeypatch.setattr(DraftModelProposer, "expand_many", staticmethod(checked_expand_many))
    batched = BatchedPipeline(engine, max_batch=6, kv_rows=2048, prefill_chunk=8)
    settings = [SamplingParams(temperature=(0.0, 0.9)[i % 2], seed=i) for i in range(8)]
    outs = batched.generate([_prompt(i) for i in range(8)], 18, settings)
    assert len(joint) > 5 and max(joint) == 6 and len(checked) > 50
    assert max(checked) < 1e-4
    for i in range(0, 8, 2):
        differences_are_near_ties(
            engine.staged, _prompt(i), generate_ar(engine.staged, _prompt(i), 18).token_ids, outs[i].token_ids
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_kind,width",
    [
        ("ppsd", 1),
        ("output_state", 1),
        ("v10_qwen3_n4_l1", 1),
        ("v10_qwen3_n4_l1", 4),
        ("v11_qwen35_n4_l1", 4),
        ("v11_qwen3_n4_l1_draft", 1),
    ],
)
def test_every_head_proposes_for_every_request_in_one_call(target_model, head_kind, width):
    """The heads asked through their engine calls (HeadProposer): our output-state and PPSD heads, and the SPD authors'
    v10 and v11 heads (a hybrid target's, a draft vocabulary's), chain and W = 4 tree. One ``propose_logits_many``
    call per step answers every running request's every bottom node as its own query does (the authors' tower
    re-runs each request's in-flight rows over its own cache), up to fp32 rounding; greedy and sampled requests
    mixed; greedy output equals solo ar up to near-ties."""
    from helpers.authors import EXPECTED, head_file, staged_target
    from spd.decoding.proposers import HeadProposer
    from spd.heads.published.authors_head import load_authors_head

    if head_kind in ("ppsd", "output_state"):
        staged = StagedModel(target_model, 4)
        torch.manual_seed(2)
        head = new_head(staged, DistillConfig(n_stages=4, variant=head_kind)).eval()
    else:
        info = EXPECTED["heads"][head_kind]
        staged = staged_target(info["target"], info["num_stages"])
        head = load_authors_head(str(head_file(head_kind)), staged)
    engine = Engine.chain(staged, head) if width == 1 else Engine.tree(staged, HeadProposer(head, staged, 4), width)
    batched = CheckedBatch(engine, max_batch=6, kv_rows=2048, prefill_chunk=8)
    settings = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i) for i in range(8)]
    outs = batched.generate([_prompt(i) for i in range(8)], 18, settings)
    calls = [(size, diff) for kind, size, diff in batched.joint if kind == "Propose"]
    assert len(calls) > 5 and max(size for size, _ in calls) >= 3, calls
    assert max(diff for _, diff in calls) < 1e-4, calls
    for i in range(0, 8, 2):
        differences_are_near_ties(staged, _prompt(i), generate_ar(staged, _prompt(i), 18).token_ids, outs[i].token_ids)


@pytest.mark.parametrize("layout", ["spans", "blocks"])
def test_sliding_window_targets_batch_too(layout, monkeypatch):
    """Mistral with a window shorter than the prompts: the ragged mask applies each request's window (both attention
    layouts of a ragged call: in place, and gathered by segment size)."""
    monkeypatch.setattr(ragged, "RAGGED_ATTENTION", layout)
    model = tiny_model("mistral", seed=2, layers=4, sliding_window=8)
    engine = _tree_engine(model, n=2, width=2)
    batched = BatchedPipeline(engine, max_batch=4, kv_rows=1024, prefill_chunk=5)
    prompts = [_prompt(i) for i in (2, 3, 6, 9)]
    for prompt, out in zip(prompts, batched.generate(prompts, 16)):
        differences_are_near_ties(
            engine.staged, prompt, generate_ar(engine.staged, prompt, 16).token_ids, out.token_ids
        )


def test_newcomers_share_the_prefill_budget_of_a_step(target_model):
    """Prompts enter the pipeline ``prefill_chunk`` tokens per step in all, the oldest newcomer's first: three prompts
    admitted together never put more than 8 tokens into a stage call (not 8 each), the second takes what the first
    leaves of a step, and every request still gets its solo answer."""
    engine = _tree_engine(target_model)
    batched = BatchedPipeline(engine, max_batch=3, kv_rows=1024, prefill_chunk=8)
    prompts = [_prompt(i) for i in (3, 1, 5)]  # 16, 6 and 26 tokens
    outs = batched.generate(prompts, 12)
    # Until the first request's last chunk leaves stage 4 (after step 5), the stages carry prompt tokens only: 8
    # enter a step (the first prompt's 16 in steps 1-2, the second's 6 and 2 of the third's in step 3), and no stage
    # call holds more.
    assert [tokens[0] for tokens in batched.stage_tokens[:5]] == [8] * 5
    assert max(max(tokens) for tokens in batched.stage_tokens[:5]) == 8
    for prompt, out in zip(prompts, outs):
        differences_are_near_ties(
            engine.staged, prompt, generate_ar(engine.staged, prompt, 12).token_ids, out.token_ids
        )


def test_a_step_token_budget_leaves_prompts_what_the_levels_do_not_take(target_model):
    """``step_tokens``: the prompt tokens entering a step are what the levels in flight leave of a stage call's budget
    (W = 4 tree levels of up to 3 running requests, 12 tokens, under a budget of 14): stage 1 never carries more than
    14 tokens, prompts still enter beside full levels, and every request still gets its solo answer."""
    engine = _tree_engine(target_model)
    batched = BatchedPipeline(engine, max_batch=3, kv_rows=1024, prefill_chunk=64, step_tokens=14)
    prompts = [_prompt(i) for i in (3, 1, 5, 7, 2)]
    outs = batched.generate(prompts, 14)
    assert max(tokens[0] for tokens in batched.stage_tokens) == 14  # (without the budget: 64 in the first step)
    assert batched.stage_tokens[0][0] == 14
    for prompt, out in zip(prompts, outs):
        differences_are_near_ties(
            engine.staged, prompt, generate_ar(engine.staged, prompt, 14).token_ids, out.token_ids
        )


def test_a_spread_prefill_sends_each_prompt_in_n_equal_chunks(target_model):
    """``spread_prefill``: a 26-token prompt on 4 stages enters as 7, 7, 7 and 5 tokens, one chunk a step, so each
    stage call carries a quarter of it; two prompts admitted together share the step's budget oldest first; the
    answers are the solo ones."""
    engine = _tree_engine(target_model)
    batched = BatchedPipeline(engine, max_batch=2, kv_rows=1024, prefill_chunk=10, spread_prefill=True)
    prompts = [_prompt(5), _prompt(3)]  # 26 and 16 tokens: chunks of at most 7 and 4
    outs = batched.generate(prompts, 10)
    assert [tokens[0] for tokens in batched.stage_tokens[:4]] == [7 + 3, 7 + 3, 7 + 3, 5 + 4]
    assert [tokens[1] for tokens in batched.stage_tokens[1:5]] == [7 + 3, 7 + 3, 7 + 3, 5 + 4]
    for prompt, out in zip(prompts, outs):
        differences_are_near_ties(
            engine.staged, prompt, generate_ar(engine.staged, prompt, 10).token_ids, out.token_ids
        )


def test_a_node_budget_narrows_the_trees_as_the_batch_grows(target_model):
    """``tree_nodes``: W = 4 trees under a budget of 4 nodes per level across the batch: while 3 or 4 requests run,
    each grows one node per level, so no stage call carries more nodes than there are requests (without the budget
    the same batch carries up to 16); the last request alone grows its tree to 4 again; every answer is the solo
    one. A chain engine, or a budget below the batch size, is refused."""
    engine = _tree_engine(target_model)
    prompts = [_prompt(i) for i in (1, 2, 3, 4)]  # 6 + 11 + 16 + 21 = 54 tokens: all enter in the first step
    runs = {}
    for budget in (None, 4):
        batched = BatchedPipeline(engine, max_batch=4, kv_rows=1024, prefill_chunk=64, tree_nodes=budget)
        outs = batched.generate(prompts, 16)
        running = [(size, tokens) for size, tokens in zip(batched.batch_sizes[4:], batched.stage_tokens[4:])]
        runs[budget] = running, [o.stats.width_total / o.stats.expansions for o in outs]
        for prompt, out in zip(prompts, outs):
            differences_are_near_ties(
                engine.staged, prompt, generate_ar(engine.staged, prompt, 16).token_ids, out.token_ids
            )
    budgeted, free = runs[4][0], runs[None][0]
    assert all(max(tokens) <= size for size, tokens in budgeted if size >= 3), budgeted
    assert any(max(tokens) > size for size, tokens in free if size >= 3)  # (the budget is what bounds them)
    assert max(runs[4][1]) < 4 and min(runs[None][1]) == 4  # mean width per request
    for kwargs, match in [
        (
            {"engine": Engine.chain(StagedModel(target_model, 2)), "tree_nodes": 8},
            "narrows token trees, but this engine proposes chains",
        ),
        ({"max_batch": 4, "tree_nodes": 3}, "at least the batch size"),
    ]:
        with pytest.raises(SpdInputError, match=match):
            BatchedPipeline(**{"engine": engine, **kwargs})


class ScriptedBatch(BatchedPipeline):
    """Each SPD request's proposals forced right or wrong by position against its own solo ``ar`` output (the
    single-request ScriptedEngine of test_engine, one per request): hits, and flushes rolling back different numbers
    of tokens."""

    def __init__(self, engine, right, **kwargs):
        super().__init__(engine, **kwargs)
        self.right = right

    def submit(self, input_ids, max_new_tokens=128, *args, **kwargs):
        inner = self.engine.proposer
        reference = generate_ar(self.staged, input_ids, max_new_tokens).token_ids
        self.engine.proposer = ScriptedProposer(inner, reference, len(input_ids), self.right, self.staged.vocab_size)
        try:
            return super().submit(input_ids, max_new_tokens, *args, **kwargs)
        finally:
            self.engine.proposer = inner


class _SwappedStates(StackedStates):
    """Negative control: the first two members' states trade places (a batch that mixes up its requests' states)."""

    def __init__(self, members, counts):
        if len(members) > 1 and counts[0] == counts[1]:
            members = [members[1], members[0], *members[2:]]
        super().__init__(members, counts)


def _hybrid_batch(mode: str, n: int):
    model = tiny_model("qwen3_5", seed=4, layers=4)
    staged = StagedModel(model, n)
    if mode == "tree":  # a noisy copy of the target drafts a W = 3 tree: prunes and misses
        engine = Engine.tree(staged, DraftModelProposer(StagedModel(noisy_copy(model, 0.5), 1), staged, 2), 3)
        return staged, engine, BatchedPipeline(engine, max_batch=6, kv_rows=2048, prefill_chunk=8)
    torch.manual_seed(2)
    engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=n)).eval())
    return (
        staged,
        engine,
        ScriptedBatch(engine, lambda pos: pos % 5 not in (0, 2), max_batch=6, kv_rows=2048, prefill_chunk=8),
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode,n", [("spd", 4), ("tree", 2)])
def test_hybrid_targets_batch_with_each_requests_own_linear_state(mode, n, monkeypatch):
    """Qwen3.5 (linear-attention layers beside attention ones): 8 requests, at most 6 at once, each with its own
    linear-attention state, read and written together where each request runs one token (or one tree depth) through
    a linear layer; hits, prunes and flushes roll back only the request's own state. Greedy output equals each
    request's solo ar up to near-ties; a batch of one is the single-request engine (sampled, seeded); a batch that
    swaps two requests' states is caught."""
    staged, engine, batched = _hybrid_batch(mode, n)
    prompts = [_prompt(i) for i in range(8)]
    outs = batched.generate(prompts, 20)
    solo = [generate_ar(staged, p, 20).token_ids for p in prompts]
    for prompt, want, out in zip(prompts, solo, outs):
        differences_are_near_ties(staged, prompt, want, out.token_ids)
    assert max(batched.batch_sizes) == 6
    assert sum(o.stats.flushes for o in outs) > 20 and sum(o.stats.accepted for o in outs) > 20
    one = BatchedPipeline(engine, max_batch=1, kv_rows=512)
    for i in (0, 3):
        sampling = SamplingParams(temperature=0.8, seed=3)
        alone, out = engine.run(prompts[i], 20, sampling), one.generate([prompts[i]], 20, sampling)[0]
        assert out.token_ids == alone.token_ids and out.stats.steps == alone.stats.steps
    monkeypatch.setattr("spd.target.ragged.StackedStates", _SwappedStates)
    _, _, swapped = _hybrid_batch(mode, n)
    assert [o.token_ids for o in swapped.generate(prompts, 20)] != solo


@pytest.mark.parametrize("layout", ["spans", "blocks"])
def test_the_ragged_stage_call_is_each_request_alone(target_model, layout, monkeypatch):
    """One segment: exactly the stage call; several of mixed sizes (the first and third of one size, one group apart
    from the others in the gathered layout): equal to each alone up to rounding in both attention layouts, and each
    request's rows hold its own keys."""
    monkeypatch.setattr(ragged, "RAGGED_ATTENTION", layout)
    staged = StagedModel(target_model, 2)
    pool = KVPool(staged, 320)
    prompts = [_prompt(1), _prompt(4), _prompt(1)[::-1], _prompt(7)]
    pooled = [pool.caches(pool.allocate(64)) for _ in prompts]
    own = [staged.new_caches(capacity=64) for _ in prompts]
    with torch.no_grad():
        hidden = [staged.embed(torch.tensor([p])) for p in prompts]
        alone = list(hidden)
        for s in range(2):
            outs = run_ragged(pool, s, [Segment(c[s], h, anchors=[s * 2 + 1]) for c, h in zip(pooled, hidden)])
            hidden = [o.hidden_BTD for o in outs]
            ref = [staged.run_stage(s, h, c[s], anchors=[s * 2 + 1]) for h, c in zip(alone, own)]
            alone = [r.hidden_BTD for r in ref]
            for o, r in zip(outs, ref):
                assert torch.allclose(o.hidden_BTD, r.hidden_BTD, atol=1e-4, rtol=1e-5)
                assert torch.allclose(o.anchors[s * 2 + 1], r.anchors[s * 2 + 1], atol=1e-4, rtol=1e-5)
        for c, r in zip(pooled, own):
            for s in range(2):
                assert c[s].length == r[s].length
                assert torch.allclose(
                    c[s].keys_LBHkCDh[:, :, :, : c[s].length],
                    r[s].keys_LBHkCDh[:, :, :, : r[s].length],
                    atol=1e-4,
                    rtol=1e-5,
                )
        mine, alone = pool.caches(pool.allocate(64))[0], staged.new_caches(capacity=64)[0]
        for ids in ([prompts[2]], [[5]], [[6, 7]]):  # a prompt, then a token, then two, over the rows before
            hidden_1TD = staged.embed(torch.tensor(ids))
            single = run_ragged(pool, 0, [Segment(mine, hidden_1TD)])[0]
            assert torch.equal(single.hidden_BTD, staged.run_stage(0, hidden_1TD, alone).hidden_BTD)


@pytest.mark.parametrize("layout", ["spans", "blocks"])
def test_tree_levels_and_causal_segments_share_a_ragged_call(target_model, layout, monkeypatch):
    """Tree levels (explicit positions, an ancestor mask) beside a prompt chunk and single tokens, in one call per
    stage: each equal to its own stage call up to rounding in both attention layouts, its keys and position ids
    in its own rows."""
    monkeypatch.setattr(ragged, "RAGGED_ATTENTION", layout)
    staged = StagedModel(target_model, 2)
    pool = KVPool(staged, 400)
    prompts = [_prompt(2), _prompt(5), _prompt(3), _prompt(6)]
    pooled = [pool.caches(pool.allocate(80)) for _ in prompts]
    own = [staged.new_caches(capacity=80) for _ in prompts]
    committed = [len(p) for p in prompts]
    # Request 0: a root then two children (a tree level of 2); 1: a root, then a level of 3 under two parents;
    # 2: a chain's tokens (causal); 3: a prompt chunk of 4, then one of 2.
    trees = {
        0: [([7], [[True]]), ([8, 9], [[True, True, False], [True, False, True]])],
        1: [
            ([11], [[True]]),
            ([12, 13], [[True, True, False], [True, False, True]]),
            (
                [14, 15, 16],
                [
                    [True, True, False, True, False, False],
                    [True, True, False, False, True, False],
                    [True, False, True, False, False, True],
                ],
            ),
        ],
    }
    depths = {0: [[0], [1, 1]], 1: [[0], [1, 1], [2, 2, 2]]}
    causal = {2: [[21], [22], [23]], 3: [[31, 32, 33, 34], [35, 36], [37]]}
    with torch.no_grad():
        for prompt, c, o in zip(prompts, pooled, own):  # the prompts, each alone
            h_pool = h_own = staged.embed(torch.tensor([prompt]))
            for s in range(2):
                h_pool = run_ragged(pool, s, [Segment(c[s], h_pool)])[0].hidden_BTD
                h_own = staged.run_stage(s, h_own, o[s]).hidden_BTD
        for step in range(3):
            work = []  # (request, ids, positions or None, tree mask or None)
            for r, levels in trees.items():
                if step < len(levels):
                    ids, mask = levels[step]
                    positions = torch.tensor([committed[r] + d for d in depths[r][step]])
                    work.append((r, ids, positions, torch.tensor(mask)))
            for r, chunks in causal.items():
                work.append((r, chunks[step], None, None))
            hidden = {r: staged.embed(torch.tensor([ids])) for r, ids, _, _ in work}
            alone = dict(hidden)
            for s in range(2):
                outs = run_ragged(
                    pool,
                    s,
                    [Segment(pooled[r][s], hidden[r], pos, mask, anchors=[2 * s + 1]) for r, _, pos, mask in work],
                )
                for (r, _, pos, mask), out in zip(work, outs):
                    ref = staged.run_stage(
                        s,
                        alone[r],
                        own[r][s],
                        None if pos is None else pos[None],
                        anchors=[2 * s + 1],
                        tree_mask_TN=mask,
                    )
                    assert torch.allclose(out.hidden_BTD, ref.hidden_BTD, atol=1e-4, rtol=1e-5)
                    assert torch.allclose(out.anchors[2 * s + 1], ref.anchors[2 * s + 1], atol=1e-4, rtol=1e-5)
                    hidden[r], alone[r] = out.hidden_BTD, ref.hidden_BTD
        for c, o in zip(pooled, own):
            for s in range(2):
                assert c[s].length == o[s].length
                assert torch.equal(c[s].positions_C[: c[s].length], o[s].positions_C[: o[s].length])
                assert torch.allclose(
                    c[s].keys_LBHkCDh[:, :, :, : c[s].length],
                    o[s].keys_LBHkCDh[:, :, :, : o[s].length],
                    atol=1e-4,
                    rtol=1e-5,
                )


# ------------------------------------------------------------------------ sampled: the distribution
VOCAB, LENGTH, SAMPLES = 6, 3, 600


class UnfairBatch(BatchedPipeline):
    """Negative control: every request's seed is replaced by one shared seed (the draws are not independent)."""

    def submit(self, input_ids, max_new_tokens=128, sampling=SamplingParams(), *args, **kwargs):
        same = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, 0)
        return super().submit(input_ids, max_new_tokens, same, *args, **kwargs)


class NodeBudgetBatch(BatchedPipeline):
    """Trees under a node budget (18 nodes a level over up to 12 requests: W = 3 trees narrowing to 2 and 1)."""

    def __init__(self, engine, **kwargs):
        super().__init__(engine, tree_nodes=18, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [BatchedPipeline, UnfairBatch, NodeBudgetBatch])
def test_sampled_tree_in_a_mixed_batch_follows_the_target_distribution(cls):
    """3-token continuations of one prompt from 600 seeds, each run in a batch beside requests with other prompts,
    temperatures and budgets, vs the exact warped target distribution (p > 1e-3; the control fails); with trees
    whose width follows the batch under a node budget, too."""
    model = tiny_model("llama", seed=3, layers=6, vocab=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    staged = StagedModel(model, 2)
    engine = Engine.tree(
        staged, DraftModelProposer(StagedModel(noisy_copy(model, 1.0), 1), staged, 3), 3, candidates="sampled"
    )
    params, prompt = SamplingParams(temperature=1.0), [1, 4, 2]
    batched = cls(engine, max_batch=12, kv_rows=12 * 24, prefill_chunk=4)
    counted = []
    for seed in range(SAMPLES):
        counted.append(batched.submit(prompt, LENGTH, SamplingParams(1.0, seed=seed)))
        if seed % 3 == 0:  # a neighbour with another prompt, temperature and budget
            batched.submit([3, 1, 5, 2, 2][: 1 + seed % 5], 2 + seed % 4, SamplingParams(0.6 * (seed % 2), seed=seed))
    batched.run()
    counts = {}
    for request in counted:
        key = tuple(request.output.token_ids)
        counts[key] = counts.get(key, 0) + 1
    p_value = chi_square_p_value(counts, sequence_probs(staged, prompt, params, LENGTH), SAMPLES)
    if cls is UnfairBatch:
        assert p_value < 1e-3
        return
    assert max(batched.batch_sizes) == 12
    if cls is NodeBudgetBatch:  # the trees did narrow (W = 3 without the budget)
        assert sum(r.output.stats.width_total for r in counted) < 3 * sum(r.output.stats.expansions for r in counted)
    assert sum(r.output.stats.flushes for r in counted) > 20 and sum(r.output.stats.accepted for r in counted) > 20
    assert p_value > 1e-3


# ------------------------------------------------------------------------------------------ errors
def test_bad_settings_and_requests_are_refused_in_one_line(target_model):
    engine = _tree_engine(target_model, n=2)
    for kwargs, match in [
        ({"max_batch": 0}, "batch size must be a positive integer"),
        ({"prefill_chunk": 0}, "prefill chunk must be a positive"),
        ({"max_batch": 2, "step_tokens": 8}, r"above the 8 tokens of levels .* \(2 requests x 4\)"),
        ({"kv_rows": 0}, "positive number of rows"),
    ]:
        with pytest.raises(SpdInputError, match=match):
            BatchedPipeline(engine, **kwargs)
    batched = BatchedPipeline(engine, max_batch=2, kv_rows=64)
    for args, kwargs, match in [
        (([],), {}, "prompt is empty"),
        (([1, 2],), {"max_new_tokens": 0}, "at least 1"),
        (([1, 2], 100), {}, "needs 111 KV rows .* the pool holds 64"),
        (([1, 2],), {"mode": "spd"}, "runs mode tree, not 'spd'"),
    ]:
        with pytest.raises(SpdInputError, match=match):
            batched.submit(*args, **kwargs)
    assert not batched.busy


# --------------------------------------------------------------------------------------- the benchmark
@pytest.mark.slow
def test_the_batch_benchmark_over_the_runtime_reports_each_stage(tiny_testbed, tiny_heads, tmp_path):
    """spd-bench batch over the distributed runtime (2 stage processes, each call sleeping 1 ms): the same
    tokens from both systems, and per step the CPU of each stage process and each stage's clock (its ragged calls,
    its emulated sleep, its waits)."""
    import json

    from conftest import run_bench

    out = tmp_path / "runtime.json"
    proc = run_bench(
        "batch",
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(tiny_heads[2]),
        "--prompts",
        str(tiny_testbed / "prompts.jsonl"),
        "--runtime",
        "distributed",
        "--emulate-stage-ms",
        "1",
        "--clients",
        "2",
        "--requests-per-client",
        "1",
        "--max-new-tokens",
        "6",
        "--threads",
        "1",
        "--batched-only",
        "--out",
        str(out),
    )
    assert "identical outputs across the systems: True" in proc.stdout and "cpu/step" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["spd batched", "pp batched"]
    for row in rows:
        assert row["tokens"] == 12 and row["identical_outputs"]
        assert len(row["cpu_ms_per_step"]["stages"]) == 2 and all(ms > 0 for ms in row["cpu_ms_per_step"]["stages"])
        assert 0 <= row["overlap_ms_per_step"] <= row["own_ms_per_step"]
        clocks = row["stage_clock_ms_per_step"]
        assert len(clocks) == 2 and all(
            set(c) == {"compute", "emulated_compute", "receive_wait", "send"} for c in clocks
        )
        # Each stage call sleeps at least 1 ms, and stage 1 has work in every step but the last ones.
        assert all(c["compute"] > 0 and c["emulated_compute"] > 0 for c in clocks)
        assert clocks[0]["emulated_compute"] >= 0.5


def test_the_batch_benchmark_gives_time_between_tokens_per_gap_and_per_request():
    """spd-bench batch's time between tokens, from recorded steps and times: per gap (every gap of every
    request) and per request (each request's own mean gap, then their mean and percentiles); a request of one token
    has no gap."""
    from types import SimpleNamespace

    from spd.bench.batch import summarize

    # Two stages, every step costs a = 1 ms on the model clock; the real clock records the same times.
    steps = {"spec": [1, 2, 3, 5, 6, 7, 9, 10], "pipe": [2, 4, 6, 8, 10], "one": [3]}
    records = [
        {
            "steps": s,
            "times": [k / 1000 for k in s],
            "submit_step": 0,
            "submit_s": 0.0,
            "stats": SimpleNamespace(decode_tokens=len(s), steps=len(s)),
        }
        for s in steps.values()
    ]
    run = {"records": records, "stage_tokens": [[1, 1]] * 10, "batch_sizes": [3] * 10, "start_s": 0.0, "wall_s": 0.01}
    out = summarize(run, 2, 1.0, 0.0)
    spec, pipe = 9 / 7, 2.0  # ms: 9 ms over 7 gaps, 8 ms over 4
    for clock in ("model", "real"):
        got = out[clock]
        # per gap: five gaps of 1 ms and six of 2 ms
        assert got["tbt_mean_ms"] == pytest.approx(round(17 / 11, 2)) and got["tbt_p50_ms"] == 2.0
        assert got["tbt_p99_ms"] == 2.0
        assert got["tbt_request_mean_ms"] == pytest.approx(round((spec + pipe) / 2, 2))
        assert got["tbt_request_p50_ms"] == pytest.approx(round((spec + pipe) / 2, 2))
        assert got["tbt_request_p99_ms"] == pytest.approx(round(spec + 0.99 * (pipe - spec), 2))
    assert out["tokens"] == 14 and out["model"]["tokens_per_s"] == pytest.approx(1400)
    # each request's own: steps per token and time between tokens (none for a request of one token)
    assert [r["steps_per_token"] for r in out["per_request"]] == [round(9 / 7, 3), 2.0, None]
    assert [r["tbt_ms"]["real"] for r in out["per_request"]] == [round(spec, 2), pipe, None]
    assert [r["tokens"] for r in out["per_request"]] == [8, 5, 1]


def test_the_batch_benchmark_counts_the_cpu_of_its_stage_processes():
    """spd-bench batch's CPU count covers this process and each child process (the stage ranks over the
    runtime): a child that burns half a second of CPU shows it."""
    import subprocess
    import sys
    import time

    from spd.bench.batch import cpu_seconds, cpu_used

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)",
        ]
    )
    try:
        before = cpu_seconds()
        assert next(iter(before)) != child.pid and child.pid in before
        deadline = time.monotonic() + 30
        while cpu_seconds()[child.pid] - before[child.pid] < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        sum(range(10**6))  # some CPU of this process's own
        used = cpu_used(before, cpu_seconds())
    finally:
        child.kill()
        child.wait()
    assert used["driver"] > 0 and len(used["stages"]) == 1 and 0.45 <= used["stages"][0] < 5


@pytest.mark.slow
def test_the_batch_benchmark_prints_a_table_and_writes_json(tiny_testbed, tiny_heads, tmp_path):
    """spd-bench batch on the miniature testbed: every system serves the same requests (the same tokens),
    the table and the JSON carry both clocks, and the model clock follows a + b * tokens; with a draft model's
    tree instead of the head, too."""
    import json

    from conftest import run_bench, run_main, two_at_a_time
    from spd.bench.batch import main as bench_batch_main

    out, tree_out, head_tree_out = (tmp_path / name for name in ("batch.json", "batch_tree.json", "head_tree.json"))
    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(tiny_testbed / "prompts.jsonl"),
        "--clients",
        "1",
        "3",
        "--requests-per-client",
        "2",
        "--max-new-tokens",
        "6",
        "--stage-ms",
        "2",
        "--token-ms",
        "0.1",
        "--threads",
        "1",
    ]
    # The third: the head's own trees (--tree-width with --speculator), adaptive and under a node budget.
    proc, tree, head_tree = two_at_a_time(
        lambda args: run_bench("batch", *common, *args),
        [
            ["--speculator", str(tiny_heads[4]), "--rates", "0.001", "1000", "--requests", "3", "--out", str(out)],
            [
                "--draft-model",
                str(tiny_testbed / "draft"),
                "--stages",
                "2",
                "--tree-width",
                "2",
                "--new-tokens-jitter",
                "2",
                "--batched-only",
                "--out",
                str(tree_out),
            ],
            [
                "--speculator",
                str(tiny_heads[4]),
                "--tree-width",
                "auto",
                "--tree-max-width",
                "2",
                "--tree-nodes",
                "6",
                "--clients",
                "3",
                "--batched-only",
                "--out",
                str(head_tree_out),
            ],
        ],
    )
    assert "tree batched" in tree.stdout and "identical outputs across the systems: True" in tree.stdout
    tree_results = json.loads(tree_out.read_text())
    tree_rows = tree_results["rows"]  # (--batched-only: no one-at-a-time baseline)
    assert tree_results["systems"] == ["tree batched", "pp batched"] and "1-at-a-time" not in tree.stdout
    assert [(r["clients"], r["system"]) for r in tree_rows] == [(c, s) for c in (1, 3) for s in tree_results["systems"]]
    # With a jitter of 2, request k asks for 6 + a number from -2 to 2 drawn with seed k, in every system.
    budgets = [6 + random.Random(k).randint(-2, 2) for k in range(6)]
    assert len(set(budgets)) > 1 and all(r["tokens"] == sum(budgets[: 2 * r["clients"]]) for r in tree_rows)
    assert "spd batched" in proc.stdout and "pp batched" in proc.stdout and "1-at-a-time" in proc.stdout
    assert "identical outputs across the systems: True" in proc.stdout and "own/step" in proc.stdout
    results = json.loads(out.read_text())
    systems = ("spd batched", "pp batched", "spd 1-at-a-time")
    assert results["systems"] == list(systems)
    assert [(r["clients"], r.get("rate"), r["system"]) for r in results["rows"]] == [
        (c, None, s) for c in (1, 3) for s in systems
    ] + [(None, r, s) for r in (0.001, 1000) for s in systems]
    closed = [r for r in results["rows"] if r["clients"] is not None]
    # Open-loop rows: Poisson arrivals on the model clock, only that clock reported. At 0.001 requests/s each request
    # arrives long after the last one left, so batching changes nothing; at 1000/s all three arrive at once.
    slow = {r["system"]: r for r in results["rows"] if r.get("rate") == 0.001}
    burst = {r["system"]: r for r in results["rows"] if r.get("rate") == 1000}
    for row in [*slow.values(), *burst.values()]:
        assert "real" not in row and row["requests"] == 3 and row["tokens"] == 18 and row["identical_outputs"]
    assert all(row["mean_batch"] == 1.0 for row in slow.values())
    assert slow["pp batched"]["model"]["tbt_p50_ms"] == pytest.approx(4 * 2.1)
    assert slow["spd batched"]["model"] == slow["spd 1-at-a-time"]["model"]
    assert burst["spd batched"]["mean_batch"] > 1.0 and burst["spd 1-at-a-time"]["mean_batch"] == 1.0
    # Queued behind the others, the last requests' first tokens come later one at a time (from their arrival).
    assert burst["spd 1-at-a-time"]["model"]["ttft_p50_ms"] > burst["spd batched"]["model"]["ttft_p50_ms"]
    for row in closed:
        assert row["requests"] == 2 * row["clients"] and row["tokens"] == 12 * row["clients"]
        assert row["identical_outputs"]  # greedy: every system gives every prompt the same tokens
        assert row["model"]["tokens_per_s"] > 0 and row["real"]["tokens_per_s"] > 0
        # A step's wall time splits into the stage calls and the driver's own work, both there, adding up.
        per_step_ms = 1000 * row["real"]["total_s"] / row["steps"]
        assert row["stage_ms_per_step"] > 0 and row["own_ms_per_step"] > 0
        assert row["stage_ms_per_step"] + row["own_ms_per_step"] == pytest.approx(
            per_step_ms, abs=0.5 / row["steps"] + 0.01
        )
        # Of the own work, what ran while the stage calls were out (the proposers); the CPU of this one process (no
        # stage processes in one process), at most the machine's cores over the wall time.
        assert 0 <= row["overlap_ms_per_step"] <= row["own_ms_per_step"]
        assert row["cpu_ms_per_step"]["driver"] > 0 and row["cpu_ms_per_step"]["stages"] == []
        assert 0 < row["cores_busy"] <= os.cpu_count() + 0.1
    assert "cpu/step" in proc.stdout
    pp_one = next(r for r in results["rows"] if r["clients"] == 1 and r["system"] == "pp batched")
    # One pp request at a time: each token's step holds one token per busy stage, a step costs a + b = 2.1 ms, and
    # a token needs n = 4 steps after the first.
    assert pp_one["model"]["tbt_p50_ms"] == pytest.approx(4 * 2.1) == pytest.approx(pp_one["model"]["tbt_mean_ms"])
    assert pp_one["model"]["tbt_request_p99_ms"] == pytest.approx(4 * 2.1)  # every request's own gaps the same
    assert "req p99" in proc.stdout
    # The head's own trees: the same tokens as pp.
    assert "identical outputs across the systems: True" in head_tree.stdout
    head_tree_results = json.loads(head_tree_out.read_text())
    assert head_tree_results["systems"] == ["tree batched", "pp batched"]
    assert (head_tree_results["tree_width"], head_tree_results["tree_max_width"]) == ("auto", 2)
    assert all(r["tokens"] == 36 and r["identical_outputs"] for r in head_tree_results["rows"])
    draft = str(tiny_testbed / "draft")
    for args in (
        ["--speculator", str(tiny_heads[4]), "--stage-ms", "2"],
        ["--draft-model", draft],
        ["--speculator", str(tiny_heads[4]), "--rates", "0"],
        ["--speculator", str(tiny_heads[4]), "--new-tokens-jitter", "48"],
        ["--speculator", str(tiny_heads[4]), "--tree-width", "0"],
        ["--speculator", str(tiny_heads[4]), "--tree-nodes", "8"],
    ):
        bad = run_main(bench_batch_main, *args)  # refused before anything runs
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error:"), bad.stderr
