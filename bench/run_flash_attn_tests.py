"""Run flash-attn's own test cases against flashfuse, through the adapter.

flash-attn's ``tests/test_flash_attn.py`` (not part of this project: pass its
path) imports ``flash_attn``; with ``bench.flash_attn_adapter.install()`` that
name is served by ``flashfuse.attention``. This runner runs a chosen subset of
that file's test functions, by default its soft-capping cases, and prints the
pass/fail counts per test function::

    python bench/run_flash_attn_tests.py PATH/test_flash_attn.py --every 7 --budget 540   # GPU
    python bench/run_flash_attn_tests.py PATH/test_flash_attn.py --collect-only --every 7

Two modes. The direct mode (the default) imports the file with the adapter
installed and calls the test function itself, one case at a time, with its
parameters as keyword arguments: the cases are the cartesian product of the
function's ``pytest.mark.parametrize`` marks (read from ``pytestmark``, the
decorator nearest the function outermost, as pytest orders and names them),
enumerated lazily. ``pytest.skip`` counts as skipped, an ``AssertionError``
raised in the test file (or ``pytest.fail``) as failed, any other exception
(torch's own AssertionErrors included) as an error; the first few of each are
printed with their pytest ids and the line of the test file, and the failures
are broken down by parameter value. Functions that take pytest fixtures fall
back to the pytest mode. ``--procs N`` runs N processes, each taking every
N-th case (the GPU serialises the kernels; this overlaps the host side and
Triton's compiles). ``--pytest`` runs the cases through pytest instead (with
xdist, ``-n``); pytest expands every parametrisation of the function (84,480
for ``test_flash_attn_output``) in every worker before the first case runs,
which can take minutes. The test seeds torch itself (``manual_seed(0)``).

Which cases: soft-capping is a parameter of ``test_flash_attn_output`` and
``test_flash_attn_varlen_output`` only (``softcap`` in 0.0, 50.0, the first
field of their ids, ``dropout_p`` the second). The varlen function needs
flash-attn's packed entry points, which the adapter does not serve, so it is
not selected; the cases with dropout are skipped by the file itself
(softcap with dropout is not supported there), and would need ``S_dmask``
(the dropout pattern), which the op never materialises. So the selection is
``test_flash_attn_output`` with softcap > 0 and ``dropout_p == 0`` (21,120
cases; the pytest mode adds ``-k 50.0``, which the same cases match).
``--functions`` and ``--all-cases`` pick other functions or all their cases.

``--every K`` keeps every K-th selected case (in both modes the same cases):
take K prime to 2, 3, 5 and 11 (7, 13, 17, ...), or the innermost parameters
keep one value (``--collect-only`` lists the values never selected). The run
stops after ``--budget`` seconds and prints the counts so far. Autotuning
is off (``FLASHFUSE_AUTOTUNE=0``, as in bench/run_gpu.sh) unless set. Counts also go
to bench/results/flash_attn_tests.csv (``errors`` is empty in the pytest
mode, which counts errors as failed). The file needs einops; the pytest mode
with ``-n`` needs pytest-xdist.
"""

from __future__ import annotations

import argparse
import collections
import csv
import importlib.util
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOFTCAP_FUNCTIONS = ("test_flash_attn_output",)
# Ids of test_flash_attn_output are "[softcap-dropout_p-seqlen_q-seqlen_k-d-...]";
# "50.0" (softcap 50) appears in no other field.
SOFTCAP_IDS = "50.0"

# ---------------------------------------------------------------------------
# The pytest plugin (loaded with -p in the controller and in every xdist
# worker): flash_attn and the submodules the file imports.


def _not_served(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"flash_attn.{name} is not served by the flashfuse adapter")

    fn.__name__ = name
    return fn


def _install_flash_attn():
    sys.path.insert(0, str(ROOT))
    from bench import flash_attn_adapter

    mod = flash_attn_adapter.install()
    mod.__path__ = []  # a package, so that its submodules import
    for name in ("flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_with_kvcache"):
        setattr(mod, name, _not_served(name))
    subs = {
        "bert_padding": {"pad_input": _not_served("bert_padding.pad_input"),
                         "unpad_input": _not_served("bert_padding.unpad_input")},
        # _get_block_size_n is read only to decode S_dmask (dropout cases).
        "flash_attn_interface": {"_get_block_size_n": _not_served("flash_attn_interface._get_block_size_n"),
                                 "USE_TRITON_ROCM": False},
        "layers": {},
        "layers.rotary": {"apply_rotary_emb": _not_served("layers.rotary.apply_rotary_emb")},
    }
    for sub, attrs in subs.items():
        m = types.ModuleType(f"flash_attn.{sub}")
        m.__path__ = []
        for k, v in attrs.items():
            setattr(m, k, v)
        sys.modules[m.__name__] = m
        parent, _, leaf = m.__name__.rpartition(".")
        setattr(sys.modules[parent], leaf, m)


def pytest_configure(config):
    import torch

    _install_flash_attn()
    if not torch.cuda.is_available() and config.getoption("collectonly"):
        # The file reads the device's compute capability when imported;
        # collecting it without a GPU pretends to be an H100/H200 (sm90).
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("FLASHFUSE_FA_SOFTCAP") == "1":
        # The -k expression keeps the ids that name softcap 50; this keeps
        # exactly those with softcap > 0 and no dropout, by parameter value.
        def wanted(item):
            return wanted_softcap(getattr(getattr(item, "callspec", None), "params", {}))

        kept = [it for it in items if wanted(it)]
        config.hook.pytest_deselected(items=[it for it in items if not wanted(it)])
        items[:] = kept
    every = int(os.environ.get("FLASHFUSE_FA_EVERY", "1"))
    if every > 1:
        config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i % every])
        items[:] = items[::every]


def pytest_runtest_logreport(report):
    # Counts per test function, in the controller (xdist sends the workers'
    # reports there); written after each case, so an interrupted run keeps them.
    path = os.environ.get("FLASHFUSE_FA_COUNTS")
    if not path or getattr(sys.modules[__name__], "_is_worker", False):
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        fn = report.nodeid.split("::")[-1].split("[")[0]
        outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
        _COUNTS[fn][outcome] += 1
        if outcome == "failed" and len(_FIRST_FAILURES) < 5:
            _FIRST_FAILURES.append(f"{report.nodeid}: {str(report.longrepr).splitlines()[-1][:200]}")
        with open(path, "w") as f:
            json.dump({"counts": _COUNTS, "failures": _FIRST_FAILURES}, f)


def pytest_sessionstart(session):
    sys.modules[__name__]._is_worker = hasattr(session.config, "workerinput")


_COUNTS: dict = collections.defaultdict(lambda: collections.Counter())
_FIRST_FAILURES: list = []

# ---------------------------------------------------------------------------
# The direct mode: the test function called in this process, one case at a
# time. pytest would first expand every parametrisation of the function (84k
# for test_flash_attn_output) in every worker; here they are enumerated lazily
# from the function's own parametrize marks.


class Unsupported(Exception):
    """The function needs something the direct mode does not provide (a
    fixture, indirect parametrisation): run it in the pytest mode."""


def _value_id(val, argname: str, idx: int) -> str:
    # pytest's rule for ids it makes from values (IdMaker._idval_from_value):
    # primitives and named objects by value/name, others as argname + index.
    import enum
    import re

    if isinstance(val, bytes):
        return val.decode("ascii", "backslashreplace")
    if isinstance(val, str):
        return val.encode("unicode_escape").decode("ascii")
    if val is None or isinstance(val, (float, int, bool, complex)):
        return str(val)
    if isinstance(val, re.Pattern):
        return val.pattern
    if isinstance(val, enum.Enum):
        return str(val)
    if isinstance(getattr(val, "__name__", None), str):
        return val.__name__
    return f"{argname}{idx}"


def parametrization(fn) -> list[tuple[list[str], list[tuple[tuple, str, bool]]]]:
    """The function's ``pytest.mark.parametrize`` marks, in pytest's order (the
    decorator nearest the function first): ``[(argnames, [(values, id,
    skip), ...]), ...]``. Their cartesian product, first mark outermost, is
    pytest's list of cases. Raises Unsupported for what only pytest can do."""
    from _pytest.mark.structures import ParameterSet

    marks = list(getattr(fn, "pytestmark", []))
    out = []
    for m in marks:
        if m.name in ("usefixtures",):
            raise Unsupported(f"{fn.__name__} uses fixtures {m.args}")
        if m.name != "parametrize":
            continue
        kw = dict(m.kwargs)
        argnames = m.args[0] if m.args else kw.pop("argnames")
        argvalues = m.args[1] if len(m.args) > 1 else kw.pop("argvalues")
        if kw.get("indirect"):
            raise Unsupported(f"{fn.__name__}: indirect parametrisation of {argnames}")
        names = [n.strip() for n in argnames.split(",") if n.strip()] if isinstance(argnames, str) else list(argnames)
        ids = kw.get("ids")
        rows = []
        for idx, v in enumerate(argvalues):
            marks_v, pid = (), None
            if isinstance(v, ParameterSet):
                v, marks_v, pid = v.values, v.marks, v.id
            elif len(names) == 1:
                v = (v,)
            v = tuple(v)
            if len(v) != len(names):
                raise Unsupported(f"{fn.__name__}: {argnames} value {idx} has {len(v)} fields")
            if pid is None and ids is not None:
                given = ids(v[0] if len(names) == 1 else v) if callable(ids) else list(ids)[idx]
                pid = None if given is None else str(given)
            if pid is None:
                pid = "-".join(_value_id(x, n, idx) for x, n in zip(v, names))
            skip = any(getattr(mk, "name", "") == "skip" or (getattr(mk, "name", "") == "skipif"
                                                            and mk.args and mk.args[0] is True) for mk in marks_v)
            rows.append((v, pid, skip))
        out.append((names, rows))
    return out


def check_signature(fn, params) -> None:
    """Raises Unsupported when the function takes arguments that no
    parametrize mark provides (pytest fixtures)."""
    import inspect

    given = {n for names, _ in params for n in names}
    missing = [p.name for p in inspect.signature(fn).parameters.values()
               if p.name not in given and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise Unsupported(f"{fn.__name__} takes pytest fixtures {missing}")


def wanted_softcap(kwargs: dict) -> bool:
    # The same rule as the pytest mode's selection (by parameter value).
    return kwargs.get("softcap", 0) > 0 and kwargs.get("dropout_p", 0) == 0


def iter_cases(params, every: int = 1, softcap_only: bool = True, shard: tuple[int, int] = (0, 1)):
    """Yields ``(id, kwargs, skip)`` lazily, in pytest's order: the selected
    cases (soft-capping ones unless ``softcap_only`` is False), every
    ``every``-th of them, then every ``shard[1]``-th of those from ``shard[0]``."""
    names = [ns for ns, _ in params]
    k = 0
    for combo in itertools.product(*[rows for _, rows in params]):
        kwargs = {}
        for ns, (vals, _, _) in zip(names, combo):
            kwargs.update(zip(ns, vals))
        if softcap_only and not wanted_softcap(kwargs):
            continue
        k += 1
        if (k - 1) % every:
            continue
        j = (k - 1) // every
        if j % shard[1] != shard[0]:
            continue
        yield "-".join(pid for _, pid, _ in combo), kwargs, any(s for _, _, s in combo)


def load_test_module(test_file: pathlib.Path):
    """Imports flash-attn's test file with the adapter serving ``flash_attn``."""
    import torch

    _install_flash_attn()
    if not torch.cuda.is_available():
        # The file reads the device's compute capability when imported;
        # without a GPU it is imported as on an H100/H200 (sm90): its cases
        # then raise (counted as errors), so the enumeration can be checked.
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    sys.path.insert(0, str(test_file.parent))  # as pytest's rootdir import would
    spec = importlib.util.spec_from_file_location(test_file.stem, test_file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[test_file.stem] = mod
    try:
        spec.loader.exec_module(mod)
    except ModuleNotFoundError as e:
        # flash-attn's file imports einops, for one.
        sys.exit(f"{test_file.name} imports {e.name}: install it or put it on PYTHONPATH")
    return mod


def _where(exc: BaseException, test_file) -> str:
    # The last line of the test file on the way to the exception: plain
    # asserts carry no message outside pytest (no assertion rewriting).
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    msg = str(exc).strip().splitlines()
    msg = msg[-1][:160] if msg else ""
    for fr in reversed(frames):
        if os.path.realpath(fr.filename) == os.path.realpath(test_file):
            return f"{type(exc).__name__} at line {fr.lineno}: {(fr.line or '').strip()[:120]} {msg}".rstrip()
    return f"{type(exc).__name__}: {msg}"


def _is_test_assertion(exc: BaseException, test_file) -> bool:
    """A failed check of the test itself: pytest.fail, or an AssertionError
    raised in the test file (torch raises AssertionError too, e.g. "Torch not
    compiled with CUDA enabled": that is an error, not a failed case)."""
    import traceback

    import pytest

    if isinstance(exc, pytest.fail.Exception):
        return True
    if not isinstance(exc, AssertionError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.realpath(frames[-1].filename) == os.path.realpath(test_file)


def run_direct(test_file, functions, every, budget, softcap_only=True, shard=(0, 1), n_first=5) -> dict:
    """Runs the cases in this process; returns counts, first failures and
    per-parameter tallies (JSON-able)."""
    import contextlib
    import io

    import pytest
    import torch

    mod = load_test_module(test_file)
    res = {"counts": {}, "failures": [], "errors": [], "error_kinds": {}, "by_param": {}, "timed_out": False}
    start = time.time()
    for fn_name in functions:
        fn = getattr(mod, fn_name)
        params = parametrization(fn)
        check_signature(fn, params)
        counts = res["counts"].setdefault(fn_name, dict(passed=0, failed=0, skipped=0, error=0))
        by_param = res["by_param"].setdefault(fn_name, {})
        for case_id, kwargs, skip in iter_cases(params, every, softcap_only, shard):
            if time.time() - start > budget:
                res["timed_out"] = True
                break
            outcome, exc = "passed", None
            try:
                if skip:
                    raise pytest.skip.Exception("skip mark")
                # The test prints diffs; pytest would capture them.
                with contextlib.redirect_stdout(io.StringIO()):
                    fn(**kwargs)
            except pytest.skip.Exception:
                outcome = "skipped"
            except KeyboardInterrupt:
                res["timed_out"] = True
                break
            except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - a case's crash is its result
                exc = e
                outcome = "failed" if _is_test_assertion(e, test_file) else "error"
            if outcome == "failed":
                if len(res["failures"]) < n_first:
                    res["failures"].append(f"{fn_name}[{case_id}]: {_where(exc, test_file)}")
            elif outcome == "error":
                kind = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:100]}"
                res["error_kinds"][kind] = res["error_kinds"].get(kind, 0) + 1
                if len(res["errors"]) < n_first:
                    res["errors"].append(f"{fn_name}[{case_id}]: {_where(exc, test_file)}")
            if exc is not None:
                exc = None  # its traceback holds the case's tensors
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # after an out-of-memory case, for the next
            counts[outcome] += 1
            if outcome != "skipped":
                for name, val in kwargs.items():
                    t = by_param.setdefault(name, {}).setdefault(str(val), [0, 0])
                    t[0] += 1
                    t[1] += outcome != "passed"
        if res["timed_out"]:
            break
    res["seconds"] = time.time() - start
    return res


# ---------------------------------------------------------------------------
# The runner.


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", help="flash-attn's tests/test_flash_attn.py")
    ap.add_argument("--functions", nargs="+", default=list(SOFTCAP_FUNCTIONS), help="test functions to run")
    ap.add_argument("--all-cases", action="store_true", help="all ids of the functions, not only soft-capping")
    ap.add_argument("--every", type=int, default=1, help="keep every K-th selected case")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds before the run stops")
    ap.add_argument("--collect-only", action="store_true", help="count the cases without running them")
    ap.add_argument("--csv", default=str(ROOT / "bench" / "results" / "flash_attn_tests.csv"))
    ap.add_argument("--procs", type=int, default=1,
                    help="direct mode: processes, each running every N-th case (default 1: the GPU serialises)")
    ap.add_argument("--pytest", action="store_true", help="run through pytest instead (slow: it collects "
                    "every parametrisation of the functions first, in every xdist worker)")
    ap.add_argument("-k", dest="extra_k", default=None, help="pytest mode: a further -k expression, and-ed")
    ap.add_argument("-n", dest="workers", default=None, help="pytest mode: xdist workers (default 12 when installed)")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "I/N:PATH", a --procs child
    args = ap.parse_args(argv)
    if args.every < 1 or args.procs < 1:
        ap.error("--every and --procs must be >= 1")

    test_file = pathlib.Path(args.test_file).resolve()
    if not test_file.is_file():
        sys.exit(f"no such test file: {test_file}")
    # As bench/run_gpu.sh: the first config that fits, one compile per kernel
    # variant; autotuning would time every candidate for each of the cases'
    # many (head dim, dtype, flags) keys. FLASHFUSE_AUTOTUNE=1 to tune.
    os.environ.setdefault("FLASHFUSE_AUTOTUNE", "0")
    if not args.shard:
        print(f"FLASHFUSE_AUTOTUNE={os.environ['FLASHFUSE_AUTOTUNE']}", flush=True)

    if args.shard:
        which, _, path = args.shard.partition(":")
        i, n = (int(x) for x in which.split("/"))
        res = run_direct(test_file, args.functions, args.every, args.budget, not args.all_cases, (i, n))
        with open(path, "w") as f:
            json.dump(res, f)
        return 0
    if not args.pytest:
        if args.extra_k or args.workers:
            ap.error("-k and -n are options of the pytest mode (--pytest)")
        try:
            return _main_direct(args, test_file)
        except Unsupported as e:
            print(f"direct mode cannot run this: {e}; falling back to the pytest mode", flush=True)
    return _main_pytest(args, test_file)


def _main_direct(args, test_file) -> int:
    mod = load_test_module(test_file)
    n_cases = {}
    start = time.time()
    for fn_name in args.functions:
        fn = getattr(mod, fn_name, None)
        if fn is None:
            sys.exit(f"{test_file.name} has no function {fn_name}")
        params = parametrization(fn)
        check_signature(fn, params)  # raises Unsupported: the caller falls back to pytest
        if args.collect_only:
            first = []
            n = 0
            seen = collections.defaultdict(set)
            for case_id, kwargs, _ in iter_cases(params, args.every, not args.all_cases):
                n += 1
                if len(first) < 3:
                    first.append(case_id)
                for name, val in kwargs.items():
                    seen[name].add(str(val))
            n_cases[fn_name] = n
            print(f"{fn_name}: {n} cases; first: {', '.join(first)}")
            # A K that shares a factor with the inner parameters' counts skips
            # some of their values altogether (pick K prime to them).
            for names, rows in params:
                for j, name in enumerate(names):
                    if name in ("softcap", "dropout_p") and not args.all_cases:
                        continue  # fixed by the selection
                    missed = sorted({str(r[0][j]) for r in rows} - seen[name])
                    if missed and n:
                        print(f"  never selected: {name} = {', '.join(missed)}")
    if args.collect_only:
        print(f"total: {sum(n_cases.values())} cases enumerated in {time.time() - start:.1f} s")
        return 0 if sum(n_cases.values()) else 1

    if args.procs == 1:
        res = run_direct(test_file, args.functions, args.every, args.budget, not args.all_cases)
    else:
        res = _run_procs(args, test_file)
    elapsed = time.time() - start
    note = f"interrupted after the {args.budget:.0f} s budget" if res["timed_out"] else "complete"
    return _report(args, res["counts"], note, elapsed, res)


def _run_procs(args, test_file) -> dict:
    """--procs N: N copies of this script, the I-th running every N-th case
    from the I-th; their results merged."""
    tmp = tempfile.mkdtemp(prefix="fa_direct_")
    base = [sys.executable, str(pathlib.Path(__file__).resolve()), str(test_file), "--functions", *args.functions,
            "--every", str(args.every), "--budget", str(args.budget)] + (["--all-cases"] if args.all_cases else [])
    procs = [subprocess.Popen(base + ["--shard", f"{i}/{args.procs}:{tmp}/{i}.json"], cwd=str(ROOT))
             for i in range(args.procs)]
    for p in procs:
        p.wait()
    merged = {"counts": {}, "failures": [], "errors": [], "error_kinds": {}, "by_param": {}, "timed_out": False}
    for i, p in enumerate(procs):
        path = os.path.join(tmp, f"{i}.json")
        if not os.path.exists(path):
            merged["errors"].append(f"process {i} wrote no results (exit status {p.returncode})")
            merged["timed_out"] = True  # incomplete
            continue
        with open(path) as f:
            r = json.load(f)
        os.unlink(path)
        for fn, c in r["counts"].items():
            m = merged["counts"].setdefault(fn, collections.Counter())
            m.update(c)
        merged["failures"] += r["failures"]
        merged["errors"] += r["errors"]
        for k, v in r["error_kinds"].items():
            merged["error_kinds"][k] = merged["error_kinds"].get(k, 0) + v
        for fn, names in r["by_param"].items():
            for name, vals in names.items():
                for val, (n, bad) in vals.items():
                    t = merged["by_param"].setdefault(fn, {}).setdefault(name, {}).setdefault(val, [0, 0])
                    t[0] += n
                    t[1] += bad
        merged["timed_out"] |= r["timed_out"]
    os.rmdir(tmp)
    merged["failures"] = merged["failures"][:5]
    merged["errors"] = merged["errors"][:5]
    return merged


def _report(args, counts, note, elapsed, res=None) -> int:
    """Prints the table (and, for the direct mode, the failures by parameter)
    and writes the CSV; returns the exit status."""
    direct = res is not None
    print(f"\n{'function':32} {'passed':>8} {'failed':>8} {'skipped':>8}" + (f" {'error':>8}" if direct else ""))
    rows = []
    for fn, c in sorted(counts.items()):
        rows.append([fn, c.get("passed", 0), c.get("failed", 0), c.get("skipped", 0), c.get("error", 0) if direct else ""])
        print(f"{fn:32} {rows[-1][1]:>8} {rows[-1][2]:>8} {rows[-1][3]:>8}" + (f" {rows[-1][4]:>8}" if direct else ""))
    n_run = sum(r[1] + r[2] + (r[4] or 0) for r in rows)
    per_case = f", {elapsed / n_run:.2f} s per case run" if direct and n_run else ""
    procs = f", {args.procs} processes" if direct and args.procs > 1 else ""
    print(f"{elapsed:.0f} s, {note}; every {args.every}-th case{procs}{per_case}")
    if direct:
        for fn, names in sorted(res["by_param"].items()):
            bad = {name: vals for name, vals in names.items() if any(b for _, b in vals.values())}
            if bad:
                print(f"{fn}: failed or error / run, by parameter value")
            for name, vals in bad.items():
                print(f"  {name:>14}: " + "  ".join(f"{v} {b}/{n}" for v, (n, b) in vals.items()))
        for kind, n in sorted(res["error_kinds"].items(), key=lambda x: -x[1]):
            print(f"  {n:>6} x {kind}")
        for f in res["errors"]:
            print("  ERROR", f)
        for f in res["failures"]:
            print("  FAILED", f)
    import torch

    import common  # bench/common.py: the version columns every CSV carries

    env = common.env_info(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    pathlib.Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["function", "passed", "failed", "skipped", "seconds", "every", "status", "errors", "mode",
                    *env])
        for r in rows:
            w.writerow(r[:4] + [round(elapsed), args.every, note, r[4], "direct" if direct else "pytest",
                                *env.values()])
    return 0 if rows and not any(r[2] or r[4] for r in rows) else 1


def _main_pytest(args, test_file) -> int:
    if importlib.util.find_spec("einops") is None:
        sys.exit("flash-attn's test file imports einops: install it or put it on PYTHONPATH")
    # Node ids per function: collecting only them is much faster than the
    # whole file (half a million cases).
    cmd = [sys.executable, "-m", "pytest", *[f"{test_file}::{fn}" for fn in args.functions],
           "-p", "bench.run_flash_attn_tests", "-o", "addopts=", "-p", "no:cacheprovider",
           "--rootdir", str(test_file.parent), "-q"]
    k = [] if args.all_cases else [SOFTCAP_IDS]
    if args.extra_k:
        k.append(f"({args.extra_k})")
    if k:
        cmd += ["-k", " and ".join(k)]
    if args.collect_only:
        cmd += ["--collect-only"]
    else:
        workers = args.workers
        if workers is None and importlib.util.find_spec("xdist") is not None:
            workers = "12"
        if workers not in (None, "0"):
            cmd += ["-n", workers]
        cmd += ["--tb=line", "-W", "ignore"]

    counts_file = tempfile.NamedTemporaryFile(prefix="fa_counts_", suffix=".json", delete=False).name
    env = dict(os.environ, FLASHFUSE_FA_EVERY=str(args.every), FLASHFUSE_FA_COUNTS=counts_file,
               FLASHFUSE_FA_SOFTCAP="0" if args.all_cases else "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timed_out = False
    lines = collections.deque(maxlen=15)
    n_collected = collections.Counter()
    try:
        for line in proc.stdout:
            if args.collect_only:
                if "::" in line:
                    n_collected[line.split("::")[-1].split("[")[0]] += 1
                else:
                    lines.append(line.rstrip())
            else:
                lines.append(line.rstrip())
            if time.time() - start > args.budget and not timed_out:
                timed_out = True
                proc.send_signal(signal.SIGINT)
    finally:
        proc.wait()
    elapsed = time.time() - start

    if args.collect_only:
        for fn, n in sorted(n_collected.items()):
            print(f"{fn}: {n} cases")
        print(f"total: {sum(n_collected.values())} cases collected in {elapsed:.1f} s")
        print("\n".join(x for x in lines if x))
        return 0 if n_collected else 1

    data = {"counts": {}, "failures": []}
    if os.path.getsize(counts_file):
        with open(counts_file) as f:
            data = json.load(f)
    os.unlink(counts_file)
    print("\n".join(lines))
    note = f"interrupted after the {args.budget:.0f} s budget" if timed_out else "complete"
    status = _report(args, data["counts"], note, elapsed)
    for f in data["failures"]:
        print("  FAILED", f)
    return status


if __name__ == "__main__":
    sys.exit(main())
