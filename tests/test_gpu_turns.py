"""The GPU tests' turns (tests/gpu_turns.py), checked on the CPU: shared
turns coexist, an exclusive one excludes every other."""

import fcntl
import os

import pytest

from tests.gpu_turns import gpu_turn


def _can_lock(path, how) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def test_shared_turns_coexist_and_exclude_an_alone_one(tmp_path):
    path = str(tmp_path / "turns.lock")
    with gpu_turn(False, path):
        assert _can_lock(path, fcntl.LOCK_SH)
        assert not _can_lock(path, fcntl.LOCK_EX)
    assert _can_lock(path, fcntl.LOCK_EX)


def test_an_alone_turn_excludes_every_other(tmp_path):
    path = str(tmp_path / "turns.lock")
    with gpu_turn(True, path):
        assert not _can_lock(path, fcntl.LOCK_SH)
        assert not _can_lock(path, fcntl.LOCK_EX)
    assert _can_lock(path, fcntl.LOCK_SH)


def test_the_turn_ends_when_the_test_fails(tmp_path):
    path = str(tmp_path / "turns.lock")
    with pytest.raises(RuntimeError):
        with gpu_turn(True, path):
            raise RuntimeError("a failing test")
    assert _can_lock(path, fcntl.LOCK_EX)


def test_big_gpu_tests_are_marked(pytestconfig):
    """The tests run 25 measured at 8-34 GB of peak allocation, and the
    2M-token test, carry the marker (so they run alone)."""
    import ast
    import pathlib

    root = pathlib.Path(pytestconfig.rootpath)
    wanted = {"tests/test_backend.py": "test_gpu_symbolic_head_dims_and_head_counts_recompile_instead_of_failing",
              "tests/kernels/test_forward.py": "test_gpu_long_sequence_int64_offsets"}
    for rel, name in wanted.items():
        tree = ast.parse((root / rel).read_text())
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        assert any("gpu_alone" in ast.unparse(d) for d in fn.decorator_list), name
    text = (root / "tests/kernels/test_decode.py").read_text()
    assert text.count("marks=pytest.mark.gpu_alone") == 3
