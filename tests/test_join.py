"""The job a server publishes for its stage machines (spd/runtime/join.py), over a real store on loopback; the whole
path across machines (spd-serve --local-stages with spd-stage) runs in test_multinode.py."""

import datetime
import json

import pytest

from spd.errors import SpdInputError
from spd.runtime.join import JOB_KEY, StageJob, claim_stages, parse_address, publish_job, read_job
from spd.runtime.world import bound_store, free_port


@pytest.mark.parametrize(
    "text, want",
    [
        ("10.0.0.1", ("10.0.0.1", 29500)),
        ("10.0.0.1:1234", ("10.0.0.1", 1234)),
        ("host-a:80", ("host-a", 80)),
        ("[fd00::1]:29501", ("fd00::1", 29501)),
        ("[fd00::1]", ("fd00::1", 29500)),
        ("fd00::1", ("fd00::1", 29500)),
    ],
)
def test_addresses(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["", ":29500", "10.0.0.1:", "10.0.0.1:x", "10.0.0.1:70000", "[fd00::1]x"])
def test_bad_addresses_are_one_sentence(text):
    with pytest.raises(SpdInputError, match="is not an address; expected HOST or HOST:PORT"):
        parse_address(text)


def test_a_published_job_is_read_and_its_stages_claimed_once():
    port = free_port()
    store = bound_store("127.0.0.1", port, 2, datetime.timedelta(seconds=10), wait_for_workers=False)
    job = StageJob(stages=4, boundaries=[0, 2, 4, 6, 8], remote=[3, 4], emulate_stage_ms=5.0)
    publish_job(store, job)
    client, got = read_job("127.0.0.1", port, 10)
    assert got == job
    assert got.stage_command("t", None)[-2:] == ["--threads", "1"] and "--boundaries" in got.stage_command("t", None)
    env = got.stage_env("10.0.0.1", port, 4, 1, 2, env={})
    assert env == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "5",
        "RANK": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    with pytest.raises(SpdInputError, match="stage 2 is not one that this job's other machines run"):
        claim_stages(client, got, [2])
    assert claim_stages(client, got, [4]) == [4]
    with pytest.raises(SpdInputError, match="stage 4 is already run by another machine"):
        claim_stages(client, got, None)


def test_a_job_that_is_not_ours_is_refused_in_one_sentence():
    port = free_port()
    store = bound_store("127.0.0.1", port, 2, datetime.timedelta(seconds=10), wait_for_workers=False)
    store.set(JOB_KEY, json.dumps({"stages": 4, "boundaries": [0, 8], "remote": [3]}))  # a cut of 1 stage for 4
    with pytest.raises(SpdInputError, match="offered a job this spd .* cannot read"):
        read_job("127.0.0.1", port, 5)
