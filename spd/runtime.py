"""The multi-process pipeline runtime on ``torch.distributed`` (docs/method.md §7).

Rank 0 is the driver: embedding, final norm, LM head, the token source (speculation head or draft model),
verification and control. It runs the very step loop of :class:`spd.decoding.engine.PipelineEngine` (or of
:class:`spd.decoding.tree_engine.TreeEngine`), with :class:`RemoteStages` as its stage backend, so it commits
exactly the tokens of the single-process engines (same verification code, same random draws in the same
order). Ranks ``1..n`` each own one stage: only that stage's decoder layers are loaded
(:func:`load_partial`), plus its KV cache.

Data path (``DATA`` tag): rank 0 -> 1 -> ... -> n -> 0, one message per token or tree level (:class:`Link`:
header, optional int64 extra, hidden states, packed in one send). Each stage also reports the anchor hidden
states the head reads to rank 0 (the last stage's report carries ``H^L`` too). Each step rank 0 speculates
while the stages compute, takes the report of the token leaving stage n first, verifies it and releases
stage 1's next token, then reads the other reports (``RemoteStages.launch`` / ``collect``).

Control path: a second (gloo) process group carries notices ``(epoch, committed length, kind, count)`` from
rank 0 to every stage: a flush (truncate the KV cache) or a tree prune (keep the accepted subtree; the kept
indices ride in the same message). Rank 0 sends a step's notice to stage 1 just before stage 1's next input
and to the other stages just after it. On a stage a thread receives the notices (:class:`Notices`) and the
stage applies those that have arrived after it forwards its output, while its next input is on the way.
Every data message carries the epoch it belongs to: a stage drops work of an old epoch without computing
it, unless only prunes happened since (a tree level is then mapped through them, :func:`follow_prunes`);
work of a newer epoch waits until the stage has applied the notices. A new request (``PREFILL``) starts a
new epoch and resets the stage's cache; ``STOP`` (after the ``CLOSE`` notice) travels down the chain and
back to rank 0, which drains every stage's reports so that no send is left pending. A server keeps idle stages
waiting with ``PING`` (forwarded down the chain, dropped by stage n) more often than the timeout.

Emulation for measuring on one machine: ``emulate_stage_ms`` is slept by a stage after each token it
computes, ``emulate_link_ms`` delays the delivery of every message (the receiver waits until the send time
plus the link latency; sends never block).

Local worlds (``MASTER_ADDR`` a loopback address, as ``spd-generate --runtime distributed`` and ``spd-serve``
spawn them) keep their sockets on the loopback interface: gloo's (``GLOO_SOCKET_IFNAME``, unless set) and the
store that rank 0 serves when no launcher agent does (:func:`init_distributed`). Every size a message header
gives is bounded by what the model can send (:meth:`Link.check_header`): a corrupt or hostile header is a
clear error, not a huge allocation.

Failure handling: every rank runs under a process-group timeout; a dead peer (connection reset) or a silent
one (timeout) raises, the rank prints one ``error:`` line naming itself and exits non-zero, and the
launcher (``torchrun`` / ``spd-generate --runtime distributed``) tears the other ranks down.

Shape suffixes: T tokens, D hidden size, A anchors, L layers (+1).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import SpdInputError, first_line
from .target.staging import StagedModel, StageOutput

# Message kinds (header[0]) and tags.
PREFILL, TOKEN, STOP, REPORT, LEVEL, PING = 1, 2, 3, 4, 5, 6
DATA_TAG, REPORT_TAG, CONTROL_TAG, KEPT_TAG = 1, 2, 3, 4
HEADER = 8  # kind, epoch, position, length, stage, send time (us), payload width, extra length
# Control notices (epoch, committed length, kind, kept count), then a prune's kept indices in the same message
# (up to KEPT_INLINE; more follow on KEPT_TAG). CLOSE, the last notice, ends the stage's notice thread.
FLUSH, PRUNE, CLOSE = 0, 1, 2
NOTICE, KEPT_INLINE = 4, 252
NOTICE_WAIT = datetime.timedelta(days=365)  # the notice thread waits through idle time; the data path has the timeouts
KINDS = (PREFILL, TOKEN, STOP, REPORT, LEVEL, PING)
NOTICE_KINDS = (FLUSH, PRUNE, CLOSE)
# Bounds on header fields when the model gives none: tokens per message (a prompt, a tree level), rows per token
# (anchors of a stage plus H^L), int64 extras (a prefill's per-layer flags, a tree level's positions and mask)
# and kept indices of a prune.
DEFAULT_MAX_TOKENS, DEFAULT_MAX_WIDTH, MAX_EXTRA, MAX_KEPT = 1 << 20, 1024, 1 << 22, 1 << 20


def follow_prunes(start: int, size: int, end: int, kepts: list[torch.Tensor]):
    """Map a tree level through the prunes that happened since it was sent.

    The level is tree nodes ``[start, start + size)`` of a tree with ``end`` nodes up to it; ``kepts`` are the
    kept index sets of the prunes in order (:meth:`spd.decoding.tree.TokenTree.prune_to_child`). Returns None when no
    node survives, else ``(rows, new_start, cols)``: the surviving rows of the level (indices into it), the
    level's first tree index now, and the surviving tree nodes ``< end`` (old indices: the columns of the
    level's ancestor mask to keep).
    """
    # Python lists: a level has a few nodes and a tree a few dozen, where each torch op would cost more.
    rows, current = list(range(size)), list(range(start, start + size))
    cols, col_current = list(range(end)), list(range(end))
    for kept in kepts:
        new_index = {old: new for new, old in enumerate(kept.tolist())}
        rows, current = _survivors(rows, current, new_index)
        if not rows:
            return None
        cols, col_current = _survivors(cols, col_current, new_index)
    return torch.tensor(rows), current[0], torch.tensor(cols)


def _survivors(ids: list[int], nodes: list[int], new_index: dict[int, int]) -> tuple[list[int], list[int]]:
    """The ``ids`` whose tree node survives a prune, and those nodes' new indices."""
    kept = [(i, new_index[node]) for i, node in zip(ids, nodes) if node in new_index]
    return [i for i, _ in kept], [node for _, node in kept]


class EpochLog:
    """What each epoch of the current request was: a prune (its kept set) or anything else (flush, new request).

    Work of epoch ``m`` seen in epoch ``e > m`` is still valid only if every epoch in ``(m, e]`` was a prune;
    it is then mapped through those prunes (tree levels). Chain tokens are never pruned, so for them any
    newer epoch means stale.
    """

    def __init__(self):
        self.prunes: dict[int, torch.Tensor] = {}

    def record(self, epoch: int, kept: torch.Tensor | None) -> None:
        if kept is not None:
            self.prunes[epoch] = kept

    def since(self, old: int, now: int) -> list[torch.Tensor] | None:
        """The kept sets of epochs ``old + 1 .. now`` in order, or None when one of them was not a prune."""
        kepts = []
        for epoch in range(old + 1, now + 1):
            if epoch not in self.prunes:
                return None
            kepts.append(self.prunes[epoch])
        return kepts

    def forget_before(self, epoch: int) -> None:
        self.prunes = {e: k for e, k in self.prunes.items() if e >= epoch}


@dataclass
class RuntimeConfig:
    """How the processes talk and what is emulated."""

    backend: str = "gloo"  # gloo (CPU) or nccl (GPU) for the data path; control is always gloo
    timeout_s: float = 60.0  # a peer silent for this long is declared lost
    emulate_stage_ms: float = 0.0  # added compute time per token per stage
    emulate_link_ms: float = 0.0  # added latency per message
    # When stage 1 may start a proposal: False (default) once the step that made it has been verified
    # (a flush then costs nothing extra); True as soon as it exists (saves the verification round trip
    # on every step, but stage 1 may be busy with a doomed proposal when a flush comes: a step lost).
    early_launch: bool = False
    join_timeout_s: float = 600.0  # how long a rank waits for the others to join (they load their layers first)


class PipelineLost(RuntimeError):
    """A peer died or went silent: the runtime cannot continue."""


# ---------------------------------------------------------------------------------------- loading


def load_partial(source: str, n_stages: int, role: int, revision: str | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 boundaries: list[int] | None = None) -> StagedModel:
    """A StagedModel whose parameters exist only for ``role``: 0 = embedding, final norm and LM head (the
    driver), ``s >= 1`` = the decoder layers of stage ``s`` (1-based). Everything else stays on the meta
    device (no memory), so a stage holds about 1/n of the target's layers."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import cached_file

    from .paths import check_model_source

    check_model_source(source, "target")
    try:
        config = AutoConfig.from_pretrained(source, revision=revision)
        index = cached_file(source, "model.safetensors.index.json", revision=revision,
                            _raise_exceptions_for_missing_entries=False)
        if index is not None:
            weight_map = json.loads(open(index).read())["weight_map"]
            files = {name: cached_file(source, f, revision=revision) for name, f in weight_map.items()}
        else:
            single = cached_file(source, "model.safetensors", revision=revision)
            with safe_open(single, framework="pt") as f:
                files = {name: single for name in f.keys()}
    except (OSError, ValueError, KeyError) as exc:
        raise SpdInputError(f"could not load safetensors weights of '{source}': {first_line(exc)}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    staged = StagedModel(model, n_stages=n_stages, boundaries=boundaries)
    base = model.base_model
    if role == 0:
        modules = {"embed": base.embed_tokens, "norm": base.norm, "head": model.get_output_embeddings()}
    else:
        modules = {f"layer{i}": staged.layers[i] for i in staged.stage_layers(role - 1)}
    module_names = {id(m): name for name, m in model.named_modules()}
    tied = getattr(config, "tie_word_embeddings", False)
    handles: dict[str, object] = {}
    for module in modules.values():
        module.to_empty(device=device)  # only the kept modules get memory
        prefix = module_names[id(module)]
        for local, param in module.named_parameters():
            name = f"{prefix}.{local}"
            # The multimodal layout (Qwen3.5) stores the text decoder under model.language_model.
            key = next((k for k in (name, name.replace("model.", "model.language_model.", 1)) if k in files), None)
            if key is None and tied and name.endswith("lm_head.weight"):
                key = next((k for k in files if k.endswith("embed_tokens.weight")), None)
            if key is None:
                raise SpdInputError(f"the checkpoint '{source}' has no tensor '{name}'")
            if files[key] not in handles:
                handles[files[key]] = safe_open(files[key], framework="pt", device="cpu")
            with torch.no_grad():
                param.copy_(handles[files[key]].get_tensor(key).to(dtype))
    if tied and role == 0:
        model.get_output_embeddings().weight = base.embed_tokens.weight
    rotary = base.rotary_emb
    with torch.device(device):
        base.rotary_emb = type(rotary)(config=model.config.get_text_config())
    staged.rotary_emb = base.rotary_emb
    if role == 0:
        # As from_pretrained does: the EOS default (spd.decoding.generation.default_eos) reads the generation config.
        try:
            model.generation_config = GenerationConfig.from_pretrained(source, revision=revision)
        except OSError:
            pass  # no generation_config.json: the one derived from config.json stays
    model.eval()
    return staged


def materialized_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters that hold data (meta tensors excluded)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")


# ---------------------------------------------------------------------------------------- messages


class Link:
    """Point-to-point messages with epoch bookkeeping, emulated latency and sends that never block.

    A message is one flat byte tensor: the int64 header, then the int64 ``extra`` and the payload (T, W, D),
    padded to a fixed slot size both sides know, so the receiver can have the next receive posted before the
    message is sent (a gloo send completes only against a posted receive; posting after the header arrived
    cost a second round trip per message). Header and payload in one send also halves the number of
    operations. Extra + payload larger than the slot (a prompt, a wide tree level) follow in a second send
    whose size the header gives.
    """

    def __init__(self, rank: int, config: RuntimeConfig, dtype: torch.dtype, device: torch.device, hidden: int,
                 max_tokens: int | None = None, max_width: int | None = None):
        self.rank, self.config, self.dtype, self.device, self.hidden = rank, config, dtype, device, hidden
        # What a peer may announce in a header (check_header): the model's context and rows per token.
        self.max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        self.max_width = max_width or DEFAULT_MAX_WIDTH
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        # Room for a token's report (a few anchor rows plus H^L) and a small tree level's extra, inline.
        self.inline = 6 * hidden * self.itemsize + 4096
        self.slot = HEADER * 8 + self.inline
        self._posted: dict[tuple[int, int], tuple[dist.Work, torch.Tensor]] = {}
        # Gloo completes a send only when the peer has received it and ``wait`` is called; a reaper thread
        # waits on sends in order (keeping their buffers alive), so the main loop never blocks on a send.
        self._sends: queue.Queue = queue.Queue()
        self._send_error: BaseException | None = None
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True)
        self._reaper.start()

    def send(self, dst: int, tag: int, kind: int, epoch: int, position: int, payload_TWD: torch.Tensor | None = None,
             stage: int = 0, extra: torch.Tensor | None = None) -> None:
        """Send a header, an optional int64 ``extra`` and an optional (T, W, D) payload; never blocks."""
        length, width = (0, 0) if payload_TWD is None else payload_TWD.shape[:2]
        header = torch.tensor([kind, epoch, position, length, stage, int(time.time() * 1e6), width,
                               0 if extra is None else extra.numel()], dtype=torch.long)
        body = []
        if extra is not None:
            body.append(extra.to(torch.long).contiguous().view(torch.uint8).flatten().to(self.device))
        if payload_TWD is not None:
            body.append(payload_TWD.to(self.dtype).contiguous().view(torch.uint8).flatten())
        size = sum(part.numel() for part in body)
        message = torch.empty(self.slot, dtype=torch.uint8, device=self.device)
        message[:HEADER * 8] = header.view(torch.uint8).to(self.device)
        if size <= self.inline:
            if body:
                message[HEADER * 8:HEADER * 8 + size] = torch.cat(body)
            self.post(dist.isend(message, dst, tag=tag), message)
        else:
            spill = torch.cat(body)
            self.post(dist.isend(message, dst, tag=tag), message)
            self.post(dist.isend(spill, dst, tag=tag), spill)

    def post(self, work: dist.Work, buffer: torch.Tensor) -> None:
        """Hand a started send to the reaper."""
        if self._send_error is not None:
            raise PipelineLost(f"rank {self.rank}: a send failed ({first_line(self._send_error)})")
        self._sends.put((work, buffer))

    def _post_recv(self, src: int, tag: int) -> None:
        buffer = torch.empty(self.slot, dtype=torch.uint8, device=self.device)
        self._posted[(src, tag)] = (dist.irecv(buffer, src, tag=tag), buffer)

    def recv(self, src: int, tag: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Receive one message: (header, extra or None, payload (T, W, D) or None), after the emulated latency."""
        if (src, tag) not in self._posted:
            self._post_recv(src, tag)
        work, message = self._posted.pop((src, tag))
        self._wait(work, src)
        header = message[:HEADER * 8].cpu().view(torch.long).clone()
        size = self.check_header(header, src)
        n_extra, length, width = int(header[7]), int(header[3]), int(header[6])
        if size <= self.inline:
            body = message[HEADER * 8:HEADER * 8 + size]
        else:  # the second part comes next on this (src, tag): receive it before posting the next slot
            body = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._wait(dist.irecv(body, src, tag=tag), src)
        if int(header[0]) != STOP:
            self._post_recv(src, tag)  # the next message from this peer can land as soon as it is sent
        extra = payload_TWD = None
        if n_extra:
            extra = body[:n_extra * 8].cpu().view(torch.long).clone()
        if length:
            payload_TWD = body[n_extra * 8:].view(self.dtype).view(length, width, self.hidden)
        if self.config.emulate_link_ms > 0:
            delay = int(header[5]) / 1e6 + self.config.emulate_link_ms / 1000 - time.time()
            if delay > 0:
                time.sleep(min(delay, self.config.emulate_link_ms / 1000))  # a skewed send time never waits longer
        return header, extra, payload_TWD

    def check_header(self, header: torch.Tensor, src: int) -> int:
        """The body size a received header announces, after checking every field against what a peer can send."""
        kind, epoch, position, length, stage, _, width, n_extra = header.tolist()
        bounds = (("kind", kind, min(KINDS), max(KINDS)), ("epoch", epoch, 0, 2**62),
                  ("position", position, 0, 2**62), ("length", length, 0, self.max_tokens),
                  ("stage", stage, 0, 2**20), ("payload width", width, 0, self.max_width),
                  ("extra length", n_extra, 0, MAX_EXTRA))
        for name, value, low, high in bounds:
            if not low <= value <= high:
                raise PipelineLost(f"rank {self.rank}: a message from rank {src} has a bad header ({name} {value}, "
                                   f"expected {low}..{high}); the peer is corrupt or not one of ours")
        if (length == 0) != (width == 0):
            raise PipelineLost(f"rank {self.rank}: a message from rank {src} has a bad header (a payload of "
                               f"{length} tokens x {width} rows)")
        return n_extra * 8 + length * width * self.hidden * self.itemsize

    def _wait(self, work: dist.Work, peer: int) -> None:
        """Wait for a receive; a dead or silent peer becomes PipelineLost naming both ranks."""
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout_s))
        except RuntimeError as exc:
            why = _short_reason(exc)
            if "imed out" in why or "imeout" in why:
                raise PipelineLost(f"rank {self.rank}: no message from rank {peer} within "
                                   f"{self.config.timeout_s:g} s") from None
            raise PipelineLost(f"rank {self.rank}: lost contact with rank {peer} ({why})") from None

    def _reap_loop(self) -> None:
        while True:
            item = self._sends.get()
            if item is None:
                return
            try:
                item[0].wait()
            except RuntimeError as exc:  # the peer is gone; the main loop reports it
                self._send_error = exc
                return

    def drain_sends(self) -> None:
        """Wait until every send has been received (at shutdown)."""
        self._sends.put(None)
        self._reaper.join(timeout=self.config.timeout_s)


class Notices:
    """A stage's end of the control path: a thread receives rank 0's notices as they arrive, the stage loop takes them.

    A gloo receive reports completion only once it has been waited on (``is_completed`` stays False before), so
    the stage loop could not tell whether a notice has arrived without blocking; the thread waits instead.
    """

    def __init__(self, rank: int, group, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self._arrived: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._receive_loop, args=(group,), daemon=True)
        self._thread.start()

    def _receive_loop(self, group) -> None:
        while True:
            buffer = torch.empty(NOTICE + KEPT_INLINE, dtype=torch.long)
            try:
                dist.irecv(buffer, 0, group=group, tag=CONTROL_TAG).wait(NOTICE_WAIT)
                epoch, length, kind, count = buffer[:NOTICE].tolist()
                if kind not in NOTICE_KINDS or not 0 <= count <= MAX_KEPT or epoch < 0 or length < 0:
                    self._arrived.put(PipelineLost(
                        f"rank {self.rank}: a notice from rank 0 is malformed (kind {kind}, kept count {count}, "
                        f"epoch {epoch}, length {length}); the peer is corrupt or not one of ours"))
                    return
                kept = buffer[NOTICE:NOTICE + min(count, KEPT_INLINE)] if kind == PRUNE else None
                if kind == PRUNE and count > KEPT_INLINE:
                    spill = torch.empty(count - KEPT_INLINE, dtype=torch.long)
                    dist.irecv(spill, 0, group=group, tag=KEPT_TAG).wait(NOTICE_WAIT)
                    kept = torch.cat([kept, spill])
            except RuntimeError as exc:  # rank 0 is gone; the stage loop reports it if it needs a notice
                self._arrived.put(exc)
                return
            self._arrived.put((epoch, length, kind, kept))
            if kind == CLOSE:
                return

    def take(self, block: bool) -> tuple[int, int, int, torch.Tensor | None] | None:
        """The next notice ``(epoch, committed length, kind, kept)``; None when none has arrived and not ``block``."""
        try:
            item = self._arrived.get(block, self.timeout_s if block else None)
        except queue.Empty:
            if not block:
                return None
            raise PipelineLost(f"rank {self.rank}: no notice from rank 0 within {self.timeout_s:g} s") from None
        if isinstance(item, PipelineLost):
            raise item
        if isinstance(item, BaseException):
            raise PipelineLost(f"rank {self.rank}: lost contact with rank 0 ({_short_reason(item)})")
        return item

    def close(self) -> None:
        """After the CLOSE notice was taken: the thread has ended or is about to."""
        self._thread.join(timeout=self.timeout_s)


def _short_reason(exc: BaseException) -> str:
    """Gloo's message without its source location and advice, e.g. "Connection closed by peer [127.0.0.1]:7371"."""
    import re

    why = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first_line(exc))
    return why.split(". This is typically")[0].rstrip(".")


# ------------------------------------------------------------------------------------- stage ranks


def stage_worker(staged: StagedModel, stage: int, config: RuntimeConfig, control_group, device: torch.device) -> None:
    """The loop of rank ``stage + 1``: run this stage on every token or tree level that reaches it, until STOP."""
    rank, n = stage + 1, staged.n_stages
    prev, nxt = rank - 1, (rank + 1) % (n + 1)
    layers = list(staged.stage_layers(stage))
    first, last = staged.boundaries[stage], staged.boundaries[stage + 1]
    dtype = next(staged.layers[layers[0]].parameters()).dtype
    link = Link(rank, config, dtype, device, staged.config.hidden_size, staged.max_positions,
                staged.num_layers + 2)
    # A stage may have run up to n tokens past the committed prefix when a flush notice reaches it (n in flight,
    # plus a proposal launched before its step was verified): linear-attention layers keep n + 2 states.
    cache = staged.new_stage_cache(stage, 1, 256, ring_depth=n + 2, dtype=dtype, device=device)
    epoch = 0
    log = EpochLog()
    notices = 0  # control notices received
    token_anchors: list[int] = []
    control = Notices(rank, control_group, config.timeout_s)

    def take_notice(block: bool = True) -> bool:
        """Apply the next notice (waiting for it if ``block``); False when none has arrived."""
        nonlocal epoch, notices
        notice = control.take(block)
        if notice is None:
            return False
        notices += 1
        new_epoch, length, kind, kept = notice
        if kind != CLOSE and new_epoch > epoch:  # notices of a finished request are ignored
            epoch = new_epoch
            log.record(new_epoch, kept)
            if kind == PRUNE:
                held = cache.length - length  # tree nodes this stage has run, the root first
                cache.keep(length + 1, kept[kept < held] - 1)
            else:
                cache.truncate(length)
        return True

    def catch_up(until_epoch: int | None) -> None:
        """Apply arrived notices; with ``until_epoch``, block until that epoch's notice is applied."""
        while until_epoch is None or epoch < until_epoch:
            if not take_notice(block=until_epoch is not None):
                return

    with torch.inference_mode():
        while True:
            header, extra, payload = link.recv(prev, DATA_TAG)
            kind, msg_epoch, position = int(header[0]), int(header[1]), int(header[2])
            if kind == PING:
                # A serving driver keeps idle stages alive: every wait has a timeout, requests may be far apart.
                if nxt != 0:
                    link.send(nxt, DATA_TAG, PING, msg_epoch, 0)
                continue
            if kind == STOP:
                while notices < position:  # STOP carries the number of notices sent (CLOSE last): take them all
                    take_notice()
                control.close()
                link.send(nxt, DATA_TAG, STOP, msg_epoch, 0)
                if nxt != 0:
                    link.send(0, REPORT_TAG, STOP, msg_epoch, 0, stage=rank)
                break
            catch_up(None)
            if kind == PREFILL:
                # extra = per-layer flags for this request: bit 0 = report per token, bit 1 = report at prefill.
                epoch = msg_epoch
                log.forget_before(epoch)
                cache.truncate(0)
                flags = extra.tolist() if extra is not None else []
                if len(flags) != staged.num_layers + 1:
                    raise PipelineLost(f"rank {rank}: a prefill from rank {prev} carries {len(flags)} layer flags, "
                                       f"expected {staged.num_layers + 1}")
                token_anchors = [l for l in range(first + 1, last + 1) if flags[l] & 1]
                prefill_anchors = [l for l in range(first + 1, last + 1) if flags[l] & 2]
                out = staged.run_stage(stage, payload[:, 0][None], cache, anchors=prefill_anchors)
                _emulate(config)
                _forward(link, nxt, rank, PREFILL, epoch, position, out, prefill_anchors, extra)
                catch_up(None)
                continue
            if msg_epoch > epoch:
                catch_up(msg_epoch)
            if kind == LEVEL:
                level = _level_now(extra, payload, msg_epoch, epoch, position, log)
                if level is None:
                    continue  # flushed, or every node pruned: drop it without computing
                committed, start, positions_T, mask_TN, hidden_T1D = level
                if cache.length != committed + start:
                    raise RuntimeError(f"stage {stage}: a tree level starting at node {start} after {committed} "
                                       f"committed rows, but the cache holds {cache.length}")
                out = staged.run_stage(stage, hidden_T1D[:, 0][None], cache, positions_T[None].to(device),
                                       anchors=token_anchors, tree_mask_TN=mask_TN)
                _emulate(config)
                # Unless prunes remapped it, the level goes on as it came.
                level_extra = extra if msg_epoch == epoch else pack_level(start, positions_T, mask_TN)
                _forward(link, nxt, rank, LEVEL, epoch, committed, out, token_anchors, level_extra,
                         level_extra[:3])
                catch_up(None)  # this step's prune has usually arrived: apply it while the next input is on its way
                continue
            if msg_epoch < epoch:
                continue  # a token of a flushed epoch: drop it without computing
            if cache.length != position:
                raise RuntimeError(f"stage {stage}: token at position {position} but the cache holds {cache.length}")
            out = staged.run_stage(stage, payload[:, 0][None], cache, anchors=token_anchors)
            _emulate(config)
            _forward(link, nxt, rank, TOKEN, epoch, position, out, token_anchors, None)
            catch_up(None)
    link.drain_sends()


def pack_level(start: int, positions_T: torch.Tensor, mask_TN: torch.Tensor) -> torch.Tensor:
    """A tree level's int64 ``extra``: start, size, end (= N), the T positions, the (T, N) ancestor mask."""
    return torch.cat([torch.tensor([start, positions_T.numel(), mask_TN.shape[1]]), positions_T.long().cpu(),
                      mask_TN.flatten().long().cpu()])


def check_level_extra(extra: torch.Tensor | None, payload_T1D: torch.Tensor | None) -> None:
    """A tree level's ``extra`` (:func:`pack_level`) must describe its payload: start, size, end and size * end
    mask entries."""
    ok = extra is not None and extra.numel() >= 3 and payload_T1D is not None
    if ok:
        start, size, end = extra[:3].tolist()
        ok = (size == payload_T1D.shape[0] and 0 <= start and start + size <= end
              and extra.numel() == 3 + size + size * end)
    if not ok:
        raise PipelineLost(f"a tree level message is malformed (extra {None if extra is None else extra[:3].tolist()}, "
                           f"payload {None if payload_T1D is None else tuple(payload_T1D.shape)})")


def _level_now(extra: torch.Tensor, payload_T1D: torch.Tensor, msg_epoch: int, epoch: int, committed: int,
               log: EpochLog):
    """A received tree level as of the current epoch: (committed, start, positions, mask, hidden) or None."""
    check_level_extra(extra, payload_T1D)
    start, size, end = extra[:3].tolist()
    positions_T = extra[3:3 + size]
    mask_TN = extra[3 + size:].view(size, end).bool()
    if msg_epoch == epoch:
        return committed, start, positions_T, mask_TN, payload_T1D
    kepts = log.since(msg_epoch, epoch)
    if kepts is None:
        return None
    mapped = follow_prunes(start, size, end, kepts)
    if mapped is None:
        return None
    rows, start, cols = mapped
    # Each prune commits one more row; absolute positions do not change.
    return committed + len(kepts), start, positions_T[rows], mask_TN[rows][:, cols], payload_T1D[rows]


def _emulate(config: RuntimeConfig) -> None:
    if config.emulate_stage_ms > 0:
        time.sleep(config.emulate_stage_ms / 1000)


def _forward(link: Link, nxt: int, rank: int, kind: int, epoch: int, position: int, out: StageOutput,
             anchors: list[int], extra: torch.Tensor | None, report_extra: torch.Tensor | None = None) -> None:
    """Send the stage output downstream and the anchors (plus H^L from the last stage) to rank 0."""
    hidden_TD = out.hidden_BTD[0]
    if nxt != 0:
        link.send(nxt, DATA_TAG, kind, epoch, position, hidden_TD[:, None], extra=extra)
    rows = [out.anchors[a][0] for a in anchors] + ([hidden_TD] if nxt == 0 else [])
    if rows:
        link.send(0, DATA_TAG if nxt == 0 else REPORT_TAG, REPORT, epoch, position, torch.stack(rows, dim=1),
                  stage=rank, extra=report_extra)


# ----------------------------------------------------------------------------------------- rank 0


class RemoteStages:
    """The engine's stage backend on rank 0: stages live on ranks 1..n (see the module docstring)."""

    def __init__(self, staged: StagedModel, config: RuntimeConfig, control_group):
        self.staged = staged
        self.n = staged.n_stages
        self.config = config
        self.control_group = control_group
        self.link = Link(0, config, staged.dtype, staged.device, staged.config.hidden_size, staged.max_positions,
                         staged.num_layers + 2)
        self.epoch = 0
        self.stage_anchors: list[list[int]] = [[] for _ in range(self.n)]
        self._sent = (0, -1)  # (epoch, position) of the last token sent to stage 1
        self.notices = 0  # control notices sent (each stage receives all of them before it stops)
        self.log = EpochLog()
        # Notices decided but not sent yet, per stage rank: stage 1's go right before its next input, the
        # others' right after it; all before rank 0 waits for anything.
        self._unsent: dict[int, list[tuple]] = {rank: [] for rank in range(1, self.n + 1)}  # (notice, spill)

    def configure(self, stage_anchors: list[list[int]]) -> None:
        self.stage_anchors = stage_anchors

    def prefill(self, prompt_ids_1T: torch.Tensor, anchors: list[int], capacity: int) -> StageOutput:
        self.epoch += 1
        self.log.forget_before(self.epoch)
        b, big_l = self.staged.boundaries, self.staged.num_layers
        flags = torch.zeros(big_l + 1, dtype=torch.long)
        for ids in self.stage_anchors:
            for a in ids:
                flags[a] |= 1
        for a in anchors:
            flags[a] |= 2
        hidden_1TD = self.staged.embed(prompt_ids_1T)
        self._post_notices()
        self.link.send(1, DATA_TAG, PREFILL, self.epoch, 0, hidden_1TD[0][:, None], extra=flags)
        collected: dict[int, torch.Tensor] = {0: hidden_1TD} if 0 in anchors else {}
        last_hidden = None
        for s in range(self.n):
            mine = [a for a in anchors if b[s] < a <= b[s + 1]]
            is_last = s == self.n - 1
            if not mine and not is_last:
                continue
            payload = self._recv_report(s, 0)
            for i, a in enumerate(mine):
                collected[a] = payload[:, i][None]
            if is_last:
                last_hidden = payload[:, -1][None]
        return StageOutput(last_hidden, collected)

    def launch(self, inflight, early: bool = False) -> None:
        """Send the newest slot to stage 1 if it has not entered yet (once per epoch and position)."""
        if early and not self.config.early_launch:
            return  # sent at the start of the next step, once this step's verification is done
        newest = inflight[-1]
        key = (self.epoch, newest.position)
        if newest.depth == 0 and key != self._sent:
            self._post_notices([1])
            self.link.send(1, DATA_TAG, TOKEN, self.epoch, newest.position, newest.hidden_1TD[0][:, None])
            self._sent = key
        self._post_notices()

    def collect(self, inflight) -> None:
        for slot in inflight:
            stage = slot.depth
            mine = self.stage_anchors[stage]
            is_last = stage == self.n - 1
            if mine or is_last:
                payload = self._recv_report(stage, slot.position)
                for i, a in enumerate(mine):
                    slot.anchors[a] = payload[:, i]
                if is_last:
                    slot.hidden_1TD = payload[:, -1][None]
            slot.depth += 1

    def flush(self, length: int) -> None:
        """Every stage drops its in-flight work and truncates its KV cache to ``length`` rows."""
        self._notify(FLUSH, length, None)

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Tree hit: every stage keeps the subtree ``kept`` after the committed root (row ``committed``)."""
        self._notify(PRUNE, committed, torch.as_tensor(kept, dtype=torch.long).cpu().contiguous())

    def _notify(self, kind: int, length: int, kept: torch.Tensor | None) -> None:
        """Start a new epoch now (what is sent from here on carries it); the notice waits in ``_unsent``."""
        if kind != CLOSE:  # CLOSE ends the control path; it starts no epoch
            self.epoch += 1
            self.log.record(self.epoch, kept)
        count = 0 if kept is None else kept.numel()
        notice = torch.zeros(NOTICE + KEPT_INLINE, dtype=torch.long)
        notice[:NOTICE] = torch.tensor([self.epoch, length, kind, count])
        if kept is not None:
            notice[NOTICE:NOTICE + min(count, KEPT_INLINE)] = kept[:KEPT_INLINE]
        spill = kept[KEPT_INLINE:].contiguous() if count > KEPT_INLINE else None
        for pending in self._unsent.values():
            pending.append((notice, spill))
        self.notices += 1

    def _post_notices(self, ranks: list[int] | None = None) -> None:
        """Send the notices not yet sent to ``ranks`` (default: every stage).

        Stage 1 needs a step's notice before its next input (it waits for the notice of a newer epoch before
        it computes), the other stages only when that input reaches them: their n - 1 sends go after it,
        so that they do not delay it. Rank 0 sends every notice before it waits for anything.
        """
        for rank in ranks or self._unsent:
            for notice, spill in self._unsent[rank]:
                self.link.post(dist.isend(notice, rank, group=self.control_group, tag=CONTROL_TAG), notice)
                if spill is not None:
                    self.link.post(dist.isend(spill, rank, group=self.control_group, tag=KEPT_TAG), spill)
            self._unsent[rank] = []

    # ------------------------------------------------------------------------------- tree levels
    def launch_level(self, level, tree, committed: int, early: bool = False) -> None:
        """Send a new tree level (depth 0) to stage 1 with its positions and ancestor-mask rows (once)."""
        if not level.sent and not (early and not self.config.early_launch):
            level.sent = True
            start, end = level.start, level.start + level.size
            positions_T = tree.positions(committed)[start:end]
            extra = pack_level(start, positions_T, tree.mask()[start:end, :end])
            self._post_notices([1])
            self.link.send(1, DATA_TAG, LEVEL, self.epoch, committed, level.hidden_1TD[0][:, None], extra=extra)
        self._post_notices()

    def advance(self, levels, tree, committed: int) -> None:
        """Every level in flight ran its next stage: take the stage's report (anchors; H^L from stage n)."""
        for level in levels:
            stage = level.depth
            mine = self.stage_anchors[stage]
            is_last = stage == self.n - 1
            if mine or is_last:
                payload = self._recv_level_report(stage, level)
                for i, a in enumerate(mine):
                    level.anchors[a] = payload[:, i]
                if is_last:
                    level.hidden_1TD = payload[:, -1][None]
            level.depth += 1

    def _recv_level_report(self, stage: int, level) -> torch.Tensor:
        """The report of ``stage`` on ``level``, mapped through the prunes since it was sent: (T, W, D)."""
        header, start, payload = self._recv_current(stage)
        if int(header[1]) > self.epoch or start != level.start or payload.shape[0] != level.size:
            raise RuntimeError(f"rank 0: stage {stage} reported a tree level (start {start}, {payload.shape[0]} "
                               f"nodes, epoch {int(header[1])}), expected start {level.start}, {level.size} nodes, "
                               f"epoch {self.epoch}")
        return payload

    def _recv_report(self, stage: int, position: int) -> torch.Tensor:
        """The current epoch's report of ``stage`` (0-based) for ``position``: (T, W, D)."""
        header, _, payload = self._recv_current(stage)
        if int(header[1]) != self.epoch or int(header[2]) != position:
            raise RuntimeError(f"rank 0: stage {stage} reported position {int(header[2])} of epoch "
                               f"{int(header[1])}, expected position {position} of epoch {self.epoch}")
        return payload

    def _recv_current(self, stage: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The next report of ``stage`` (0-based) that still counts: (header, tree start or -1, payload).

        Work of a flushed or finished request, still in the pipe, is skipped; a tree level's report from
        before prunes is mapped through them (its surviving rows, its start now), or skipped if no node
        survives.
        """
        src = stage + 1
        tag = DATA_TAG if stage == self.n - 1 else REPORT_TAG
        self._post_notices()
        while True:
            header, extra, payload = self.link.recv(src, tag)
            epoch = int(header[1])
            start = int(extra[0]) if extra is not None else -1
            if epoch >= self.epoch:
                return header, start, payload
            kepts = self.log.since(epoch, self.epoch)
            if kepts is None or int(header[0]) != REPORT or extra is None:
                continue
            if extra.numel() != 3:
                raise PipelineLost(f"rank 0: stage {stage} reported a tree level with {extra.numel()} extras, "
                                   "expected 3 (start, size, end)")
            mapped = follow_prunes(*extra.tolist(), kepts)
            if mapped is not None:
                rows, start, _ = mapped
                return header, start, payload[rows]

    def ping(self) -> None:
        """Tell every stage that rank 0 is alive while no request runs (a stage waits ``timeout_s`` at most)."""
        self._post_notices()
        self.link.send(1, DATA_TAG, PING, self.epoch, 0)

    def shutdown(self) -> None:
        """CLOSE the control path; STOP down the chain; drain every stage's reports until its STOP arrives."""
        self._notify(CLOSE, 0, None)
        self._post_notices()
        self.link.send(1, DATA_TAG, STOP, self.epoch, self.notices)
        for s in range(self.n):
            tag = DATA_TAG if s == self.n - 1 else REPORT_TAG
            while int(self.link.recv(s + 1, tag)[0][0]) != STOP:
                pass
        self.link.drain_sends()


# ------------------------------------------------------------------------------------------ setup


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` (a host name or IP) names this machine's loopback interface."""
    import ipaddress

    if address is None:
        return False
    if address.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), next((n for n in names if n.startswith("lo")), None))


def bind_local_world(env=None) -> None:
    """For a world that meets on this machine (``MASTER_ADDR`` a loopback address): gloo's sockets on the loopback
    interface too (``GLOO_SOCKET_IFNAME``), unless the user set an interface. Anything else is left alone."""
    env = os.environ if env is None else env
    if not is_loopback(env.get("MASTER_ADDR")) or env.get("GLOO_SOCKET_IFNAME"):
        return
    name = loopback_interface()
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name


def local_world_env(port: int, env=None) -> dict:
    """The environment for processes of a world spawned on this machine: rendezvous and gloo on loopback."""
    env = dict(os.environ if env is None else env)
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
    bind_local_world(env)
    return env


_STORE_SOCKETS: list = []


def _loopback_store(timeout: datetime.timedelta):
    """Rank 0's store of a local world started without a launcher agent, listening on loopback only (a store
    created from MASTER_ADDR alone listens on every interface); None when this process does not serve it."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or os.environ.get("RANK", "0") != "0"
            or not is_loopback(addr) or not (port or "").isdigit()):
        return None
    return loopback_store(addr, int(port), int(os.environ.get("WORLD_SIZE", "1")), timeout)


def loopback_store(addr: str, port: int, world: int, timeout: datetime.timedelta):
    """A TCPStore server for ``world`` processes listening on the loopback address ``addr`` only."""
    import socket

    family = socket.AF_INET6 if ":" in addr.strip("[]") else socket.AF_INET
    host = addr.strip("[]") if addr.lower() != "localhost" else "127.0.0.1"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    store = dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=sock.fileno())
    _STORE_SOCKETS.append(sock)  # the store listens on this socket: it must stay open as long as the process
    return store


def init_distributed(config: RuntimeConfig):
    """Join the process group (env:// as torchrun sets it) and create the gloo control group."""
    # The group's default timeout only bounds joining and the background send waits; every receive on the data
    # and control paths has its own (config.timeout_s).
    timeout = datetime.timedelta(seconds=max(config.timeout_s, config.join_timeout_s))
    bind_local_world()
    store = _loopback_store(timeout)
    if store is None:
        dist.init_process_group(config.backend, timeout=timeout)
    else:
        # The prefix env:// rendezvous puts on the store (the other ranks join through it).
        dist.init_process_group(config.backend, store=dist.PrefixStore("default_pg", store), rank=0,
                                world_size=int(os.environ.get("WORLD_SIZE", "1")), timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), control


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
