"""Fixtures only (shared helpers live in helpers.py)."""

from __future__ import annotations

import zlib

import pytest
import torch

from helpers import BASE_SEED

torch.set_num_threads(2)


def pytest_report_header() -> str:
    return f"causal_attention: CA_TEST_SEED={BASE_SEED}"


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ BASE_SEED)
