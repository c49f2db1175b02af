"""The multi-process pipeline runtime on ``torch.distributed`` (docs/method.md §7).

Rank 0 is the driver: embedding, final norm, LM head, the token source (speculation head or draft model),
verification and control. It runs the very step loop of :class:`spd.decoding.engine.Engine` (a chain or a
tree), with :class:`RemoteStages` as its stage backend, so it commits
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

Many requests at once (``--max-batch``): a batch mode in which rank 0 sends each stage a manifest per ragged stage
call and the stages pass the batched outputs on (``batch.py``, ``batch_stage.py``; docs/method.md §9).

Files: ``protocol.py`` (message kinds, header, notices, :class:`RuntimeConfig`), ``link.py`` (:class:`Link`,
:class:`Notices`), ``stage.py`` (the stage ranks' loop), ``remote.py`` (:class:`RemoteStages`, rank 0),
``batch.py`` (rank 0's side of the batch mode and the manifest's format), ``batch_stage.py`` (a stage rank in it),
``loading.py`` (:func:`load_partial`), ``world.py`` (process group, loopback store, ports, devices),
``children.py`` (the ranks' processes, which end with the process that started them).

Shape suffixes: T tokens, D hidden size, A anchors, L layers (+1).
"""
