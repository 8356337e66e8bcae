"""Test-wide setup.

Without a GPU the Triton kernels are tested through Triton's interpreter, which
must be switched on before any kernel is defined, hence before flashfuse is
imported. Tests that want the fast blockwise CPU path instead set
TRITON_INTERPRET=0 for their duration (the op re-reads it at call time).
"""

import contextlib
import os

import pytest

try:
    import torch

    _has_cuda = torch.cuda.is_available()
    _has_torch = True
except ImportError:  # pragma: no cover
    _has_cuda = _has_torch = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests need correct kernels, not the fastest config: skip autotuning, which
# would benchmark every candidate for each of the many small shapes.
os.environ.setdefault("FLASHFUSE_AUTOTUNE", "0")
# Tests that autotune must time their candidates, and must not leave tuned
# configs in the user's cache: the on-disk tuning cache is off unless a test
# points it at a file of its own.
os.environ.setdefault("FLASHFUSE_TUNING_CACHE", "0")

# Under pytest-xdist each worker process takes one core (CI has two): one
# intra-op thread per worker, so the workers do not compete for cores.
if os.environ.get("PYTEST_XDIST_WORKER") and _has_torch:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """GPU tests under pytest-xdist take turns (``tests/gpu_turns.py``): a
    ``gpu_alone`` test runs while no other GPU test does, and each GPU test
    hands its cached memory back to the driver when done, so that the
    workers beside it can allocate. With FLASHFUSE_GPU_MEMORY_LOG=FILE,
    each GPU test's peak CUDA allocation is appended to FILE as ``<MiB>
    <test id>`` (one line per test; workers append to the same file), so
    that the tests that need most memory can be found and marked."""
    if not (_has_cuda and "gpu" in item.keywords):
        yield
        return
    from tests.gpu_turns import gpu_turn

    path = os.environ.get("FLASHFUSE_GPU_MEMORY_LOG")
    shared = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    with gpu_turn("gpu_alone" in item.keywords) if shared else contextlib.nullcontext():
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            if path:
                peak = torch.cuda.max_memory_allocated() / 2**20
                with open(path, "a") as f:
                    f.write(f"{peak:.0f} {item.nodeid}\n")
            if shared:
                torch.cuda.empty_cache()


@pytest.fixture
def blockwise_cpu(monkeypatch):
    """Run the op's CPU tensors through the blockwise PyTorch path."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def fresh_dynamo():
    """Reset Dynamo's caches around a test, so compile counts and rewrites
    seen by one test do not leak into the next."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
