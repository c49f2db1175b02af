"""The pipeline a server runs every request on: loaded once, in this process or across stage processes.

:class:`Pipeline` owns the engine (chain or tree) and is used from one thread only (the scheduler's). With
``runtime="distributed"`` this process is rank 0 of a ``torch.distributed`` world (embedding, LM head, the
head or draft model, verification) and ``n`` stage processes are started once, each loading only its own
layers (``python -m spd.cli.run_pipeline`` as a stage rank, spd/runtime/); every request is a new epoch on
the same processes (the stages reset their caches at each prefill). With ``local_stages`` K < n, stages
K+1..n run on other machines, which join at ``stage_addr`` with ``spd-stage`` (spd/runtime/join.py,
docs/runtime.md). Between requests the driver pings the stages, whose waits have a timeout. A stage process
that exits makes :meth:`Pipeline.lost` say so; a lost pipeline is not restarted (the stages' process group
cannot be re-formed in this process), the server says it must be restarted. This machine's stage processes
end with the server: each runs in its own session with SIGTERM on the server's death (children.py), and a
server stopped while loading stops the ones it started.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from ..decoding.generation import GenerationOutput, OnToken
from ..decoding.modes import require_pipelined
from ..decoding.sampling import SamplingParams
from ..decoding.spec import DecodingSpec
from ..errors import SpdInputError, first_line
from ..runtime.children import end_child, start_child


@dataclass
class PipelineSpec(DecodingSpec):
    """What to serve: the decoding settings (spd-generate's flags), and where the stages run."""

    emulate_token_ms: float = 0.0  # distributed: and per token of a stage call
    local_stages: int | None = None  # distributed: stages run on this machine (default: all); the rest join
    stage_addr: str | None = None  # distributed: HOST[:PORT] on the stage network where the other machines join
    join_timeout_s: float = 600.0  # distributed: how long the stages may take to load and join


def check_batching(max_batch: int, runtime: str, mode: str) -> None:
    """Refuse a batched server (``--max-batch`` above 1) where batching does not run: a mode without a pipeline step
    loop. (Both runtimes batch: the stages in this process, or the distributed runtime's.)"""
    if max_batch > 1:
        require_pipelined(mode, "--max-batch above 1 batches")


class Pipeline:
    """A loaded engine and its tokenizer; ``generate`` runs one request (one thread at a time)."""

    def __init__(self, spec: PipelineSpec, engine, staged, tokenizer, n_stages: int, remote=None, procs=()):
        self.spec, self.engine, self.staged, self.tokenizer = spec, engine, staged, tokenizer
        self.n_stages = n_stages
        self.remote, self.procs = remote, list(procs)
        self._lost: str | None = None

    @property
    def max_positions(self) -> int | None:
        return self.staged.max_positions

    @property
    def vocab_size(self) -> int:
        return self.staged.vocab_size

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        on_token: OnToken,
        sampling: SamplingParams = SamplingParams(),
        ignore_eos: bool = False,
    ) -> GenerationOutput:
        """One request on the pipeline; EOS as ``model.generate`` (the target's generation config), or none
        with ``ignore_eos``."""
        from ..runtime.protocol import PipelineLost

        try:
            return self.engine.generate(
                prompt_ids,
                max_new_tokens,
                mode=self.spec.mode,
                on_token=on_token,
                eos_token_id=[] if ignore_eos else None,
                sampling=sampling,
            )
        except PipelineLost as exc:
            self._lost = _exited(self.procs) or str(exc)  # a stage that exited is the cause, not its neighbour
            raise

    def batched(self, max_batch: int, kv_rows: int | None = None, **options):
        """A batched pipeline over this engine (``--max-batch``): modes spd, pp and tree, either runtime; ``options``:
        how prompts enter (:func:`spd.cli.batch_flags.prefill_options`)."""
        from ..decoding.batch import BatchedPipeline

        check_batching(max_batch, self.spec.runtime, self.spec.mode)
        return BatchedPipeline(self.engine, max_batch, kv_rows, **options)

    def step(self, batch) -> None:
        """One step of ``batch``; a lost stage is remembered as :meth:`generate` remembers it."""
        from ..runtime.protocol import PipelineLost

        try:
            batch.step()
        except PipelineLost as exc:
            self._lost = _exited(self.procs) or str(exc)
            raise

    def submit(
        self,
        batch,
        prompt_ids: list[int],
        max_new_tokens: int,
        on_token: OnToken,
        on_done,
        sampling: SamplingParams = SamplingParams(),
        ignore_eos: bool = False,
    ):
        """Queue one request on ``batch`` (see :meth:`generate` for the settings); ``on_done(request)`` when it ends."""
        from ..decoding.request import prepare_prompt

        _, eos = prepare_prompt(self.tokenizer, prompt_ids, [] if ignore_eos else None, self.staged.model)
        return batch.submit(
            prompt_ids,
            max_new_tokens,
            sampling,
            eos,
            on_token,
            self.spec.mode,
            on_done,
        )

    def lost(self) -> str | None:
        """Why the pipeline cannot serve any more (a stage process exited or stopped answering), or None."""
        if self._lost is None:
            self._lost = _exited(self.procs)
        return self._lost

    def idle(self) -> None:
        """Called between requests: keep the stage processes' waits from timing out."""
        if self.remote is not None and self.lost() is None:
            self.remote.ping()

    def close(self) -> None:
        """Stop this machine's stage processes (STOP down the chain, then wait; kill what does not exit); the other
        machines' stages end on the STOP too, or by their timeout when the pipeline is lost."""
        if self.remote is None:
            return
        import torch.distributed as dist

        lost = self.lost() is not None
        if not lost:
            try:
                self.remote.shutdown()
            except Exception:  # noqa: BLE001 - a stage died while stopping: killed below
                pass
        for proc in self.procs:
            try:
                # (a lost pipeline's stages would only wait for their timeout: stopped at once)
                proc.wait(timeout=0 if lost else 10)
            except subprocess.TimeoutExpired:
                end_child(proc, grace_s=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def open_pipeline(spec: PipelineSpec) -> Pipeline:
    """Load the target, the head or draft model and the engine; start the stage processes if distributed."""
    from ..decoding.factory import load_pipeline
    from ..decoding.loader import resolve_cut
    from ..target.tokenizer import load_target_tokenizer

    decoding = DecodingSpec.of(spec)
    cut = resolve_cut(decoding)  # the sources, the cut and the head's fit, before anything loads
    tokenizer = load_target_tokenizer(spec.target, spec.revision, spec.tokenizer)
    if tokenizer is None:
        raise SpdInputError(
            f"the target '{spec.target}' has no tokenizer, and a server answers in text; pass --tokenizer DIR_OR_ID"
        )
    if spec.runtime == "distributed":
        return _open_distributed(spec, cut, tokenizer)
    parts = load_pipeline(decoding, tokenizer, cut)
    return Pipeline(spec, parts.engine, parts.staged, tokenizer, cut.n_stages)


def _open_distributed(spec: PipelineSpec, cut, tokenizer) -> Pipeline:
    """Rank 0 here, the stage processes of this machine spawned now, the other machines' stages awaited at
    ``--stage-addr`` (spd/runtime/join.py); a 2-token warm-up request proves the pipeline works."""
    from ..decoding.factory import build_engine
    from ..decoding.loader import load_parts
    from ..runtime.loading import load_partial
    from ..target.loading import check_device

    n = cut.n_stages
    local, host, port, interface = _stage_network(spec, n)
    backend = "nccl" if check_device(spec.device).type == "cuda" else "gloo"
    config = _runtime_config(spec, backend)
    # Rank 0's part, the head and the draft model load (and fail with one line) before any process starts.
    dtype = getattr(torch, spec.dtype)
    decoding = DecodingSpec.of(spec)
    staged = load_partial(spec.target, n, 0, spec.revision, dtype, spec.device, cut.boundaries)
    parts = load_parts(decoding, tokenizer, cut, staged)
    job = _stage_job(spec, n, list(staged.boundaries), local, backend)
    store, timeout = _publish(spec, job, (host, port), interface)

    def pipeline_over(control, procs) -> Pipeline:
        """Rank 0's pipeline over the joined stages, once they are proved to run this very job."""
        from ..runtime.handshake import check_same_job, job_identity
        from ..runtime.remote import RemoteStages

        check_same_job(job_identity(spec.target, spec.revision, staged, dtype, config), control)
        remote = RemoteStages(staged, config, control)
        engine = build_engine(decoding, staged, parts.head, tokenizer, parts.draft, remote)
        return Pipeline(spec, engine, staged, tokenizer, n, remote, procs)

    return _start_stages(spec, job, store, (host, port), local, timeout, pipeline_over)


def _runtime_config(spec: PipelineSpec, backend: str):
    """Rank 0's runtime settings (a :class:`~spd.runtime.protocol.RuntimeConfig`)."""
    from ..runtime.protocol import RuntimeConfig

    return RuntimeConfig(
        backend=backend,
        timeout_s=spec.timeout_s,
        emulate_stage_ms=spec.emulate_stage_ms,
        emulate_token_ms=spec.emulate_token_ms,
        emulate_link_ms=spec.emulate_link_ms,
        join_timeout_s=spec.join_timeout_s,
    )


def _stage_job(spec: PipelineSpec, n: int, boundaries: list[int], local: int, backend: str):
    """The job the ``n`` stages run (a :class:`~spd.runtime.join.StageJob`): stages after ``local`` join from other
    machines."""
    from ..runtime.join import StageJob

    return StageJob(
        stages=n,
        boundaries=boundaries,
        remote=list(range(local + 1, n + 1)),
        dtype=spec.dtype,
        backend=backend,
        timeout_s=spec.timeout_s,
        emulate_stage_ms=spec.emulate_stage_ms,
        emulate_token_ms=spec.emulate_token_ms,
        emulate_link_ms=spec.emulate_link_ms,
    )


def _publish(spec: PipelineSpec, job, address: tuple[str, int], interface: str | None):
    """Publish ``job`` on a store listening at ``address`` (the stage address only; the other machines read the job
    from it) and say which stages are awaited there; returns the store and the join timeout."""
    from ..runtime.join import publish_job
    from ..runtime.world import bound_store

    host, port = address
    # gloo (rank 0 and this machine's stages) on the stage network's interface, unless the user chose one.
    if interface is not None and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeout = datetime.timedelta(seconds=max(spec.timeout_s, spec.join_timeout_s))
    store = bound_store(host, port, job.stages + 1, timeout, wait_for_workers=False)
    publish_job(store, job)
    if job.remote:
        print(
            f"[spd-serve] waiting up to {spec.join_timeout_s:g} s for {_stage_list(job.remote)} to join at "
            f"{host}:{port}: run 'spd-stage --server {host}:{port} --target DIR' on their machine(s)",
            file=sys.stderr,
            flush=True,
        )
    return store, timeout


def _stage_network(spec: PipelineSpec, n: int) -> tuple[int, str, int, str | None]:
    """How many stages run on this machine, and the address (host, port) and network interface the stages meet
    on: ``--stage-addr``'s when other machines join, else a free loopback port. Wrong settings are one error."""
    from ..runtime.join import parse_address
    from ..runtime.world import free_port, is_loopback, loopback_interface, route_interface

    require_pipelined(spec.mode, "--runtime distributed runs")
    local = n if spec.local_stages is None else spec.local_stages
    if not 0 <= local <= n:
        raise SpdInputError(f"--local-stages must be in 0..{n} (the pipeline has {n} stages), got {local}")
    if local < n and spec.stage_addr is None:
        raise SpdInputError(
            f"stages {local + 1}..{n} run on other machines, which join at this machine's address "
            "on the stage network: pass --stage-addr ADDR[:PORT]"
        )
    if spec.stage_addr is None:
        return local, "127.0.0.1", free_port(), loopback_interface()
    host, port = parse_address(spec.stage_addr)
    if is_loopback(host):
        raise SpdInputError(
            f"--stage-addr {spec.stage_addr} is a loopback address, which the other machines "
            "cannot reach; give this machine's address on the stage network"
        )
    return local, host, port, route_interface(host)


def _start_stages(spec: PipelineSpec, job, store, address: tuple[str, int], local: int, timeout, pipeline_over):
    """Spawn this machine's stage processes (ranks 1..``local``), wait for every stage to join, build the pipeline
    with ``pipeline_over(control, procs)`` and prove it with a 2-token request. A stage that dies or never joins is
    one error, and no stage process outlives a failed start."""
    from ..runtime.protocol import PipelineLost

    host, port = address
    n = job.stages
    cmd = job.stage_command(spec.target, spec.revision)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    procs: list[subprocess.Popen] = []
    try:
        for r in range(1, local + 1):
            procs.append(
                start_child(
                    cmd,
                    env=job.stage_env(host, port, r, r, local + 1, env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            )
        control = _join(procs, store, n, job.backend, timeout, spec.join_timeout_s)
        pipeline = pipeline_over(control, procs)
        pipeline.generate([0], 2, lambda token, accepted: None)
        return pipeline
    except (PipelineLost, RuntimeError) as exc:
        lost = _exited(procs)
        for proc in procs:
            end_child(proc, grace_s=0)
        if lost is None and job.remote and isinstance(exc, _JoinTimeout):
            raise SpdInputError(
                f"{_stage_list(job.remote)} did not join at {host}:{port} within "
                f"{spec.join_timeout_s:g} s; run 'spd-stage --server {host}:{port} --target DIR' on "
                "their machine(s)"
            ) from None
        raise SpdInputError(f"the stage processes did not start: {lost or first_line(exc)}") from None
    except BaseException:  # SIGTERM (SystemExit) or Ctrl-C while loading: no stage process outlives the server
        for proc in procs:
            end_child(proc, grace_s=2)
        raise


def _stage_list(stages: list[int]) -> str:
    """ "stage 2", "stages 3 and 4", "stages 3..6"."""
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return f"stages {stages[0]}..{stages[-1]}" if len(stages) > 2 else f"stages {stages[0]} and {stages[1]}"


def _exited(procs) -> str | None:
    for rank, proc in enumerate(procs, start=1):
        if proc.poll() is not None:
            return f"the stage process of rank {rank} exited with status {proc.returncode}"
    return None


class _JoinTimeout(RuntimeError):
    """The world was not complete within the join timeout."""


def _join(procs, store, n: int, backend: str, timeout: datetime.timedelta, deadline_s: float):
    """Join the world as rank 0 through ``store`` while the stage processes load, for at most ``deadline_s``;
    fail at once if one of this machine's exits."""
    import threading
    import time

    import torch.distributed as dist

    result: dict = {}

    def join():
        try:
            dist.init_process_group(
                backend, store=dist.PrefixStore("default_pg", store), rank=0, world_size=n + 1, timeout=timeout
            )
            result["control"] = dist.new_group(backend="gloo", timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - reported below as one line
            result["error"] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    deadline = time.monotonic() + deadline_s
    while thread.is_alive():
        thread.join(timeout=0.2)
        if thread.is_alive() and _exited(procs):
            raise RuntimeError(_exited(procs) + " while loading (its error is above)")
        if thread.is_alive() and time.monotonic() > deadline:
            raise _JoinTimeout(f"the stages did not join within {deadline_s:g} s")
    if "error" in result:
        raise RuntimeError(first_line(result["error"]))
    return result["control"]
