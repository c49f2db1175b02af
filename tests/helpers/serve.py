"""spd-serve in its own process on a free port, with the clients the tests use, and spd-generate's JSON to compare
its answers with. Importing this module skips the importing test (or module) when openai is not installed."""

import json

import httpx
import pytest

from conftest import REPO
from helpers.cli import spd_generate_main
from spd.testing.server import ServerProcess

openai = pytest.importorskip("openai")

PROMPT = "def main(argv):\n"


class Server(ServerProcess):
    """``spd-serve`` in its own process on a free port, with the clients the tests use."""

    def __init__(self, *args: str, **kwargs):
        super().__init__(*args, cwd=REPO, **kwargs)

    def client(self, **kwargs):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(
            f"{self.url}{path}", content=data, headers={"content-type": "application/json"}, timeout=120, **kwargs
        )

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name and labels, e.g. 'spd_requests_total{endpoint="chat",outcome="ok"}'."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples


def cli_json(tiny_testbed, *args: str) -> dict:
    """spd-generate's JSON for ``args`` (its main in this process: the reference a server's answer must equal)."""
    proc = spd_generate_main("--target", str(tiny_testbed / "target"), "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
