"""The SPD authors' released heads and their tiny targets in tests/fixtures/authors (see its README)."""

import json
from pathlib import Path

import torch

from conftest import REPO
from spd.target.staging import StagedModel

FIXTURES = REPO / "tests" / "fixtures" / "authors"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def staged_target(target: str, n: int) -> StagedModel:
    return StagedModel.from_pretrained(FIXTURES / EXPECTED["targets"][target]["path"], n_stages=n, dtype=torch.float32)


def head_file(name: str) -> Path:
    return FIXTURES / EXPECTED["heads"][name]["path"]
