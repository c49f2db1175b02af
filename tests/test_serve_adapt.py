"""Heads that learn from what they serve: a server swaps each new head version in between steps (requests in flight
finish on the head they started with, new ones get the new one, nothing is dropped, every answer is the target's
greedy one), refuses a version for another cut or a damaged one with one line, restarts on the newest good version,
and with --adapt runs spd-adapt as its child, whose versions it swaps in."""

import os
import re
import shutil
import signal
import threading
import time

import pytest

from conftest import differences_are_near_ties, run_main
from helpers.serve import Server
from spd.traffic.records import read_records
from spd.traffic.versions import publish_version

PROMPTS = ("def main(argv):\n", "class A:\n", "import os\n", "for i in range(", "x = [1, 2", "if x:\n")


def _publish(versions, number: int, head):
    """``head`` published as version ``number`` of ``versions``, as spd-adapt publishes one (held-out figures too)."""
    versions.mkdir(exist_ok=True)
    info = {"parent": number - 1, "before": {"L_acc_est": 1.21}, "after": {"L_acc_est": 1.30}}
    return publish_version(versions, number, head, info, "# a version made by a test\n")


def _damaged(versions, number: int, like):
    """Version ``number``: complete to the watcher (version.json, config, weights) but with its weights cut short;
    moved into place whole, as a version is."""
    tmp = versions.parent / f"damaged-v{number}"
    shutil.copytree(like, tmp)
    (tmp / "version.json").write_text(f'{{"version": {number}}}')
    weights = tmp / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    os.rename(tmp, versions / f"v{number}")


def _until(condition, what: str, timeout: float = 120.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _log(server, pattern: str) -> list[str]:
    return [line for line in list(server.lines) if re.search(pattern, line)]


def _ask(server, prompt: str, tokens: int = 8) -> str:
    out = server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def _check_greedy(tiny_testbed, rows, texts=()) -> None:
    """Every recorded answer is the target's own greedy continuation of its prompt, and every answer a client got is
    one of them."""
    from spd.decoding.generation import generate_ar
    from spd.target.staging import StagedModel
    from spd.target.tokenizer import load_tokenizer

    staged = StagedModel.from_pretrained(str(tiny_testbed / "target"), n_stages=1)
    tokenizer = load_tokenizer(tiny_testbed / "target")
    for row in rows:
        assert row["answer_ids"] == generate_ar(staged, row["prompt_ids"], len(row["answer_ids"])).token_ids
    recorded = {tokenizer.decode(row["answer_ids"], skip_special_tokens=True) for row in rows}
    assert set(texts) <= recorded


def test_a_new_version_serves_new_requests_a_bad_one_is_refused_and_a_restart_starts_on_the_newest(
    tiny_testbed, tiny_heads, heads, tmp_path
):
    records = tmp_path / "records"
    versions = records / "heads"
    flags = ("--target", str(tiny_testbed / "target"), "--speculator", str(tiny_heads[4]), "--record", str(records))
    server = Server(*flags)
    texts = []
    try:
        (start,) = _log(server, "listening on")
        assert f"head v0 '{tiny_heads[4]}' (new versions from '{versions}')" in start, start
        client = server.client()
        stream = client.completions.create(
            model=server.model, prompt=PROMPTS[0], max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        first = next(chunks).choices[0].text
        _publish(versions, 1, heads[4])  # while that request is in flight
        texts.append(first + "".join(c.choices[0].text for c in chunks if c.choices))
        i = 0
        while server.metrics()["spd_head_version"] != 1:  # the swap comes between two requests
            texts.append(_ask(server, PROMPTS[1 + i % 5]))
            i += 1
            assert i < 200, "v1 never served"
        texts.append(_ask(server, PROMPTS[2], 12))
        (swap,) = _log(server, r"head v\d+ now serves")
        assert swap.rstrip().endswith("head v1 now serves new requests (held-out L'_acc est 1.21 -> 1.30)"), swap
        metrics = server.metrics()
        assert metrics["spd_head_swaps_total"] == 1 and metrics["spd_head_refused_total"] == 0
        assert metrics['spd_mean_accept_length_by_version{version="0"}'] > 0
        assert metrics['spd_mean_accept_length_by_version{version="1"}'] > 0

        _publish(versions, 2, tiny_heads[2])  # a head for another cut (n = 2)
        _until(lambda: server.metrics()["spd_head_refused_total"] == 1, "v2 refused")
        _damaged(versions, 3, versions / "v1")
        _until(lambda: server.metrics()["spd_head_refused_total"] == 2, "v3 refused")
        texts.append(_ask(server, PROMPTS[3]))
        (wrong_cut,) = _log(server, "refused head v2")
        (damaged,) = _log(server, "refused head v3")
        assert "does not fit this target" in wrong_cut and wrong_cut.rstrip().endswith("; v1 keeps serving")
        assert "model.safetensors" in damaged and damaged.rstrip().endswith("; v1 keeps serving")
        assert server.metrics()["spd_head_version"] == 1
    finally:
        server.stop()
    rows = list(read_records(records))
    assert len(rows) == len(texts)
    assert rows[0]["head"] == str(tiny_heads[4]) and len(rows[0]["answer_ids"]) == 120  # in flight at the swap
    assert rows[-1]["head"] == str(versions / "v1")
    _check_greedy(tiny_testbed, rows, texts)

    server = Server(*flags)  # restarted: on the newest version that loads
    try:
        (start,) = _log(server, "listening on")
        assert f"head v1 '{versions / 'v1'}'" in start, start
        assert len(_log(server, "refused head v[23]")) == 2
        out = server.client().completions.create(model=server.model, prompt=PROMPTS[4], max_tokens=8, temperature=0)
        assert out.model_extra["spd"]["head_version"] == 1  # each answer says which version served it
        metrics = server.metrics()
        assert metrics["spd_head_version"] == 1 and metrics["spd_head_swaps_total"] == 0
    finally:
        server.stop()
    rows = list(read_records(records))
    assert rows[-1]["head"] == str(versions / "v1")
    _check_greedy(tiny_testbed, rows[-1:])


def test_a_batched_server_swaps_while_requests_are_in_flight_and_drops_none(tiny_testbed, tiny_heads, heads, tmp_path):
    """Three clients keep a batch of two full; v1 comes while requests are in flight: they finish on v0, later ones
    run on v1, every request is answered with the target's greedy answer."""
    records = tmp_path / "records"
    versions = tmp_path / "versions"
    server = Server(
        "--target", str(tiny_testbed / "target"), "--speculator", str(tiny_heads[4]), "--record", str(records),
        "--head-versions", str(versions), "--max-batch", "2",
    )  # fmt: skip
    texts, errors = [], []
    stop = threading.Event()

    def client(k: int) -> None:
        j = 0
        while not stop.is_set():
            try:
                texts.append(_ask(server, PROMPTS[(k + j) % len(PROMPTS)], 24))
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                errors.append(exc)
            j += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    try:
        for thread in threads:
            thread.start()
        _until(lambda: len(texts) >= 3, "the first answers")
        _publish(versions, 1, heads[4])
        _until(lambda: _log(server, "head v1 now serves"), "the swap")
        done = len(texts)
        _until(lambda: len(texts) >= done + 4, "answers after the swap")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
        metrics = server.metrics()
        server.stop()
    assert not errors, errors
    (swap,) = _log(server, "head v1 now serves")
    in_flight = re.search(r"; (\d+) requests? in flight finish(es)? on v0$", swap.rstrip())
    assert in_flight and int(in_flight.group(1)) >= 1, swap
    assert metrics["spd_head_version"] == 1 and metrics["spd_head_swaps_total"] == 1
    rows = list(read_records(records))
    assert len(rows) == len(texts)  # nothing dropped: every request answered and recorded
    labels = [row["head"] for row in rows]
    assert str(tiny_heads[4]) in labels and labels[-1] == str(versions / "v1")
    _check_greedy(tiny_testbed, rows, texts)


@pytest.mark.slow
def test_the_distributed_runtime_swaps_the_head_on_rank_0(tiny_testbed, tiny_heads, heads, tmp_path):
    records = tmp_path / "records"
    server = Server(
        "--target", str(tiny_testbed / "target"), "--speculator", str(tiny_heads[2]), "--record", str(records),
        "--runtime", "distributed",
    )  # fmt: skip
    try:
        texts = [_ask(server, PROMPTS[0])]
        _publish(records / "heads", 1, heads[2])
        while server.metrics()["spd_head_version"] != 1:
            texts.append(_ask(server, PROMPTS[len(texts) % len(PROMPTS)]))
            assert len(texts) < 200, "v1 never served"
        texts.append(_ask(server, PROMPTS[1], 12))
        assert _log(server, "head v1 now serves new requests")
    finally:
        server.stop()
    rows = list(read_records(records))
    assert rows[0]["head"] == str(tiny_heads[2]) and rows[-1]["head"] == str(records / "heads" / "v1")
    _check_greedy(tiny_testbed, rows, texts)


def test_a_batch_runs_two_heads_while_the_old_one_s_requests_finish(tiny_testbed, tiny_heads, heads):
    """In the library: requests admitted before a head is swapped in keep theirs, later ones get the new one; the
    two heads' memory pools live side by side until the old head's last request leaves; every output is greedy."""
    from spd.decoding.batch import BatchedPipeline
    from spd.decoding.engine import Engine
    from spd.decoding.generation import generate_ar
    from spd.decoding.loader import load_head
    from spd.decoding.spec import DecodingSpec

    engine = Engine.from_pretrained(str(tiny_testbed / "target"), str(tiny_heads[4]))
    staged = engine.staged
    batched = BatchedPipeline(engine, max_batch=4, kv_rows=1024, prefill_chunk=16)
    prompts = [[5 + i, 9, 11 + 3 * i, 4] for i in range(4)]
    old = [batched.submit(p, 16) for p in prompts[:2]]
    for _ in range(6):
        batched.step()
    spec = DecodingSpec("spd", target=str(tiny_testbed / "target"), speculator=str(tiny_heads[4]))
    new_head = load_head(str(heads[4]), spec, staged)
    engine.use_proposer(engine.proposer_for(new_head))
    new = [batched.submit(p, 16) for p in prompts[2:]]
    batched.step()
    assert len(batched.proposer_pools) == 2
    batched.run()
    assert len(batched.proposer_pools) == 1 and batched.proposer_pool is not None
    assert all(r.proposer.head is not new_head for r in old) and all(r.proposer.head is new_head for r in new)
    for prompt, request in zip(prompts, old + new):
        assert request.state == "done"
        differences_are_near_ties(staged, prompt, generate_ar(staged, prompt, 16).token_ids, request.output.token_ids)


def test_adapt_flags_that_cannot_work_stop_the_server_before_it_loads(tiny_testbed, tiny_heads, tmp_path):
    from spd.cli.serve import main

    target = ("--target", str(tiny_testbed / "target"), "--port", "0")
    head = ("--speculator", str(tiny_heads[4]))
    cases = [
        ((*head, "--adapt"), "error: --adapt learns from the server's traffic records; it needs --record DIR"),
        (
            ("--mode", "pp", "--record", str(tmp_path), "--adapt"),
            "error: --adapt swaps new versions of the server's head in; it needs --mode spd or tree with "
            "--speculator HEAD, got --mode pp without --speculator",
        ),
        (
            ("--head-versions", str(tmp_path)),
            "error: --head-versions swaps new versions of the server's head in; it needs --mode spd or tree with "
            "--speculator HEAD, got --mode ar without --speculator",
        ),
        ((*head, "--adapt-every", "10"), "error: --adapt-every sets up the server's spd-adapt; it needs --adapt"),
        (
            (*head, "--record", str(tmp_path), "--adapt", "--adapt-args", "--every 5"),
            "error: --adapt-args sets --every, which the server sets itself; use its --adapt-* flag or leave it out",
        ),
    ]
    for flags, expected in cases:
        proc = run_main(main, *target, *flags)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == expected, (flags, proc.stderr)


@pytest.mark.slow
def test_adapt_runs_spd_adapt_whose_version_is_swapped_in_and_ends_with_the_server(tiny_testbed, tiny_heads, tmp_path):
    records = tmp_path / "records"
    server = Server(
        "--target", str(tiny_testbed / "target"), "--speculator", str(tiny_heads[2]), "--record", str(records),
        "--adapt", "--adapt-every", "40",
        "--adapt-args", "--margin -0.9 --steps 2 --poll 0.2 --heldout-share 0.5 --set lr=3e-3 --set batch_size=4",
    )  # fmt: skip
    killed = False
    try:
        (started,) = _log(server, r"spd-adapt \(pid \d+\) learns from")
        pid = int(re.search(r"pid (\d+)", started).group(1))
        texts = [_ask(server, prompt, 10) for prompt in PROMPTS]  # 60 answer tokens in 6 records: one round
        _until(lambda: _log(server, "head v1 now serves"), "v1 swapped in", 300, 1.0)
        assert _log(server, r"\[spd-adapt\] .* v1 kept: held-out L'_acc est")
        (swap,) = _log(server, "head v1 now serves")
        assert re.search(r"head v1 now serves new requests \(held-out L'_acc est \d\.\d\d -> \d\.\d\d\)", swap), swap
        texts.append(_ask(server, PROMPTS[1], 10))
        metrics = server.metrics()
        assert metrics["spd_head_version"] == 1 and metrics["spd_head_swaps_total"] == 1
        server.proc.send_signal(signal.SIGKILL)  # the child ends with the server, even so
        server.proc.wait()
        killed = True
        _until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), "spd-adapt to end", 60)
    finally:
        if not killed:
            server.stop()
    rows = list(read_records(records))
    assert rows[-1]["head"] == str(records / "heads" / "v1") and rows[0]["head"] == str(tiny_heads[2])
    _check_greedy(tiny_testbed, rows, texts)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
