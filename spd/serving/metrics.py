"""The server's Prometheus metrics (``GET /metrics``, text exposition format, prometheus_client).

Acceptance follows the engine's convention (docs/engine.md): every pipeline step that verifies a token
commits exactly one token, the accepted speculation or, on a rejection, the target's own replacement (the
"bonus token" of EAGLE-style mean acceptance length is counted); the request's first token, from the
prefill logits, is not a decode token. ``spd_mean_accept_length`` is therefore
``L'_acc = n * decode_tokens / steps`` over every request served: tokens committed per full pass through the
``n`` stages, i.e. the speedup over autoregressive decoding when a step costs ``1/n`` of a forward.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServerMetrics:
    """Counters, gauges and histograms of one server, in their own registry."""

    def __init__(self, model: str, mode: str, stages: int, runtime: str):
        self.stages = stages
        disable_created_metrics()  # the *_created series (process start times) only clutter the page
        r = self.registry = CollectorRegistry()
        Info("spd_server", "What this server runs", registry=r).info(
            {"model": model, "mode": mode, "stages": str(stages), "runtime": runtime}
        )
        self._count_requests(r)
        self._time_requests(r)
        self._count_pipeline(r)
        self._steps = self._decode = 0
        self._by_version: dict[int, list[int]] = {}  # head version -> [steps, decode tokens] of its requests

    def _count_requests(self, r: CollectorRegistry) -> None:
        """Requests answered and their tokens, and the requests waiting and running now."""
        self.requests = Counter(
            "spd_requests",
            "Requests answered, by endpoint and outcome (ok: generated; "
            "cancelled: the client went away; invalid: 400/404; rejected: 503; failed: 500)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("spd_prompt_tokens", "Prompt tokens of generated requests", registry=r)
        self.generation_tokens = Counter(
            "spd_generation_tokens", "Tokens generated (every request, cancelled ones included)", registry=r
        )
        self.queue_length = Gauge("spd_queue_length", "Requests waiting for the pipeline", registry=r)
        self.running = Gauge(
            "spd_running_requests", "Requests on the pipeline now (0 or 1; up to --max-batch)", registry=r
        )
        self.kv_tokens = Gauge(
            "spd_kv_reserved_tokens",
            "Token positions the running requests' KV caches are sized "
            "for (prompt + max_tokens, at most --max-model-len, and the tree in flight when "
            "batched; 0 when idle)",
            registry=r,
        )

    def _time_requests(self, r: CollectorRegistry) -> None:
        """How long requests take: in the queue, to the first token, between tokens, to the last."""
        self.latency = Histogram(
            "spd_request_latency_seconds", "From arrival to the last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "spd_queue_time_seconds", "From arrival to the start of generation", buckets=LATENCY_BUCKETS, registry=r
        )
        self.first_token = Histogram(
            "spd_time_to_first_token_seconds", "From arrival to the first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.between_tokens = Histogram(
            "spd_time_between_tokens_seconds",
            "From one token of a request to its next",
            buckets=TBT_BUCKETS,
            registry=r,
        )
        self.request_between_tokens = Histogram(
            "spd_request_time_between_tokens_seconds",
            "A request's own mean time between tokens (from its first "
            "token to its last over its gaps), when it ends with two tokens or more",
            buckets=TBT_BUCKETS,
            registry=r,
        )

    def _count_pipeline(self, r: CollectorRegistry) -> None:
        """What the pipeline does: the batch in flight, steps, committed and accepted tokens, flushes, acceptance by
        position and L'_acc."""
        self.batch_size = Gauge(
            "spd_batch_size", "Requests in flight in the pipeline now (--max-batch B: up to B)", registry=r
        )
        self.steps = Counter("spd_pipeline_steps", "Pipeline steps (K) of pipelined modes", registry=r)
        self.decode_tokens = Counter(
            "spd_decode_tokens",
            "Tokens committed by pipeline steps (N): accepted "
            "speculations plus the target's replacement tokens; not the prefill token",
            registry=r,
        )
        self.accepted = Counter("spd_accepted_tokens", "Speculated tokens accepted by verification", registry=r)
        self.flushes = Counter("spd_flushes", "Rejections (each flushes the pipeline)", registry=r)
        self.verified_by_position = Counter(
            "spd_verified_by_position",
            "Speculated tokens verified, by position after a (re)seed (n: full pipeline)",
            ["position"],
            registry=r,
        )
        self.accepted_by_position = Counter(
            "spd_accepted_by_position",
            "Speculated tokens accepted, by position after a (re)seed (n: full pipeline)",
            ["position"],
            registry=r,
        )
        accept_length = Gauge(
            "spd_mean_accept_length",
            "L'_acc = n * decode_tokens / steps over every request "
            "served (the replacement token after a rejection counts, the prefill token does not)",
            registry=r,
        )
        accept_length.set_function(self.mean_accept_length)

    def watch_heads(self, version) -> None:
        """The head versions' rows (a server that watches for new heads): ``version()`` is the one serving new
        requests."""
        r = self.registry
        Gauge(
            "spd_head_version",
            "The head version serving new requests (0: the head the server started with)",
            registry=r,
        ).set_function(version)
        self.head_swaps = Counter("spd_head_swaps", "New head versions swapped in", registry=r)
        self.head_refused = Counter(
            "spd_head_refused", "Head versions refused (another target or cut, or they did not load)", registry=r
        )
        self.accept_by_version = Gauge(
            "spd_mean_accept_length_by_version",
            "L'_acc over the requests each head version served",
            ["version"],
            registry=r,
        )

    def watch_records(self, counts) -> None:
        """Show the traffic recorder's counts (``spd.traffic.records.RecorderCounts``) on the page."""
        for name, help, attribute in (
            ("spd_records_written", "Finished requests written to the traffic records (--record)", "written"),
            ("spd_records_written_bytes", "Bytes written to the traffic records", "written_bytes"),
            ("spd_record_failures", "Finished requests that could not be recorded (served all the same)", "failed"),
            (
                "spd_records_deleted_shards",
                "Oldest record shards deleted to stay within --record-max-mb",
                "deleted_shards",
            ),
        ):
            Gauge(name, help, registry=self.registry).set_function(lambda a=attribute: getattr(counts, a))

    def outcomes(self) -> dict[str, int]:
        """Requests answered so far by outcome (``ok``, ``invalid``, ...), every endpoint together."""
        counts: dict[str, int] = {}
        for metric in self.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels["outcome"]
                    counts[outcome] = counts.get(outcome, 0) + int(sample.value)
        return counts

    def mean_accept_length(self) -> float:
        """L'_acc over every request served so far (0 before the first pipeline step)."""
        return self.stages * self._decode / self._steps if self._steps else 0.0

    def record_generation(self, stats: dict, version: int | None = None) -> None:
        """Add one request's engine statistics (``GenerationStats.as_dict()``), served by head ``version`` (when the
        server watches for versions)."""
        self.prompt_tokens.inc(stats["prompt_tokens"])
        self.generation_tokens.inc(stats["new_tokens"])
        if "steps" not in stats:
            return  # ar: no pipeline
        self._steps += stats["steps"]
        self._decode += stats["decode_tokens"]
        self.steps.inc(stats["steps"])
        self.decode_tokens.inc(stats["decode_tokens"])
        self.accepted.inc(stats["accepted"])
        self.flushes.inc(stats["flushes"])
        if version is not None:
            totals = self._by_version.setdefault(version, [0, 0])
            totals[0] += stats["steps"]
            totals[1] += stats["decode_tokens"]
            if totals[0]:
                self.accept_by_version.labels(version=str(version)).set(self.stages * totals[1] / totals[0])
        for i, (verified, accepted) in enumerate(zip(stats["verified_by_position"], stats["accepted_by_position"])):
            self.verified_by_position.labels(position=str(i + 1)).inc(verified)
            self.accepted_by_position.labels(position=str(i + 1)).inc(accepted)

    def exposition(self) -> bytes:
        """The metrics page, in Prometheus' text exposition format."""
        return generate_latest(self.registry)
