"""Run flash-attn's own test cases against flashfuse, through the adapter.

flash-attn's ``tests/test_flash_attn.py`` (not part of this project: pass its
path) imports ``flash_attn``; with ``bench.flash_attn_adapter.install()`` that
name is served by ``flashfuse.attention``. This runner runs a chosen subset of
that file's test functions through pytest, by default its soft-capping cases,
and prints the pass/fail counts per test function::

    python bench/run_flash_attn_tests.py PATH/test_flash_attn.py            # GPU
    python bench/run_flash_attn_tests.py PATH/test_flash_attn.py --collect-only

Which cases: soft-capping is a parameter of ``test_flash_attn_output`` and
``test_flash_attn_varlen_output`` only (``softcap`` in 0.0, 50.0, the first
field of their ids, ``dropout_p`` the second). The varlen function needs
flash-attn's packed entry points, which the adapter does not serve, so it is
not selected; the cases with dropout are skipped by the file itself
(softcap with dropout is not supported there), and would need ``S_dmask``
(the dropout pattern), which the op never materialises. So the default
selection is ``test_flash_attn_output`` with ``-k 50.0`` (softcap 50 in its
ids), narrowed by parameter value to softcap > 0 and ``dropout_p == 0``.
``--functions`` and ``--all-cases`` pick other functions or all their ids.

``--every K`` keeps every K-th selected case (a spread over all parameters)
to fit ``--budget`` seconds; when the budget runs out pytest is interrupted
and the counts so far are printed. Counts also go to
bench/results/flash_attn_tests.csv. Needs einops (imported by the file) and,
for ``-n``, pytest-xdist.
"""

from __future__ import annotations

import argparse
import collections
import csv
import importlib.util
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
            params = getattr(getattr(item, "callspec", None), "params", {})
            return params.get("softcap", 0) > 0 and params.get("dropout_p", 0) == 0

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
# The runner.


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", help="flash-attn's tests/test_flash_attn.py")
    ap.add_argument("--functions", nargs="+", default=list(SOFTCAP_FUNCTIONS), help="test functions to run")
    ap.add_argument("--all-cases", action="store_true", help="all ids of the functions, not only soft-capping")
    ap.add_argument("-k", dest="extra_k", default=None, help="a further -k expression, and-ed")
    ap.add_argument("--every", type=int, default=1, help="keep every K-th selected case")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds before pytest is interrupted")
    ap.add_argument("-n", dest="workers", default=None, help="xdist workers (default 12 when installed)")
    ap.add_argument("--collect-only", action="store_true", help="list the cases without running them")
    ap.add_argument("--csv", default=str(ROOT / "bench" / "results" / "flash_attn_tests.csv"))
    args = ap.parse_args(argv)

    test_file = pathlib.Path(args.test_file).resolve()
    if not test_file.is_file():
        sys.exit(f"no such test file: {test_file}")
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
    print(f"\n{'function':32} {'passed':>8} {'failed':>8} {'skipped':>8}")
    rows = []
    for fn, c in sorted(data["counts"].items()):
        rows.append([fn, c.get("passed", 0), c.get("failed", 0), c.get("skipped", 0)])
        print(f"{fn:32} {rows[-1][1]:>8} {rows[-1][2]:>8} {rows[-1][3]:>8}")
    note = f"interrupted after the {args.budget:.0f} s budget" if timed_out else "complete"
    print(f"{elapsed:.0f} s, {note}; every {args.every}-th case")
    for f in data["failures"]:
        print("  FAILED", f)
    pathlib.Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["function", "passed", "failed", "skipped", "seconds", "every", "status"])
        for r in rows:
            w.writerow(r + [round(elapsed), args.every, note])
    return 0 if rows and not any(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
