"""Helpers shared by the flashfuse benchmark scripts.

Everything the scripts have in common lives here so that they measure the same
way: argument parsing, device and version information, timing (Triton's
``do_bench`` median on GPU, a wall-clock median on CPU), peak memory, FLOP
counting, the attention providers being compared, error rows, incremental CSV
writing, the printed tables and the plots.

The scripts are run as ``python bench/<script>.py``; Python then puts ``bench/``
on ``sys.path`` and ``import common`` finds this module. This module in turn
puts the repository root on ``sys.path`` so that ``import flashfuse`` works
from a source checkout that is not installed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import os
import platform
import signal
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_OUT = os.path.join(REPO_ROOT, "bench", "results")

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# Single-call attention shapes the diagnosis scripts share, by name:
# (B, H, N, D, causal, dropout_p). "gpt2" is one GPT-2 124M layer at T = 1024.
KERNEL_CASES = {
    "gpt2 drop": (8, 12, 1024, 64, True, 0.1),
    "gpt2 nodrop": (8, 12, 1024, 64, True, 0.0),
    "d128 4k causal": (4, 16, 4096, 128, True, 0.0),
    "d128 4k": (4, 16, 4096, 128, False, 0.0),
    "d128 16k causal": (1, 16, 16384, 128, True, 0.0),
    "d128 4k drop": (4, 16, 4096, 128, False, 0.1),
    "d64 4k causal": (4, 32, 4096, 64, True, 0.0),
    # A causal mask passed as a (B, 1, N, N) bfloat16 tensor of 0 and the
    # lowest value, as Hugging Face models compiled block by block pass it.
    "gpt2 fmask drop": (8, 12, 1024, 64, False, 0.1, "causal-float"),
    "llama fmask": (4, 16, 2048, 64, False, 0.0, "causal-float"),
}


# --------------------------------------------------------------------------
# Command line, device, environment
# --------------------------------------------------------------------------

def base_parser(description: str, budget_s: float) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the options every script shares."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=DEFAULT_OUT, help="directory for CSV and PNG outputs (default: bench/results)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, finishes in seconds (for tests)")
    p.add_argument("--device", default=None, help="device to run on (default: cuda, or cpu with --smoke)")
    p.add_argument(
        "--budget-s", type=float, default=None,
        help=f"stop starting new measurements after this many seconds, recording the rest as "
             f"skipped (default {budget_s:g}, sized for run_gpu.sh; 0 = no limit; --smoke: no limit)",
    )
    p.set_defaults(default_budget_s=budget_s)
    p.add_argument("--no-plot", action="store_true", help="do not draw PNG plots")
    return p


def start(args) -> tuple[torch.device, "Budget"]:
    """What every script's ``main`` does first: warnings quiet, SIGTERM as
    KeyboardInterrupt (so a cut-short run keeps its rows), then the device and
    the time budget."""
    quiet_warnings()
    interrupt_on_sigterm()
    return pick_device(args), make_budget(args)


def graph_us(fn, rep_ms: float) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph
    (``do_bench_cudagraph``), after one call outside the capture to compile
    and tune."""
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def pick_device(args) -> torch.device:
    """The device the run uses: ``--device``, else CPU for ``--smoke``, else CUDA."""
    name = args.device or ("cpu" if args.smoke else "cuda")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --smoke (or --device cpu) for a CPU run")
    if args.smoke:
        # Tiny CPU ops are dominated by thread start-up and contention; one
        # thread keeps a smoke run in seconds even on a busy machine.
        torch.set_num_threads(1)
    return dev


def gpu_device(args, what: str) -> torch.device | None:
    """For a script that only times GPU work: warnings quieted, then the
    device ``pick_device`` gives, or None after saying that the script (it
    ``what``) has nothing to do without CUDA (a CPU or smoke run)."""
    quiet_warnings()
    device = pick_device(args)
    if device.type != "cuda":
        print(f"{os.path.basename(sys.argv[0])} {what}; nothing to do without CUDA")
        return None
    return device


def env_info(device: torch.device) -> dict:
    """Columns that every CSV row carries: what ran, on which versions, when."""
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"cpu ({platform.machine()})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "gpu": gpu,
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        # The FLASHFUSE_* knobs the run was made with (config choice, loads, schedules).
        "settings": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("FLASHFUSE_")),
    }


def interrupt_on_sigterm() -> None:
    """Turn SIGTERM (sent by ``timeout`` in run_gpu.sh) into KeyboardInterrupt so
    a script cut short still prints its table and draws its plot."""
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)


def quiet_warnings() -> None:
    """Silence the per-call warnings of forced SDPA backends (their reasons end
    up in the error column anyway) and other chatter that would bury the table."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def make_budget(args) -> "Budget":
    """The script's budget: ``--budget-s`` if given, else none for a smoke run
    (it checks that everything runs) and the script's default otherwise."""
    if args.budget_s is not None:
        return Budget(args.budget_s)
    return Budget(0 if args.smoke else args.default_budget_s)


class Budget:
    """Wall-clock budget for a whole script; ``seconds <= 0`` means unlimited."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        if self.seconds <= 0:
            return math.inf
        return self.seconds - self.elapsed()

    def exceeded(self) -> bool:
        return self.left() <= 0


# --------------------------------------------------------------------------
# Errors and memory
# --------------------------------------------------------------------------

class Unsupported(Exception):
    """A provider cannot run a configuration (known in advance); gives a skip row."""


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def short_error(exc: BaseException) -> str:
    """One line for the CSV: 'OOM', or the exception type and first message line."""
    if is_oom(exc):
        return "OOM"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:200]


def free_memory(collect: bool = False) -> None:
    """Return cached GPU blocks after a measurement. ``collect`` also runs the
    garbage collector, needed after an exception (its traceback holds tensors
    in reference cycles) but too slow (~0.5 s with torch loaded) for every row."""
    if collect:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# About 0.1 s of GPU time, queued ahead of launches whose host time is measured.
HOST_SLEEP_CYCLES = 200_000_000


def sleep_gpu(device: torch.device) -> None:
    """Queue ``HOST_SLEEP_CYCLES`` of GPU sleep (nothing on the CPU), so that
    launches issued next wait on the device and no device time is timed."""
    if device.type == "cuda":
        torch.cuda._sleep(HOST_SLEEP_CYCLES)


def host_ms(step, device: torch.device, steps: int = 20, loops: int = 3, asleep: bool = True) -> float:
    """Host milliseconds per call of ``step``: ``steps`` calls issued while
    the GPU sleeps (``sleep_gpu``; ``asleep=False``: while it works), the
    best of ``loops`` loops."""
    best = float("inf")
    for _ in range(loops):
        if asleep:
            sleep_gpu(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
        sync(device)
    return best


def hopper_backward_everywhere() -> None:
    """For this process: masked backwards take the Hopper kernels at every
    key count and head dim (``hopper.BWD_MASK_MIN_KEYS`` and
    ``BWD_FLOAT_MASK_DIMS`` lifted), so probes time them where the default
    rule would send them to the portable kernels."""
    from flashfuse.kernels import hopper

    hopper.BWD_MASK_MIN_KEYS = {d: 0 for d in hopper.BWD_MASK_MIN_KEYS}
    hopper.BWD_FLOAT_MASK_DIMS = tuple(hopper.BWD_MASK_MIN_KEYS)


def hopper_mask_loads(how: str) -> None:
    """For this process: the fused Hopper backward loads mask tiles ``how``
    ("coalesced" or "direct") at every head dim (``hopper.BWD_MASK_LOADS``)."""
    from flashfuse.kernels import hopper

    hopper.BWD_MASK_LOADS = {d: how for d in hopper.BWD_MASK_LOADS}


def fwd_softmax_variant(D: int, folds: int, poly: int) -> dict:
    """``hopper.FWD_SOFTMAX`` with head dim ``D`` set to ``folds`` row-max
    folds and ``poly`` of each eight exponentials on the FMA units."""
    from flashfuse.kernels import hopper

    return {**hopper.FWD_SOFTMAX, D: dict(row_max_folds=folds, exp_poly=poly)}


def softmax_pair(text: str) -> tuple[int, int]:
    """A "FOLDS,POLY" argument as two ints."""
    folds, poly = (int(x) for x in text.split(","))
    return folds, poly


class HostClock:
    """Stands in for ``fn``: the host time spent inside it, and its calls."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


def hopper_mask_runs(how: str) -> None:
    """For this process: the Hopper forward and fused backward run a masked
    tile's blocks ``how`` ("split": three loops; "single": one loop),
    ``hopper.FWD_MASK_SPLIT_RUNS`` and ``BWD_MASK_SPLIT_RUNS``."""
    from flashfuse.kernels import hopper

    hopper.FWD_MASK_SPLIT_RUNS = how == "split"
    hopper.BWD_MASK_SPLIT_RUNS = {d: how == "split" for d in hopper.BWD_MASK_SPLIT_RUNS}


# The stand-in sets of mask_ablations.py (here so that scripts can offer
# them without importing Gluon).
MASK_ABLATIONS = ("tables", "tables-opaque", "mask-code", "all")


def alternating(variants: tuple, round_index: int) -> tuple:
    """``variants`` in the order of round ``round_index``: as given in even
    rounds (and the warm-up round -1), reversed in odd ones, so that a
    drift of the machine over a run weighs on every variant alike."""
    return variants if round_index < 0 or round_index % 2 == 0 else tuple(reversed(variants))


def timed_in_rounds(runs, device, rounds: int) -> dict:
    """Median ms of each run over ``rounds`` rounds, each timing every run
    once (``do_bench``), in the order of ``alternating``. Each run is
    compiled and called before the first round, so no round holds a compile.
    One timing per variant in a fixed order read the first variant after
    the default several percent fast, whichever it was (bench/NOTES.md
    run 35)."""
    import statistics

    names = tuple(name for name, _ in runs)
    fns = dict(runs)
    for fn in fns.values():
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in alternating(names, r):
            times[name].append(bench_ms(fns[name], device, warmup_ms=5, rep_ms=20))
    return {name: statistics.median(ts) for name, ts in times.items()}


def cache_view(buf: torch.Tensor, B: int, H: int, M: int, D: int) -> torch.Tensor:
    """A contiguous (B, H, M, D) tensor over ``buf``'s memory, as
    ``torch.cat`` leaves a dynamic key/value cache of M keys; views of one
    buffer, so a loop over growing lengths times no allocation."""
    return torch.as_strided(buf, (B, H, M, D), (H * M * D, M * D, D, 1))


def _clear_grads(tensors) -> None:
    for t in tensors or ():
        t.grad = None


def peak_memory_mib(fn, device: torch.device, grad_to_none=None) -> tuple[float, float]:
    """Run ``fn`` once; return (peak allocated MiB during the call, peak minus
    what was allocated just before it). NaN on CPU, where PyTorch keeps no
    allocator statistics. Measured apart from timing because ``do_bench``
    allocates its own cache-flush buffer."""
    if device.type != "cuda":
        fn()
        return math.nan, math.nan
    _clear_grads(grad_to_none)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak / 2**20, (peak - before) / 2**20


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

def bench_ms(fn, device: torch.device, warmup_ms: float = 10, rep_ms: float = 30, grad_to_none=None) -> float:
    """Median milliseconds of one call of ``fn``.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls,
    gradients of ``grad_to_none`` reset so backward does not accumulate).
    CPU: wall-clock median of at least 3 calls, about ``rep_ms`` in total.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        _clear_grads(grad_to_none)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def wall_ms(fn, device: torch.device, reps: int, before=None) -> float:
    """Median wall-clock milliseconds of ``reps`` synchronised calls of ``fn``
    (``before`` runs untimed ahead of each). For calls too long for
    ``do_bench``'s repeated runs, and for whole training steps, where host
    time is part of what is measured."""
    times = []
    for _ in range(max(1, reps)):
        if before is not None:
            before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def per_call_us(fn, device: torch.device, calls: int) -> float:
    """Microseconds per call over ``calls`` back-to-back calls with one
    synchronisation at the end: the throughput a host-bound loop gets."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e6 / calls


# --------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------

def visible_pairs(N: int, M: int, causal: bool = False, bottom_right: bool = False) -> float:
    """Number of (query, key) pairs attention computes.

    Non-causal: N*M. Causal: query i sees keys j <= i + off (off = M - N for
    bottom-right alignment, else 0), counted in the continuous approximation
    FlashAttention's benchmarks use, so square causal is exactly N*M/2.
    """
    if not causal:
        return float(N * M)
    off = M - N if bottom_right else 0

    def ramp_integral(x: float) -> float:  # integral over [0, x] of clamp(t, 0, M)
        if x <= 0:
            return 0.0
        if x <= M:
            return x * x / 2
        return M * M / 2 + M * (x - M)

    return ramp_integral(N + off) - ramp_integral(off)


MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(B: int, H: int, N: int, M: int, D: int, Dv: int, causal: bool = False,
                    bottom_right: bool = False, mode: str = "fwd") -> float:
    """FLOPs of attention: forward 2*pairs*D (Q K^T) + 2*pairs*Dv (P V) per
    batch and head; backward counted as 2.5x forward (the FlashAttention
    convention); masks and dropout counted as dense work."""
    fwd = 2.0 * B * H * visible_pairs(N, M, causal, bottom_right) * (D + Dv)
    return fwd * MODE_FLOP_FACTOR[mode]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else math.nan


# --------------------------------------------------------------------------
# Results: incremental CSV, tables
# --------------------------------------------------------------------------

class Results:
    """Rows of one script; the CSV is rewritten after every row so that a run
    cut short keeps what it measured."""

    def __init__(self, out_dir: str, filename: str, env: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, filename)
        self.env = env
        self.rows: list[dict] = []

    def add(self, **row) -> dict:
        full = {**row, **self.env}
        self.rows.append(full)
        self._write()
        return full

    @classmethod
    def load(cls, path: str) -> "Results":
        """The rows of a CSV written by a script (numbers parsed back), for
        redrawing its tables and plots without measuring."""
        res = cls.__new__(cls)
        res.path, res.env, res.rows = path, {}, []
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                res.rows.append({k: _parse_csv_value(v) for k, v in r.items()})
        return res

    def _write(self) -> None:
        columns: list[str] = []
        for r in self.rows:
            for c in r:
                if c not in columns:
                    columns.append(c)
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for r in self.rows:
                w.writerow({c: _csv_value(r.get(c, "")) for c in columns})
        os.replace(tmp, self.path)


def _parse_csv_value(v: str):
    if v in ("True", "False"):  # how csv writes a bool column (causal, ...)
        return v == "True"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def _csv_value(v):
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, torch.dtype):
        return DTYPE_NAMES.get(v, str(v))
    return v


def fmt(v, digits: int = 1) -> str:
    """A table cell: numbers rounded, NaN as '-'."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def cell(row: dict, key: str, digits: int = 1) -> str:
    """A table cell for a measurement row: the value when it ran, else its status."""
    if row.get("status", "ok") != "ok":
        err = row.get("error", "")
        return "OOM" if err == "OOM" else row["status"]
    return fmt(row.get(key), digits)


TABLES_MARKER = "===== TABLES ====="


def tables_header() -> None:
    """Mark where the final tables start; run_gpu.sh reprints from here in its summary."""
    print(f"\n{TABLES_MARKER}", flush=True)


def print_table(rows: list[list], headers: list[str], title: str | None = None) -> None:
    from tabulate import tabulate

    if title:
        print(f"\n{title}")
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))


def pivot(rows: list[dict], row_keys: list[str], col_key: str, value) -> tuple[list[list], list[str]]:
    """Turn measurement rows into a table: one line per distinct ``row_keys``
    tuple, one column per distinct ``col_key`` value, cells ``value(row)``."""
    cols: list = []
    lines: dict = {}
    for r in rows:
        c = r[col_key]
        if c not in cols:
            cols.append(c)
        key = tuple(r[k] for k in row_keys)
        lines.setdefault(key, {})[c] = value(r)
    table = [list(map(str, k)) + [line.get(c, "") for c in cols] for k, line in lines.items()]
    return table, list(row_keys) + [str(c) for c in cols]


# --------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------

def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (with a
    message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot drawn")
        return None
    return plt


def plot_panels(path: str, panels: dict, xlabel: str, ylabel: str, logx: bool = True,
                logy: bool = False, ncols: int = 2, title: str | None = None,
                ylabels: dict | None = None) -> str | None:
    """Draw a grid of line plots: ``panels`` maps a panel title to
    ``{series name: (xs, ys)}``; ``ylabels`` may give a panel its own y
    label. Returns the path written, or None when matplotlib is missing or
    there is nothing to draw."""
    # Drop points without a finite positive value (NaN memory on CPU, failed runs).
    clean = {}
    for ptitle, series in panels.items():
        kept = {}
        for name, (xs, ys) in series.items():
            pts = [(x, y) for x, y in zip(xs, ys)
                   if isinstance(y, (int, float)) and math.isfinite(y) and (y > 0 or not logy)]
            if pts:
                kept[name] = ([x for x, _ in pts], [y for _, y in pts])
        if kept:
            clean[ptitle] = kept
    panels = clean
    if not panels:
        print(f"nothing to plot for {os.path.basename(path)}")
        return None
    plt = pyplot()
    if plt is None:
        return None
    n = len(panels)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, (ptitle, series) in zip(axes.flat, panels.items()):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(ptitle, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel((ylabels or {}).get(ptitle, ylabel))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------
# Attention configurations and providers
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class AttnCase:
    """One attention configuration. ``M``, ``Hkv`` and ``Dv`` default to ``N``,
    ``Hq`` and ``D``. ``mask`` is 'none', 'bool_pad' (a (B,1,1,M) bool mask
    hiding the last quarter of the keys), 'float' (a (B,1,N,M) additive
    mask) or 'causal_float' (a causal mask as a (B,1,N,M) float tensor).
    ``bottom_right`` aligns the causal diagonal to the last key."""

    B: int
    Hq: int
    N: int
    D: int
    M: int | None = None
    Hkv: int | None = None
    Dv: int | None = None
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    bottom_right: bool = False
    mask: str = "none"
    dropout: float = 0.0

    @property
    def m(self) -> int:
        return self.N if self.M is None else self.M

    @property
    def hkv(self) -> int:
        return self.Hq if self.Hkv is None else self.Hkv

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    @property
    def gqa(self) -> bool:
        return self.hkv != self.Hq

    def flops(self, mode: str) -> float:
        return attention_flops(self.B, self.Hq, self.N, self.m, self.D, self.dv, self.causal, self.bottom_right, mode)

    def columns(self) -> dict:
        """The case as CSV columns."""
        return {
            "dtype": DTYPE_NAMES.get(self.dtype, str(self.dtype)),
            "B": self.B, "Hq": self.Hq, "Hkv": self.hkv, "N": self.N, "M": self.m,
            "D": self.D, "Dv": self.dv, "causal": self.causal,
            "alignment": "bottom_right" if self.bottom_right else "top_left",
            "mask": self.mask, "dropout": self.dropout,
        }

    def with_(self, **kw) -> "AttnCase":
        return replace(self, **kw)


def make_inputs(case: AttnCase, device: torch.device, requires_grad: bool = True):
    """Fresh random q, k, v (randn: zeros would let kernels skip work or hit
    degenerate softmax) and the case's mask (None, bool or float)."""
    B, Hq, Hkv, N, M = case.B, case.Hq, case.hkv, case.N, case.m
    kw = dict(device=device, dtype=case.dtype, requires_grad=requires_grad)
    q = torch.randn(B, Hq, N, case.D, **kw)
    k = torch.randn(B, Hkv, M, case.D, **kw)
    v = torch.randn(B, Hkv, M, case.dv, **kw)
    mask = None
    if case.mask == "bool_pad":
        mask = torch.ones(B, 1, 1, M, dtype=torch.bool, device=device)
        mask[..., M - M // 4:] = False  # padding: the last quarter of the keys
    elif case.mask == "float":
        mask = torch.randn(B, 1, N, M, dtype=case.dtype, device=device)
    elif case.mask == "causal_float":
        # A causal mask as a tensor of 0 and the dtype's lowest value, the way
        # Hugging Face models build it and pass it to each layer.
        later = torch.ones(N, M, dtype=torch.bool, device=device).triu(1)
        mask = torch.zeros(B, 1, N, M, dtype=case.dtype, device=device).masked_fill(
            later, torch.finfo(case.dtype).min)
    elif case.mask != "none":
        raise ValueError(f"unknown mask kind {case.mask!r}")
    return q, k, v, mask


def hf_mask(B: int, N: int, kind: str, device: torch.device) -> torch.Tensor:
    """A bfloat16 additive mask as Hugging Face builds it (0 / the lowest
    value): ``"causal"`` (B, 1, N, N), or ``"padding"`` (B, 1, 1, N) with each
    sequence's length drawn between N/2 and N."""
    lowest = torch.finfo(torch.bfloat16).min
    if kind == "causal":
        later = torch.ones(N, N, dtype=torch.bool, device=device).triu(1)
        return torch.zeros(B, 1, N, N, dtype=torch.bfloat16, device=device).masked_fill(later, lowest)
    lengths = torch.randint(N // 2, N + 1, (B, 1, 1, 1), device=device)
    hidden = torch.arange(N, device=device) >= lengths
    return torch.zeros(B, 1, 1, N, dtype=torch.bfloat16, device=device).masked_fill(hidden, lowest)


def causal_visibility(case: AttnCase, device: torch.device) -> torch.Tensor:
    """(N, M) bool: True where key j is visible to query i under the case's causal alignment."""
    off = case.m - case.N if case.bottom_right else 0
    return torch.ones(case.N, case.m, dtype=torch.bool, device=device).tril(diagonal=off)


ATTENTION_PROVIDERS = ["flashfuse", "flashfuse_portable", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "naive"]

_SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}

def _flex_attention():
    """flex_attention compiled for one configuration (dynamic=False: static
    kernels, as recommended for benchmarking it). Dynamo is reset first: every
    shape and mask is a recompile anyway, and past the recompile limit (8)
    Dynamo would silently fall back to eager flex, which materialises the
    scores."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def naive_bytes(case: AttnCase) -> float:
    """Rough memory of the naive implementation's (N, M) tensors during
    forward+backward: scores, masked scores, probabilities, dropped
    probabilities and their gradients, about six score-sized tensors."""
    elem = torch.finfo(case.dtype).bits // 8
    return 6.0 * case.B * case.Hq * case.N * case.m * elem


def build_attention(provider: str, case: AttnCase, mask, device: torch.device, guard_memory: bool = True):
    """A function ``fn(q, k, v) -> out`` computing the case's attention with
    ``provider``. Everything that is set up once (compiled kernels, block
    masks, SDPA's explicit masks) is built here, outside any timing. Raises
    ``Unsupported`` for combinations a provider cannot express, and (with
    ``guard_memory``) for naive attention that would not fit in GPU memory."""
    p = case.dropout
    align = "bottom_right" if case.bottom_right else "top_left"

    if provider == "flashfuse":
        import flashfuse

        def fn(q, k, v):
            return flashfuse.attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=case.causal,
                                       enable_gqa=case.gqa, alignment=align)
        return fn

    if provider == "flashfuse_portable":
        # flashfuse with the Hopper kernel turned off: the portable Triton
        # kernels, to compare the two in one process.
        import flashfuse

        def fn(q, k, v):
            saved = os.environ.get("FLASHFUSE_HOPPER")
            os.environ["FLASHFUSE_HOPPER"] = "0"
            try:
                return flashfuse.attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=case.causal,
                                           enable_gqa=case.gqa, alignment=align)
            finally:
                if saved is None:
                    del os.environ["FLASHFUSE_HOPPER"]
                else:
                    os.environ["FLASHFUSE_HOPPER"] = saved
        return fn

    if provider == "sdpa" or provider in _SDPA_BACKENDS:
        # SDPA's is_causal is top-left; other alignments get an explicit mask
        # with the same visibility.
        sdpa_mask, sdpa_causal = mask, case.causal
        if case.causal and ((case.bottom_right and case.N != case.m) or mask is not None):
            vis = causal_visibility(case, device)
            if mask is None:
                sdpa_mask = vis
            elif mask.dtype == torch.bool:
                sdpa_mask = mask & vis
            else:
                sdpa_mask = mask.masked_fill(~vis, float("-inf"))
            sdpa_causal = False
        kw = dict(attn_mask=sdpa_mask, dropout_p=p, is_causal=sdpa_causal)
        if case.gqa:
            kw["enable_gqa"] = True
        if provider == "sdpa":
            def fn(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, **kw)
            return fn
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA_BACKENDS[provider])

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        return fn

    if provider == "flex":
        if p > 0:
            raise Unsupported("flex_attention has no dropout")
        from torch.nn.attention.flex_attention import and_masks, create_block_mask

        mods = []
        if case.causal:
            off = case.m - case.N if case.bottom_right else 0

            def causal_mod(b, h, q_idx, kv_idx):
                return q_idx + off >= kv_idx
            mods.append(causal_mod)
        score_mod = None
        if mask is not None and mask.dtype == torch.bool:
            def pad_mod(b, h, q_idx, kv_idx):
                return mask[b, 0, 0, kv_idx]
            mods.append(pad_mod)
        elif mask is not None:
            def bias_mod(score, b, h, q_idx, kv_idx):
                return score + mask[b, 0, q_idx, kv_idx]
            score_mod = bias_mod
        block_mask = None
        if mods:
            mod = mods[0] if len(mods) == 1 else and_masks(*mods)
            per_batch = mask is not None and mask.dtype == torch.bool
            block_mask = create_block_mask(mod, case.B if per_batch else None, None, case.N, case.m,
                                           device=device)
        flex = _flex_attention()

        def fn(q, k, v):
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=case.gqa)
        return fn

    if provider == "naive":
        if guard_memory and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            if naive_bytes(case) > 0.85 * total:
                raise Unsupported(f"naive needs ~{naive_bytes(case) / 2**30:.0f} GiB")
        vis = causal_visibility(case, device) if case.causal else None
        scale = 1.0 / math.sqrt(case.D)
        rep = case.Hq // case.hkv

        def fn(q, k, v):
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            s = (q @ k.transpose(-2, -1)) * scale
            if mask is not None:
                s = s + mask if mask.dtype != torch.bool else s.masked_fill(~mask, float("-inf"))
            if vis is not None:
                s = s.masked_fill(~vis, float("-inf"))
            a = torch.softmax(s, dim=-1)
            if p > 0:
                a = F.dropout(a, p=p, training=True)
            return a @ v
        return fn

    raise ValueError(f"unknown provider {provider!r}; choose from {ATTENTION_PROVIDERS}")


def attention_step(fn, q, k, v, mode: str, grads: bool = False):
    """The callable to time for ``mode`` and the tensors whose gradients must
    be reset between calls.

    fwd: forward with inputs that require grad (as in training).
    bwd: backward alone, through a graph built once and kept (retain_graph).
    fwd+bwd: forward then backward.

    ``grads``: the backward returns the gradients of q, k and v
    (``torch.autograd.grad``) instead of accumulating them into ``.grad``,
    so nothing needs resetting (the second result is then None).
    """
    inputs = [q, k, v]
    if mode == "fwd":
        return (lambda: fn(q, k, v)), None
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    if mode == "bwd":
        if grads:
            return (lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)), None
        return (lambda: out.backward(dout, retain_graph=True)), inputs
    if mode == "fwd+bwd":
        del out
        if grads:
            return (lambda: torch.autograd.grad(fn(q, k, v), inputs, dout)), None
        return (lambda: fn(q, k, v).backward(dout)), inputs
    raise ValueError(f"unknown mode {mode!r}")


# --------------------------------------------------------------------------
# Model helpers: the flashfuse backend and its rewrite count
# --------------------------------------------------------------------------

def count_attention_nodes(gm) -> int:
    """Number of ``flashfuse.attention`` calls in an FX graph module."""
    target = torch.ops.flashfuse.attention
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target is target or node.target is target.default):
            n += 1
    return n
