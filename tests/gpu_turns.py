"""Turns on the GPU for tests that pytest-xdist workers run side by side.

Each worker holds its own CUDA caching allocator, so a test that needs tens
of GB (a 32k-key static cache, a 2M-token sequence, a compile that keeps
many graphs alive) makes the tests beside it fail on allocation when the
card is shared with five or more workers (bench/NOTES.md runs 23, 24, 27).
Tests marked ``gpu_alone`` therefore run while no other GPU test does: every
GPU test holds a shared lock on one file for its call, a ``gpu_alone`` test
an exclusive one. The lock is ``flock`` on a file named by
``FLASHFUSE_GPU_TEST_LOCK`` or in the temporary directory, so every worker
of a run (and any other run by the same user) takes turns on it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no turns
    fcntl = None


def lock_path() -> str:
    return os.environ.get("FLASHFUSE_GPU_TEST_LOCK") or os.path.join(
        tempfile.gettempdir(), f"flashfuse-gpu-tests-{os.getuid()}.lock")


@contextlib.contextmanager
def gpu_turn(alone: bool, path: str | None = None):
    """Hold the GPU for a test's call: exclusively when ``alone``, else
    shared with other tests that are not."""
    if fcntl is None:
        yield
        return
    fd = os.open(path or lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
