"""bench/run_flash_attn_tests.py, its direct mode: the cases it enumerates
from a function's parametrize marks are pytest's, in pytest's order and with
pytest's ids, and a case's outcome is counted as pytest would (skip, failed
check, error). On a small stand-in for flash-attn's test file."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "run_flash_attn_tests", os.path.join(ROOT, "bench", "run_flash_attn_tests.py"))
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

# Stacked marks, a two-name mark, values without a readable id, pytest.param
# with an id, an ids= list; the body gives each outcome in the softcap cases.
CASES = textwrap.dedent('''
    import unittest

    import pytest


    class Opaque:
        pass


    OBJ = Opaque()


    @pytest.mark.parametrize("flag", [True, False])
    @pytest.mark.parametrize("obj", [OBJ, "s"])
    @pytest.mark.parametrize("a,b", [(1, 2), pytest.param(3, 4, id="three")])
    @pytest.mark.parametrize("dropout_p", [0.0, 0.5])
    @pytest.mark.parametrize("softcap", [0.0, 50.0], ids=["nocap", "cap"])
    def test_case(softcap, dropout_p, a, b, obj, flag):
        if flag and obj == "s":
            pytest.skip("skipped")
        if a == 3 and flag:
            assert softcap < 0  # the test's own check: failed
        if a == 3:
            raise ValueError("boom")  # error
        if obj is OBJ and not flag:
            unittest.TestCase().assertTrue(False)  # AssertionError outside the file: error


    def test_fixture(tmp_path):
        pass
''')


def _load(path):
    spec = importlib.util.spec_from_file_location("test_fa_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cases_are_pytests_in_its_order(tmp_path):
    path = tmp_path / "test_fa_cases.py"
    path.write_text(CASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", f"{path}::test_case", "-o", "addopts=",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    pytest_ids = [line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line]
    assert len(pytest_ids) == 32, proc.stdout + proc.stderr
    fn = _load(path).test_case
    params = runner.parametrization(fn)
    ids = [f"test_case[{i}]" for i, _, _ in runner.iter_cases(params, softcap_only=False)]
    assert ids == pytest_ids
    # --every K (3: prime to none of the counts) and the shards of --procs.
    assert [f"test_case[{i}]" for i, _, _ in runner.iter_cases(params, 3, False)] == pytest_ids[::3]
    shards = [[i for i, _, _ in runner.iter_cases(params, 3, False, (s, 2))] for s in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(i[10:-1] for i in pytest_ids[::3])
    # The soft-capping selection, by value: softcap > 0, no dropout.
    sel = list(runner.iter_cases(params))
    assert len(sel) == 8 and all(kw["softcap"] == 50.0 and kw["dropout_p"] == 0.0 for _, kw, _ in sel)
    assert sel[0][0] == "cap-0.0-1-2-obj0-True"


def test_fixtures_are_refused(tmp_path):
    path = tmp_path / "test_fa_cases.py"
    path.write_text(CASES)
    fn = _load(path).test_fixture
    with pytest.raises(runner.Unsupported, match="tmp_path"):
        runner.check_signature(fn, runner.parametrization(fn))


def test_direct_run_counts_outcomes(tmp_path):
    path = tmp_path / "test_fa_cases.py"
    path.write_text(CASES)
    out_csv = tmp_path / "out.csv"
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "run_flash_attn_tests.py"), str(path), "--functions",
         "test_case", "--csv", str(out_csv)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # it has failures
    (row,) = list(csv.DictReader(open(out_csv)))
    got = {k: row[k] for k in ("passed", "failed", "skipped", "errors", "mode", "status")}
    assert got == dict(passed="2", failed="1", skipped="2", errors="3", mode="direct", status="complete"), proc.stdout
    assert row["gpu"].startswith("cpu") and row["torch_version"] and row["triton_version"] and row["date"]
    assert "test_case[cap-0.0-three-obj0-True]: AssertionError at line" in proc.stdout
    assert "ValueError: boom" in proc.stdout
