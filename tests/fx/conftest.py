"""Fixtures for the graph-pass tests (helpers live in fxutil.py)."""

import pytest


@pytest.fixture(autouse=True)
def _graph_pass_setup(blockwise_cpu, fresh_dynamo):
    """Every graph-pass test: the op's fast blockwise CPU path (the kernels
    are tested in tests/kernels) and a fresh Dynamo."""
