"""Many requests in one pipeline: dynamic batching over the step loop (docs/method.md §9; SpecPipe-DB).

Each request runs the one step loop (:meth:`spd.decoding.loop.StepLoop.steps`, a generator) with its own proposer,
tree, width policy, sampling parameters and seed, and its own stage caches: a region of a shared
:class:`~spd.target.kv_pool.KVPool`. The loop hands its stage work to a driver instead of running it;
:class:`BatchedPipeline` is the driver of many. One pipeline **step** of the batch:

1. Admission (at the step boundary): queued requests join, first come first served, while fewer than ``max_batch``
   are in flight and the pool has a region as long as the request's longest possible sequence (the KV memory
   bound); a request that waits is never dropped. A request the pool could never hold fails with one error.
2. Every stage runs, as one ragged batch (:func:`spd.target.ragged.run_ragged`), the work at that stage of every
   request: the levels in flight of the running requests (a chain's token, a tree level) and the chunks of the
   newcomers' prompts in flight. The work is started first; the running requests' proposers then make their next
   levels while the stages compute (on the distributed runtime they do so at the same time), all in one call where they
   share a head (:func:`spd.decoding.proposers.propose_many`: one batched query of the SPD head over every
   request's path), and the outputs are collected after that. Prompts enter the pipeline ``prefill_chunk`` tokens
   per step in all, the oldest newcomer's first (the rest of the budget goes to the next), and flow stage by stage
   like the levels, so newcomers never stall the requests in flight for their whole prompts (chunked, pipelined
   prefill), and however many arrive at once, no stage call carries more than ``prefill_chunk`` prompt tokens (a
   step is as long as its longest stage call, and every request in flight waits for it). With a step token budget
   (``step_tokens``) the prompts take only what the levels in flight leave of it, so that a step carrying a prompt
   is no longer than one carrying a full batch's levels: this bounds the time between tokens of the requests in
   flight, above all the ``n`` steps a request waits after a miss (docs/benchmarks.md measures it). A chunk stays
   in a step's calls for ``n`` steps, one stage each: with ``spread_prefill`` a prompt goes in ``n`` equal chunks,
   so that each of those steps carries ``1/n`` of it instead of one step carrying all of it at every stage. A
   newcomer's first token comes when its last chunk leaves stage ``n``.
3. Each running request verifies and prunes or flushes on its own (its rejection touches only its own region);
   the target's logits its verification reads come from one LM-head call for every request whose root level
   left stage ``n``.
   A request whose root level left stage ``n`` this step had its other levels run in the same stage calls, before
   the verification (the single-request loop runs them after it): the verification prunes their outputs and KV
   rows (a hit) or drops them (a miss), exactly as it does for the levels that ran in earlier steps. So every
   stage runs once per step. (A node's result does not depend on its siblings, so running a level before or
   after the pruning of its siblings gives the same values.)
4. Finished requests (EOS, budget, a stop string, a cancel) leave and give their region back; a request whose own
   work raises (its admission, its proposer, its verification) fails alone, the others go on; a joint call that
   raises is asked again request by request. A stage call that raises fails the requests in flight, all of which
   were in it: each gives its region back, the step raises, and the batch takes new requests.

A batch of one runs exactly the single-request engine's loop; the ragged call of one segment is the stage call of
one request (a tree level that runs before its verification runs unpruned: the same values up to fp32's last
bits). With several requests the matrix products have other shapes, so fp32 results may differ from a solo run in
the last bits: greedy output equals the request's solo output except where the solo run's top-two logits are that
close (``tests/test_batch.py`` reports every such case).

Each request keeps the proposer it was given when submitted (a copy of the engine's), so a head swapped into the
engine (:meth:`~spd.decoding.engine.Engine.use_proposer`, a server's new head version) proposes for the requests
submitted after it, while those before finish on theirs: the batch runs both heads for a while, each asked in its own
joint call (their ``batch_key`` differs) with its own memory pool, which goes once its last request has left.

The stages run in this process (:class:`~spd.decoding.backend.LocalBatch`: the pool and
:func:`~spd.target.ragged.run_ragged`) or, when the engine's stages are the distributed runtime's, on the stage ranks
(:class:`spd.runtime.batch.RemoteBatch`: the same ragged calls, carried stage to stage); this driver is the same for
both.

On hybrid targets each request's stage caches carry its own linear-attention state beside its region, and a ragged
call runs the linear-attention layers over the requests' stacked states (:mod:`spd.target.ragged`). A draft model
proposes for every request in one ragged call too: its KV lives in a pool of its own, each request at the same rows
as in the target's pool. Every head is asked for every request in one call: our SPD heads, our output-state and PPSD
heads (whose query comes after the stages ran: it is asked with the verifications' logits) and the SPD authors' heads
(their tower over each request's rows, :meth:`~spd.heads.published.authors_head.AuthorsHead.propose_logits_many`).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch

from ..errors import SpdInputError
from ..target.segments import Segment
from ..target.staging import StageOutput
from .backend import BatchBackend, LocalBatch, LocalStages, RemoteStageBackend
from .batch_request import BatchRequest
from .driver import COLLECT, Advance, Propose, TargetLogits, answer_many
from .generation import GenerationOutput, OnToken
from .loop import anchors_by_stage
from .proposers import PooledProposer, Proposer
from .sampling import SamplingParams
from .tree_width import SharedWidth

DEFAULT_ROWS_PER_REQUEST = 2048  # the pool's default size: this many rows per request of max_batch
DEFAULT_PREFILL_CHUNK = 64  # prompt tokens that enter the pipeline per step, all newcomers together


def full_batch_width(max_width: int, max_batch: int, tree_nodes: int | None) -> int:
    """The widest level a request grows at a full batch: its policy's ``max_width``, or under a node budget its share
    of ``tree_nodes`` (at least 1)."""
    return max_width if tree_nodes is None else min(max_width, max(1, tree_nodes // max_batch))


def check_step_tokens(step_tokens: int | None, max_batch: int, max_width: int) -> None:
    """A stage call's token budget must leave room for prompts at a full batch (``max_batch`` requests with a level
    of up to ``max_width`` tokens each at every stage), or newcomers could not enter until requests leave."""
    levels = max_batch * max_width
    if step_tokens is not None and (not isinstance(step_tokens, int) or step_tokens <= levels):
        raise SpdInputError(
            f"the step token budget (--step-tokens) must be above the {levels} tokens of levels a "
            f"stage call carries at a full batch ({max_batch} requests x {max_width}), so that "
            f"prompts still enter; got {step_tokens!r}"
        )


class BatchedPipeline:
    """Runs many requests at once through one engine's staged target (see the module docstring).

    ``engine`` is an :class:`~spd.decoding.engine.Engine` (a chain: modes ``spd`` and ``pp``; a tree: ``tree``)
    whose stages run in this process. ``kv_rows`` is the
    pool's size in rows (default ``max_batch * 2048``); ``prefill_chunk`` how many prompt tokens enter per step, all
    newcomers together; ``step_tokens`` (optional) a stage call's token budget: the prompt tokens entering a step
    are at most what the levels in flight leave of it (the busiest stage's), so that a step that carries a prompt
    is no longer than a full one (vLLM's ``max_num_batched_tokens``, for a pipeline); ``spread_prefill`` sends each
    prompt in ``n`` equal chunks (at most ``prefill_chunk`` tokens each), so that every stage call carries ``1/n``
    of it: shorter steps for the requests in flight, ``n - 1`` more steps to the newcomer's first token.
    ``tree_nodes`` (optional, token trees) a node budget per level across the batch: each request's tree is at most
    ``tree_nodes // requests in flight`` wide (at least 1), so the trees narrow as the batch grows and a stage
    call carries about ``tree_nodes`` tree nodes however many requests are in flight
    (:class:`~spd.decoding.tree_width.SharedWidth`).
    """

    def __init__(
        self,
        engine,
        max_batch: int = 8,
        kv_rows: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        step_tokens: int | None = None,
        spread_prefill: bool = False,
        tree_nodes: int | None = None,
    ):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpdInputError(f"the batch size must be a positive integer, got {max_batch!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise SpdInputError(f"the prefill chunk must be a positive number of tokens, got {prefill_chunk!r}")
        max_width = engine.loop.policy.max_width
        if tree_nodes is not None:
            if max_width == 1:
                raise SpdInputError(
                    "a node budget (tree_nodes, --tree-nodes) narrows token trees, but this engine "
                    "proposes chains (width 1); use it with --mode tree"
                )
            if not isinstance(tree_nodes, int) or tree_nodes < max_batch:
                raise SpdInputError(
                    f"the node budget must be at least the batch size ({max_batch}: one node per "
                    f"request and level), got {tree_nodes!r}"
                )
        check_step_tokens(step_tokens, max_batch, full_batch_width(max_width, max_batch, tree_nodes))
        self.engine, self.staged, self.loop = engine, engine.staged, engine.loop
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.step_tokens, self.spread_prefill, self.tree_nodes = step_tokens, spread_prefill, tree_nodes
        rows = kv_rows if kv_rows is not None else max_batch * DEFAULT_ROWS_PER_REQUEST
        # Stages in this process, or the distributed runtime's (spd.runtime.remote.RemoteStages.batch_backend).
        self.backend: BatchBackend = (
            LocalBatch(self.staged, rows)
            if isinstance(engine.backend, LocalStages)
            else cast(RemoteStageBackend, engine.backend).batch_backend(rows)  # the other back-end: the runtime's
        )
        self.pool = self.backend.pool
        # The proposers' pools: a draft model's KV (each request's region at the same rows as in self.pool), or an SPD
        # head's memory (a slot per request). One per engine proposer the requests in flight were copied from: a head
        # swapped in (Engine.use_proposer) serves new requests while the ones in flight finish on theirs.
        self.proposer_pools: dict[int, tuple[Proposer | None, object]] = {}  # id(source) -> (source, pool)
        self.queue: deque[BatchRequest] = deque()
        self.active: list[BatchRequest] = []
        self.steps = 0  # pipeline steps run
        self.batch_sizes: list[int] = []  # requests in flight at each step
        self.kv_waits = 0  # admissions put off because the pool had no region long enough
        self.stage_tokens: list[list[int]] = []  # per step, the tokens each stage ran (levels, prompt chunks)
        # Seconds in the stage back-end (starting the stage calls and taking their outputs): in one process the
        # stage calls themselves, over the runtime sending to and waiting for the stages. The rest of a step is
        # this driver's own work (rank 0's): admission, proposers, verification, bookkeeping.
        self.stage_s = 0.0
        # Of the driver's own work, the seconds between starting a step's stage calls and taking their outputs: the
        # proposers (over the runtime the stages compute meanwhile; the rest of its work waits on or for them).
        self.overlap_s = 0.0
        self._ids = itertools.count()

    # ------------------------------------------------------------------------------------- public
    def submit(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        eos_token_id: int | Sequence[int] | None = None,
        on_token: OnToken | None = None,
        mode: str | None = None,
        on_done: Callable[[BatchRequest], None] | None = None,
    ) -> BatchRequest:
        """Queue a request (token ids; no EOS unless given). ``mode``: ``spd`` or ``pp`` on a chain engine (default:
        the engine's mode: spd with a head, pp without), ``tree`` on a tree engine. Bad input raises here, with one
        line; the request then never joins. ``on_token(token, accepted)`` is called for each committed token and may
        return True to end it; ``on_done(request)`` when it ends."""
        use_head = self._use_head(mode)
        proposer, stats = self.engine.request_parts(use_head)
        backend = self.backend.request_stages()
        request = BatchRequest(next(self._ids), None, backend, on_done)

        def tokens(token: int, accepted: bool) -> bool:
            stop = bool(on_token(token, accepted)) if on_token is not None else False
            return stop or request.cancelled

        # Each request has its own proposer state and width policy (the head's weights are shared).
        request.proposer = copy.copy(proposer) if proposer is not None else None
        request.source = proposer
        width = copy.deepcopy(self.loop.policy)
        request.width = SharedWidth(width) if self.tree_nodes is not None else width
        steps = self.loop.steps(
            request.proposer,
            input_ids,
            max_new_tokens,
            sampling,
            eos_token_id,
            tokens,
            stats,
            backend=backend,
            policy=request.width,
        )
        request.steps = steps
        request.work = next(steps)  # validates the request and asks for its prefill
        if request.prefill.capacity > self.pool.rows:
            steps.close()
            raise SpdInputError(
                f"this request needs {request.prefill.capacity} KV rows (prompt, budget and the tree in "
                f"flight), but the pool holds {self.pool.rows}; shorten it or give the pool more rows"
            )
        self.queue.append(request)
        return request

    @property
    def proposer_pool(self):
        """The pool of the requests proposed by the engine's current proposer (None before the first is admitted)."""
        entry = self.proposer_pools.get(id(self.engine.proposer))
        return entry[1] if entry is not None else None

    @property
    def busy(self) -> bool:
        """Requests are queued or in flight."""
        return bool(self.queue or self.active)

    @torch.inference_mode()
    def step(self) -> None:
        """One pipeline step of every request in flight (see the module docstring)."""
        self._admit()
        if not self.active:
            self.backend.idle()
            return
        self.backend.new_step()
        if self.tree_nodes is not None:  # every request's share of the node budget, for the levels grown this step
            for request in self.active:
                assert isinstance(request.width, SharedWidth)  # submit gives each request one under a node budget
                request.width.cap = max(1, self.tree_nodes // len(self.active))
        self.steps += 1
        self.batch_sizes.append(len(self.active))
        self.stage_tokens.append([0] * self.staged.n_stages)
        # 2. Every stage's work of every request, one ragged call per stage.
        advancing = [r for r in self.active if r.state == "running"]
        prefilling = [r for r in self.active if r.state == "prefill"]
        try:
            self._run_stages(advancing, prefilling)
        except Exception as exc:
            # Every request in flight was in the calls and its caches are part-way through them: each fails with the
            # error and gives its region back, and the batch takes new requests (the caller decides whether the
            # error ends everything, as a lost stage does).
            self._fail(advancing + prefilling, exc)
            self._leave()
            raise
        for request in [r for r in self.active if r.state == "prefill"]:
            self._prefill_progress(request)
        # 3. The levels that move after a verification ran with the others: their second advance is done.
        for request in self.active:
            if request.state == "running" and isinstance(request.work, Advance) and request.work.after_verify:
                if any(not any(level is ran for ran in request.ran_ahead) for level in request.work.levels):
                    raise RuntimeError("a level moved after the verification without running in the step's stage calls")
                self._resume(request, None, ask=False)  # its outputs are in: up to COLLECT,
                if request.work is COLLECT:
                    self._resume(request, None, ask=False)  # then on to its next step's work
        self._answer([r for r in self.active if isinstance(r.work, Propose)])  # an output-state head's query
        self._leave()
        if not self.busy:
            self.backend.idle()

    def run(self) -> None:
        """Step until every request has ended."""
        while self.busy:
            self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        eos_token_id: int | Sequence[int] | None = None,
        mode: str | None = None,
    ) -> list[GenerationOutput]:
        """Every prompt as a request of this batch (one sampling setting, or one per prompt); their outputs (with
        ``.text`` where the engine has a tokenizer)."""
        settings = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        requests = [self.submit(p, max_new_tokens, s, eos_token_id, mode=mode) for p, s in zip(prompts, settings)]
        self.run()
        for request in requests:
            if request.error is not None:
                raise request.error
        outs: list[GenerationOutput] = []
        for request in requests:
            assert request.output is not None  # every request ran to its end and none failed
            outs.append(request.output)
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            for out in outs:
                out.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return outs

    # ------------------------------------------------------------------------------------ pieces
    def _use_head(self, mode: str | None) -> bool:
        modes = ("tree",) if self.engine.mode == "tree" else ("spd", "pp")
        mode = mode or self.engine.mode  # the engine's own: spd with a head, pp without
        if mode not in modes:
            raise SpdInputError(f"this batched pipeline runs mode {' or '.join(modes)}, not '{mode}'")
        return mode != "pp"

    def _admit(self) -> None:
        """Queued requests join while the batch and the pool have room (first come, first served)."""
        while self.queue and len(self.active) < self.max_batch:
            request = self.queue[0]
            if request.cancelled:
                self.queue.popleft()
                request.steps.close()
                self._end(request, "cancelled")
                continue
            region = self.pool.allocate(request.prefill.capacity)
            if region is None:
                self.kv_waits += 1
                return  # it waits for a region (the KV memory bound)
            self.queue.popleft()
            request.region = region
            try:
                request.backend.caches = self.backend.open(region)
                if request.proposer is not None and request.proposer.pooled:
                    # Its proposer's cache in a pool of the batch's (given back at the end): a draft model's KV at
                    # the same rows, a head's a slot.
                    pooled = cast(PooledProposer, request.proposer)  # what ``pooled`` declares
                    entry = self.proposer_pools.get(id(request.source))
                    if entry is None:
                        entry = (request.source, pooled.new_pool(self.pool.rows, self.max_batch))
                        self.proposer_pools[id(request.source)] = entry
                    pooled.use_pool(entry[1], region)
            except Exception as exc:  # this request's own failure: its region goes back, the others go on
                self._fail([request], exc)
                continue
            request.prefill_stage_anchors = anchors_by_stage(self.staged.boundaries, request.prefill.anchors)
            request.state = "prefill"
            self.active.append(request)

    def _run_stages(self, running: list[BatchRequest], prefilling: list[BatchRequest]) -> None:
        """Each stage once over every listed request's work at that stage (levels in flight and prompt chunks): the
        work starts, the running requests go on to the point where they need its outputs (the proposer's step),
        the outputs are taken, and the requests go on with them (verification, up to their next advance)."""
        n = self.staged.n_stages
        calls: list[list[tuple[Segment, Callable[[StageOutput], None]]]] = [[] for _ in range(n)]
        for request in running:
            work = request.work
            assert isinstance(work, Advance)  # a running request starts its step at its advance
            for level in work.levels + work.then:  # the levels that move after its verification run now too
                calls[level.depth].append(
                    (request.backend.segment(level, work.tree, work.committed), partial(request.backend.took, level))
                )
            request.ran_ahead = list(work.then)
        budget = self.prefill_chunk  # the prompt tokens that enter stage 1 this step, oldest newcomer first
        if self.step_tokens is not None:  # what the levels in flight leave of a stage call's budget
            budget = min(budget, self.step_tokens - max(sum(segment.size for segment, _ in call) for call in calls))
        for request in prefilling:
            budget -= request.next_chunk(budget, self.staged, self.spread_prefill)
            for chunk in request.chunks:
                s = chunk.depth
                calls[s].append(
                    (
                        Segment(request.backend.caches[s], chunk.hidden_1TD, anchors=request.prefill_stage_anchors[s]),
                        chunk.took,
                    )
                )
        for stage, call in enumerate(calls):  # every piece of work was taken before any ran: one stage each
            self.stage_tokens[-1][stage] += sum(segment.size for segment, _ in call)
        tick = time.perf_counter()
        started = self.backend.start([[segment for segment, _ in call] for call in calls])
        started_at = time.perf_counter()
        self.stage_s += started_at - tick
        for request in running:
            self._resume(request, None, ask=False)  # up to its proposer's query: asked below, while the stages compute
        self._answer([r for r in running if isinstance(r.work, Propose)])  # then each goes on up to COLLECT
        tick = time.perf_counter()
        self.overlap_s += tick - started_at
        outputs = self.backend.finish(started)
        self.stage_s += time.perf_counter() - tick
        for call, outs in zip(calls, outputs):
            for (_, took), out in zip(call, outs):
                took(out)
        for request in running:
            if request.work is COLLECT:
                self._resume(request, None, ask=False)  # up to its verification's logits, if its root left stage n
        # One LM-head call, then verify; an output-state head's query (after the stages) is asked here too.
        self._answer([r for r in running if isinstance(r.work, (Propose, TargetLogits))])

    def _prefill_progress(self, request: BatchRequest) -> None:
        """Chunks that left stage n are done; after the last one the request gets its prefill's output."""
        n, total = self.staged.n_stages, request.prefill.ids_1T.shape[1]
        while request.chunks and request.chunks[0].depth == n:
            chunk = request.chunks.pop(0)
            for index, hidden_1TD in chunk.anchors.items():
                request.prefill_anchors.setdefault(index, []).append(hidden_1TD)
            if chunk.end == total:  # H^L of the prompt's last chunk (the first token reads its last row)
                anchors = {a: torch.cat(parts, dim=1) for a, parts in request.prefill_anchors.items()}
                request.prefill_anchors = {}
                request.state = "running"
                self._resume(request, StageOutput(chunk.hidden_1TD, anchors))

    def _answer(self, requests: list[BatchRequest]) -> None:
        """Answer the questions ``requests`` stopped at together (:func:`~spd.decoding.driver.answer_many`: the
        proposers' queries, the verifications' logits) and resume each with its answer, up to its next work; those
        that ask again (an output-state head's query right after a verification) are answered together again. If a
        joint call fails, each is asked alone, so a request's own failure stays its own."""
        while requests:
            asked = [request.work for request in requests if isinstance(request.work, (Propose, TargetLogits))]
            assert len(asked) == len(requests)  # every request stopped at a question
            try:
                answers = answer_many(asked) if len(requests) > 1 else None
            except Exception:
                answers = None
            for i, request in enumerate(requests):
                if answers is not None:
                    self._resume(request, answers[i], ask=False)
                    continue
                try:
                    answer = asked[i].answer()
                except Exception as exc:
                    request.error = exc
                    self._end(request, "failed")
                    continue
                self._resume(request, answer, ask=False)
            requests = [r for r in requests if isinstance(r.work, (Propose, TargetLogits))]

    def _resume(self, request: BatchRequest, value, ask: bool = True) -> None:
        """Hand the request its work's result; it runs to its next work item, or ends. Its questions
        (:class:`~spd.decoding.driver.Propose`, :class:`~spd.decoding.driver.TargetLogits`) are answered on the way
        (``ask``), or left as its work for :meth:`_answer`."""
        try:
            request.work = request.steps.send(value)
            while ask and isinstance(request.work, (Propose, TargetLogits)):
                request.work = request.steps.send(request.work.answer())
        except StopIteration as done:
            request.output = done.value
            self._end(request, "done")
        except Exception as exc:  # this request's own failure: the others go on
            request.error = exc
            self._end(request, "failed")

    def _fail(self, requests: list[BatchRequest], exc: Exception) -> None:
        """``requests`` fail with ``exc``; a region that cannot be given back (a lost stage) is left behind."""
        for request in requests:
            request.error = exc
            try:
                request.steps.close()  # its loop, stopped where it waited for the stages
                self._end(request, "failed")
            except Exception:  # noqa: BLE001 - the request has failed all the same
                request.region, request.state = None, "failed"

    def _end(self, request: BatchRequest, state: str) -> None:
        request.state = state
        request.work = None
        request.chunks = []
        if request.proposer is not None and request.proposer.pooled:
            cast(PooledProposer, request.proposer).leave_pool()  # what ``pooled`` declares
        if request.region is not None:
            self.backend.release(request.region)
            request.region = None
            request.backend.caches = []
        if request.on_done is not None:
            request.on_done(request)

    def _leave(self) -> None:
        """Finished requests leave; requests cancelled before their first token leave now."""
        for request in self.active:
            if request.state == "prefill" and request.cancelled:
                request.steps.close()
                self._end(request, "cancelled")
        self.active = [r for r in self.active if not r.finished]
        if len(self.proposer_pools) > 1:  # a swapped-out head's pool goes once its last request has left
            used = {id(self.engine.proposer)} | {id(r.source) for r in itertools.chain(self.active, self.queue)}
            self.proposer_pools = {key: entry for key, entry in self.proposer_pools.items() if key in used}
