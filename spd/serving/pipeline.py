"""The pipeline a server runs every request on: loaded once, in this process or across stage processes.

:class:`Pipeline` owns the engine (chain or tree) and is used from one thread only (the scheduler's). With
``runtime="distributed"`` this process is rank 0 of a ``torch.distributed`` world (embedding, LM head, the
head or draft model, verification) and ``n`` stage processes are started once, each loading only its own
layers (``python -m spd.cli.run_pipeline`` as a stage rank, spd/runtime/); every request is a new epoch on
the same processes (the stages reset their caches at each prefill). Between requests the driver pings the
stages, whose waits have a timeout. A stage process that exits makes :meth:`Pipeline.lost` say so; a lost
pipeline is not restarted (the stages' process group cannot be re-formed in this process), the server says
it must be restarted. The stage processes end with the server: each runs in its own session with SIGTERM on
the server's death (children.py), and a server stopped while loading stops the ones it started.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from ..errors import SpdInputError, first_line
from ..decoding.generation import GenerationOutput, OnToken
from .children import end_child, start_child


@dataclass
class PipelineSpec:
    """What to serve: the same model flags as spd-generate."""

    target: str
    mode: str = "spd"  # spd, pp, tree, sd or ar
    stages: int | None = None  # default: the head's n, else 1
    boundaries: list[int] | None = None  # an explicit (uneven) cut; default: the head's cut, else an equal one
    revision: str | None = None
    tokenizer: str | None = None  # default: the target's
    speculator: str | None = None
    speculator_revision: str | None = None
    draft_model: str | None = None
    draft_revision: str | None = None
    tree_width: int | str = 4  # or "auto"
    tree_children: int = 4
    tree_max_width: int = 8  # tree_width "auto": the largest width
    tree_candidates: str = "auto"  # at T > 0: "sampled" (auto) or "top-k"
    draft_steps: int = 4  # sd: tokens drafted per target forward, m
    dtype: str = "float32"
    device: str = "cpu"
    runtime: str = "local"  # local or distributed
    emulate_stage_ms: float = 0.0  # distributed: added compute per stage per token
    emulate_link_ms: float = 0.0  # distributed: added latency per message
    timeout_s: float = 60.0  # distributed: a stage silent this long (within a request) is lost


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

    def generate(self, prompt_ids: list[int], max_new_tokens: int, on_token: OnToken, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 ignore_eos: bool = False) -> GenerationOutput:
        """One request on the pipeline; EOS as ``model.generate`` (the target's generation config), or none
        with ``ignore_eos``."""
        from ..runtime.protocol import PipelineLost

        try:
            return self.engine.generate(prompt_ids, max_new_tokens, mode=self.spec.mode, temperature=temperature,
                                        top_k=top_k, top_p=top_p, seed=seed, on_token=on_token,
                                        eos_token_id=[] if ignore_eos else None)
        except PipelineLost as exc:
            self._lost = _exited(self.procs) or str(exc)  # a stage that exited is the cause, not its neighbour
            raise

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
        """Stop the stage processes (STOP down the chain, then wait; kill what does not exit)."""
        if self.remote is None:
            return
        import torch.distributed as dist

        if self.lost() is None:
            try:
                self.remote.shutdown()
            except Exception:  # noqa: BLE001 - a stage died while stopping: killed below
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                end_child(proc, grace_s=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def open_pipeline(spec: PipelineSpec) -> Pipeline:
    """Load the target, the head or draft model and the engine; start the stage processes if distributed."""
    from ..paths import check_model_source
    from ..heads.published.authors_file import is_authors_file
    from ..heads.loading import load_speculator, pipeline_cut, speculator_stages
    from ..target.staging import StagedModel, load_target_tokenizer

    check_model_source(spec.target, "target")
    if spec.speculator is not None and not is_authors_file(spec.speculator):
        check_model_source(spec.speculator, "speculator")
    if spec.draft_model is not None:
        check_model_source(spec.draft_model, "draft model")
    dtype = getattr(torch, spec.dtype)
    stages, boundaries = pipeline_cut(spec.stages, spec.boundaries, spec.speculator, spec.speculator_revision,
                                      spec.target, spec.revision)
    n = len(boundaries) - 1 if boundaries else stages
    if spec.speculator is not None:
        head_n = speculator_stages(spec.speculator, spec.speculator_revision)
        if n != head_n:
            raise SpdInputError(f"the speculator does not fit this target: it was trained for n = {head_n} stages "
                                f"but the pipeline has {n}")
    tokenizer = load_target_tokenizer(spec.target, spec.revision, spec.tokenizer)
    if tokenizer is None:
        raise SpdInputError(f"the target '{spec.target}' has no tokenizer, and a server answers in text; pass "
                            "--tokenizer DIR_OR_ID")
    if spec.runtime == "distributed":
        return _open_distributed(spec, n, boundaries, dtype, tokenizer)
    staged = StagedModel.from_pretrained(spec.target, n_stages=stages, boundaries=boundaries, revision=spec.revision,
                                         dtype=dtype, device=spec.device)
    head = (load_speculator(spec.speculator, spec.speculator_revision, dtype, spec.device, target=staged)
            if spec.speculator else None)
    return Pipeline(spec, _engine(spec, staged, head, tokenizer, dtype), staged, tokenizer, n)


def _engine(spec: PipelineSpec, staged, head, tokenizer, dtype, stages=None):
    from ..decoding.factory import DecodingSpec, build_engine

    return build_engine(DecodingSpec.of(spec), staged, head, tokenizer, dtype, spec.device, stages)


def _open_distributed(spec: PipelineSpec, n: int, boundaries: list[int] | None, dtype: torch.dtype,
                      tokenizer) -> Pipeline:
    """Rank 0 here, ``n`` stage processes spawned now; a 2-token warm-up request proves the pipeline works."""
    from ..runtime.handshake import check_same_job, job_identity
    from ..runtime.loading import load_partial
    from ..runtime.protocol import PipelineLost, RuntimeConfig
    from ..runtime.remote import RemoteStages
    from ..runtime.world import free_port, local_world_env
    from ..heads.loading import load_speculator

    if spec.mode not in ("spd", "pp", "tree"):
        raise SpdInputError(f"--runtime distributed runs --mode spd, pp or tree, not '{spec.mode}'")
    backend = "nccl" if torch.device(spec.device).type == "cuda" else "gloo"
    config = RuntimeConfig(backend=backend, timeout_s=spec.timeout_s, emulate_stage_ms=spec.emulate_stage_ms,
                           emulate_link_ms=spec.emulate_link_ms)
    # Rank 0's part and the head load (and fail with one line) before any process starts.
    staged = load_partial(spec.target, n, 0, spec.revision, dtype, spec.device, boundaries)
    head = (load_speculator(spec.speculator, spec.speculator_revision, dtype, spec.device, target=staged)
            if spec.speculator else None)
    port = free_port()
    env = {**local_world_env(port), "WORLD_SIZE": str(n + 1), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "spd.cli.run_pipeline", "--target", spec.target, "--stages", str(n),
           "--dtype", spec.dtype, "--backend", backend, "--timeout-s", str(spec.timeout_s),
           "--emulate-stage-ms", str(spec.emulate_stage_ms), "--emulate-link-ms", str(spec.emulate_link_ms)]
    if spec.revision is not None:
        cmd += ["--revision", spec.revision]
    if boundaries is not None:
        cmd += ["--boundaries", ",".join(map(str, boundaries))]
    procs: list[subprocess.Popen] = []
    try:
        for r in range(1, n + 1):
            procs.append(start_child(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL))
        control = _join(procs, port, n, backend, max(spec.timeout_s, config.join_timeout_s))
        check_same_job(job_identity(spec.target, spec.revision, staged, dtype, config), control)
        remote = RemoteStages(staged, config, control)
        pipeline = Pipeline(spec, _engine(spec, staged, head, tokenizer, dtype, remote), staged, tokenizer, n,
                            remote, procs)
        pipeline.generate([0], 2, lambda token, accepted: None)
        return pipeline
    except (PipelineLost, RuntimeError) as exc:
        lost = _exited(procs)
        for proc in procs:
            end_child(proc, grace_s=0)
        raise SpdInputError(f"the stage processes did not start: {lost or first_line(exc)}") from None
    except BaseException:  # SIGTERM (SystemExit) or Ctrl-C while loading: no stage process outlives the server
        for proc in procs:
            end_child(proc, grace_s=2)
        raise


def _exited(procs) -> str | None:
    for rank, proc in enumerate(procs, start=1):
        if proc.poll() is not None:
            return f"the stage process of rank {rank} exited with status {proc.returncode}"
    return None


def _join(procs, port: int, n: int, backend: str, timeout_s: float):
    """Join the world as rank 0 while the stage processes load; fail at once if one of them exits."""
    import threading

    import torch.distributed as dist

    from ..runtime.world import loopback_interface, loopback_store

    result: dict = {}

    def join():
        try:
            timeout = datetime.timedelta(seconds=timeout_s)
            # The stages meet on this machine: the store listens on loopback only, and gloo binds to it too.
            if not os.environ.get("GLOO_SOCKET_IFNAME") and loopback_interface():
                os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
            store = loopback_store("127.0.0.1", port, n + 1, timeout)
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=0, world_size=n + 1,
                                    timeout=timeout)
            result["control"] = dist.new_group(backend="gloo", timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - reported below as one line
            result["error"] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        if thread.is_alive() and _exited(procs):
            raise RuntimeError(_exited(procs) + " while loading (its error is above)")
    if "error" in result:
        raise RuntimeError(first_line(result["error"]))
    return result["control"]
