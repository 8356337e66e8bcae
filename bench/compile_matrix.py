"""Compile matrix: every cell compiles with the flashfuse backend and matches
eager, or is left unrewritten with a reason.

A cell is one attention program written the way eager code writes it (q·kᵀ,
scale, an optional mask, softmax, optional dropout, ·v), compiled with
``torch.compile(..., backend=flashfuse.make_backend(...))`` (Inductor after the
rewrite), at one head dim, dtype, mode (inference / training), dynamic setting
and variant:

* head dims 16 to 256, odd ones included;
* fp16, bf16, fp32;
* ``infer`` (no gradients) and ``train`` (gradients of q, k, v);
* ``dynamic``: ``static`` (``dynamic=False``), ``true`` (``dynamic=True``,
  called at two batch sizes and lengths) and ``auto`` (the default: called at
  one shape, then new batch and length, then new head count and head dim, so
  that automatic dynamic shapes make them symbolic);
* variants: no mask, causal (built in the graph), a bool padding mask and a
  float mask (graph inputs), grouped heads (``repeat_interleave``), dropout,
  and ``fill``: ``masked_fill`` with the dtype's lowest value on a padding
  mask that hides some query rows entirely (eager averages those rows);
  and three spellings of real models, at head dims 40 and 128: ``softcap``
  (Gemma 2: ``tanh(s / cap) * cap``, then a float mask), ``sinks`` (gpt-oss:
  a per-head logit concatenated to the scores, the softmax, that column
  dropped) and ``alibi`` (Bloom: ``bias.baddbmm(q, kᵀ, alpha=scale)`` on
  (B·H, N, D) views, an fp32 softmax on the (B, H, N, M) view, ``bmm`` with v).

Correctness: the compiled output (and gradients) against a float64 eager
run of the same program, accepted when the error is within twice eager's own
error in the cell's dtype or under the dtype's floor. Dropout cells compare
with a run that draws the same random numbers (Inductor's
``fallback_random``): the eager flashfuse op when the cell was rewritten,
the program compiled by Inductor alone otherwise.

Cells run in parallel worker processes (compiling is CPU-bound); the CSV
(``compile_matrix.csv``) has one row per cell, and the summary counts cells
by status: ``rewritten`` and ``unrewritten`` (with its reason) pass,
``mismatch`` and ``failed`` do not.

    python bench/compile_matrix.py                # the whole matrix on the GPU
    python bench/compile_matrix.py --smoke        # a few cells on the CPU
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

HEAD_DIMS = (16, 40, 64, 72, 80, 96, 128, 160, 200, 256)
DTYPES = ("fp16", "bf16", "fp32")
MODES = ("infer", "train")
DYNAMIC = ("static", "true", "auto")
VARIANTS = ("none", "causal", "bool", "float", "gqa", "dropout", "fill", "softcap", "sinks", "alibi")
# Head dims the mask, grouped-head and dropout variants are crossed with
# (every head dim is crossed with the plain variant).
VARIANT_HEAD_DIMS = (40, 128, 200)
# The spellings from real models (Gemma 2's soft-capping, gpt-oss's sinks,
# Bloom's ALiBi through baddbmm and views) at two head dims.
MODEL_VARIANTS = ("softcap", "sinks", "alibi")
MODEL_VARIANT_HEAD_DIMS = (40, 128)
# Relative error floors per dtype, where eager's own error is smaller.
FLOOR = {"fp32": 2e-5, "bf16": 1.6e-2, "fp16": 4e-3}
FIELDS = ["head_dim", "dtype", "mode", "dynamic", "variant", "status", "rewritten", "candidates",
          "err_out", "eager_err_out", "err_grad", "eager_err_grad", "reason", "seconds",
          "gpu", "torch_version", "triton_version"]


def head_dims_of(variant: str) -> tuple:
    if variant == "none":
        return HEAD_DIMS
    return MODEL_VARIANT_HEAD_DIMS if variant in MODEL_VARIANTS else VARIANT_HEAD_DIMS


def all_cells() -> list[dict]:
    return [dict(head_dim=d, dtype=dt, mode=mode, dynamic=dyn, variant=var)
            for d, dt, mode, dyn, var in itertools.product(HEAD_DIMS, DTYPES, MODES, DYNAMIC, VARIANTS)
            if d in head_dims_of(var)]


def smoke_cells() -> list[dict]:
    return [dict(head_dim=40, dtype="fp32", mode="train", dynamic="auto", variant="causal", smoke=True),
            dict(head_dim=24, dtype="fp32", mode="infer", dynamic="true", variant="bool", smoke=True)]


# --------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------

def program(variant: str, groups: int):
    """The attention of one cell, as eager code spells it."""
    import torch
    import torch.nn.functional as F

    def attention(q, k, v, mask):
        if variant == "alibi":  # Bloom's spelling, on (B·H, N, D) views
            b, h, n, d = q.shape
            q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
            s = mask.baddbmm(q3, k3.transpose(-1, -2), beta=1.0, alpha=d ** -0.5)
            p = F.softmax(s.view(b, h, n, -1), dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(p.view(b * h, n, -1), v3).view(b, h, n, d)
        if variant == "gqa":
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        s = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
        if variant == "causal":
            n, m = s.shape[-2], s.shape[-1]
            keep = torch.ones(n, m, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        elif variant == "bool":
            s = s.masked_fill(~mask, float("-inf"))
        elif variant == "float":
            s = s + mask
        elif variant == "fill":
            s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        elif variant == "softcap":  # Gemma 2: cap, then the mask
            s = torch.tanh(s / 30.0) * 30.0 + mask
        if variant == "sinks":  # gpt-oss: the sink logit joins the softmax, its column is dropped
            b, h, n = s.shape[0], s.shape[1], s.shape[2]
            sink = mask.reshape(1, -1, 1, 1).expand(b, -1, n, -1)
            return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1] @ v
        p = torch.softmax(s, dim=-1)
        if variant == "dropout":
            p = F.dropout(p, 0.1, training=True)
        return p @ v

    return attention


def shapes(cell: dict) -> list[tuple]:
    """(B, Hq, Hkv, N, D) of each call of a cell: one, or a sequence that
    makes sizes symbolic."""
    d = cell["head_dim"]
    small = cell.get("smoke", False)
    n1, n2 = (19, 33) if small else (150, 77)
    if cell["dynamic"] == "static":
        seq = [(2, 4, n1, d)]
    elif cell["dynamic"] == "true":
        seq = [(2, 4, n1, d), (3, 4, n2, d)]
    else:  # automatic dynamic: new batch and length, then new heads and head dim
        first = 32 if small else 64
        seq = [(2, 4, n1, first), (3, 4, n2, first), (2, 8, n1, d)]
    gqa = cell["variant"] == "gqa"
    return [(b, h, h // 2 if gqa else h, n, dd) for b, h, n, dd in seq]


def inputs(shape, dtype, device, variant, grad, seed):
    import torch

    b, h, hkv, n, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(b, h, n, d), rand(b, hkv, n, d), rand(b, hkv, n, d)
    mask = None
    if variant == "bool":
        lengths = torch.randint(1, n + 1, (b,), generator=g)
        mask = (torch.arange(n)[None, :] < lengths[:, None]).view(b, 1, 1, n).to(device)
    elif variant in ("float", "softcap"):
        mask = rand(b, 1, n, n)
    elif variant == "sinks":  # one logit per query head
        mask = rand(h)
    elif variant == "alibi":  # a bias per (batch·head, key), broadcast over queries
        mask = rand(b * h, 1, n)
    elif variant == "fill":  # key padding, and query rows of batch 0 that see nothing
        keep = torch.rand(b, 1, n, n, generator=g) < 0.7
        keep[0, :, : n // 3] = False
        mask = keep.to(device)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, mask


def rel(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_call(fn, q, k, v, mask, grad_out):
    import torch

    out = fn(q, k, v, mask)
    if grad_out is None:
        return out.detach(), []
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), [g.detach() for g in grads]


def run_cell(cell: dict, device: str) -> dict:
    import torch

    import flashfuse
    from flashfuse.ops import attention as op

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[cell["dtype"]]
    train = cell["mode"] == "train"
    variant = cell["variant"]
    torch._dynamo.reset()
    be = flashfuse.make_backend(record=True, options={"fallback_random": True})
    dynamic = {"static": False, "true": True, "auto": None}[cell["dynamic"]]
    row = dict(cell)
    row.pop("smoke", None)
    t0 = time.time()
    errs, eager_errs, gerrs, eager_gerrs = [], [], [], []
    try:
        for i, shape in enumerate(shapes(cell)):
            groups = shape[1] // shape[2]
            fn = program(variant, groups)
            compiled = torch.compile(fn, backend=be, dynamic=dynamic)
            q, k, v, mask = inputs(shape, dtype, device, variant, train, seed=1000 + i)
            grad_out = torch.randn(shape[0], shape[1], shape[3], shape[4], device=device).to(dtype) if train else None
            with torch.set_grad_enabled(train):
                torch.manual_seed(7)
                out_c, g_c = run_call(compiled, q, k, v, mask, grad_out)
                if variant == "dropout":
                    # Same draws as the compiled call: the op itself when it was rewritten.
                    rewritten_now = be.candidates and be.candidates[-1].rewritten
                    # Unrewritten: Inductor alone draws the same numbers (eager's
                    # dropout kernel draws others).
                    ref_fn = ((lambda q, k, v, m: op(q, k, v, dropout_p=0.1)) if rewritten_now else
                              torch.compile(fn, dynamic=dynamic, options={"fallback_random": True}))
                    torch.manual_seed(7)
                    out_r, g_r = run_call(ref_fn, q, k, v, mask, grad_out)
                    out_e, g_e = out_r, g_r
                else:
                    hi = [t.detach().double().requires_grad_(train) if t is not None and t.is_floating_point()
                          else t for t in (q, k, v, mask)]
                    out_r, g_r = run_call(fn, *hi, grad_out.double() if train else None)
                    out_e, g_e = run_call(fn, q, k, v, mask, grad_out)
            errs.append(rel(out_c, out_r))
            eager_errs.append(rel(out_e, out_r))
            gerrs += [rel(a, b) for a, b in zip(g_c, g_r)]
            eager_gerrs += [rel(a, b) for a, b in zip(g_e, g_r)]
    except Exception as exc:  # noqa: BLE001 - a failed cell is a result
        row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}",
                   seconds=round(time.time() - t0, 1))
        row["traceback"] = traceback.format_exc(limit=6)
        return row
    floor = FLOOR[cell["dtype"]]
    if variant == "dropout":
        floor = {"fp32": 1e-5, "bf16": 8e-3, "fp16": 2e-3}[cell["dtype"]]

    def ok(e, ref):
        return all(x <= max(2.0 * r, floor) for x, r in zip(e, ref))

    cands = be.candidates
    n_rewritten = sum(c.rewritten for c in cands)
    reasons = sorted({c.reason for c in cands if not c.rewritten and c.reason})
    good = ok(errs, eager_errs) and ok(gerrs, eager_gerrs)
    status = "mismatch" if not good else ("rewritten" if n_rewritten == len(cands) and cands else "unrewritten")
    row.update(status=status, rewritten=n_rewritten, candidates=len(cands),
               err_out=f"{max(errs):.2e}", eager_err_out=f"{max(eager_errs):.2e}",
               err_grad=f"{max(gerrs):.2e}" if gerrs else "", eager_err_grad=f"{max(eager_gerrs):.2e}" if gerrs else "",
               reason="; ".join(reasons)[:400], seconds=round(time.time() - t0, 1))
    return row


# --------------------------------------------------------------------------
# Workers and the summary
# --------------------------------------------------------------------------

def worker(cells: list[dict], device: str, out_path: str, deadline: float) -> None:
    os.environ.setdefault("FLASHFUSE_AUTOTUNE", "0")
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    with open(out_path, "a") as f:
        for cell in cells:
            if time.time() > deadline:
                row = dict(cell, status="not run", reason="time budget")
                row.pop("smoke", None)
            else:
                row = run_cell(cell, device)
            f.write(json.dumps(row) + "\n")
            f.flush()


def versions(device: str) -> dict:
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return dict(gpu=gpu, torch_version=torch.__version__, triton_version=triton.__version__)


def summarise(rows: list[dict]) -> str:
    from collections import Counter

    from tabulate import tabulate

    counts = Counter(r["status"] for r in rows)
    lines = [tabulate(sorted(counts.items()), headers=["status", "cells"])]
    bad = [r for r in rows if r["status"] in ("mismatch", "failed", "not run")]
    if bad:
        lines.append(tabulate(
            [[r["head_dim"], r["dtype"], r["mode"], r["dynamic"], r["variant"], r["status"],
              r.get("err_out", ""), r.get("err_grad", ""), (r.get("reason") or "")[:90]] for r in bad[:40]],
            headers=["D", "dtype", "mode", "dynamic", "variant", "status", "err out", "err grad", "reason"]))
    left = [r for r in rows if r["status"] == "unrewritten"]
    if left:
        why = Counter((r.get("reason") or "")[:120] for r in left)
        lines.append(tabulate(why.most_common(10), headers=["left unrewritten because", "cells"]))
    return "\n\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"))
    p.add_argument("--smoke", action="store_true", help="two small cells on the CPU")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: CPU count - 2)")
    p.add_argument("--budget-s", type=float, default=480, help="stop starting cells after this long")
    p.add_argument("--only", default="",
                   help="comma-separated key=value filters, '|' between alternatives, e.g. dtype=fp16|bf16,mode=train")
    p.add_argument("--resume", default=None,
                   help="an earlier compile_matrix.csv: run only its cells that did not run, keep its other rows")
    p.add_argument("--worker-of", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker_of:  # a worker: cells from a JSON file, rows appended to a JSON-lines file
        spec = json.load(open(args.worker_of))
        worker(spec["cells"], spec["device"], spec["rows"], spec["deadline"])
        return 0

    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    cells = smoke_cells() if args.smoke else all_cells()
    for item in filter(None, args.only.split(",")):
        key, vals = item.split("=")
        cells = [c for c in cells if str(c[key]) in vals.split("|")]
    kept_rows = []
    if args.resume:
        key_of = lambda r: tuple(str(r[k]) for k in ("head_dim", "dtype", "mode", "dynamic", "variant"))  # noqa: E731
        earlier = list(csv.DictReader(open(args.resume)))
        redo = {key_of(r) for r in earlier if r["status"] == "not run"}
        kept_rows = [r for r in earlier if r["status"] != "not run"]
        cells = [c for c in cells if key_of(c) in redo]
    workers = 1 if args.smoke else max(1, args.workers or (os.cpu_count() or 2) - 2)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="compile_matrix_")
    deadline = time.time() + args.budget_s
    procs = []
    # A fixed shuffle, so that a run its budget cuts short has sampled every
    # head dim and variant (and --resume runs the rest), round-robin over the workers.
    random.Random(0).shuffle(cells)
    for w in range(workers):
        part = cells[w::workers]
        spec_path = os.path.join(tmp, f"cells{w}.json")
        rows_path = os.path.join(tmp, f"rows{w}.jsonl")
        open(rows_path, "w").close()
        json.dump(dict(cells=part, device=device, rows=rows_path, deadline=deadline), open(spec_path, "w"))
        procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker-of", spec_path],
                                       stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"log{w}.txt"), "w")),
                      rows_path))
    rows = []
    for proc, rows_path in procs:
        proc.wait()
        rows += [json.loads(line) for line in open(rows_path) if line.strip()]
    with open(os.path.join(args.out, "compile_matrix_workers.log" if not args.smoke else "compile_matrix_smoke_workers.log"), "w") as f:
        for w in range(workers):  # what the workers printed (warnings, crashes), the tail of each
            text = open(os.path.join(tmp, f"log{w}.txt")).read()
            if text.strip():
                f.write(f"===== worker {w} =====\n{text[-4000:]}\n")
    done = {tuple(r[k] for k in ("head_dim", "dtype", "mode", "dynamic", "variant")) for r in rows}
    for c in cells:  # a worker that died leaves its remaining cells unreported
        key = tuple(c[k] for k in ("head_dim", "dtype", "mode", "dynamic", "variant"))
        if key not in done:
            rows.append(dict({k: c[k] for k in ("head_dim", "dtype", "mode", "dynamic", "variant")},
                             status="failed", reason="worker process died"))
    ver = versions(device)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    rows = [dict(r, **ver, date=stamp) for r in rows] + kept_rows  # earlier rows keep their own date
    name = "compile_matrix_smoke.csv" if args.smoke else "compile_matrix.csv"
    with open(os.path.join(args.out, name), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + ["date"], extrasaction="ignore")
        w.writeheader()
        for r in sorted(rows, key=lambda r: (r["variant"], int(r["head_dim"]), r["dtype"], r["mode"], r["dynamic"])):
            w.writerow(r)
    tb = [r for r in rows if r.get("traceback")]
    with open(os.path.join(args.out, name.replace(".csv", "_failures.txt")), "w") as f:
        for r in tb:
            f.write(json.dumps({k: r[k] for k in ("head_dim", "dtype", "mode", "dynamic", "variant")}) + "\n")
            f.write(r["traceback"] + "\n")
    print(f"{ver['gpu']} | torch {ver['torch_version']} | triton {ver['triton_version']} | {len(rows)} cells "
          f"({len(rows) - len(kept_rows)} run now) | {stamp} UTC")
    print(summarise(rows))
    bad = sum(r["status"] in ("mismatch", "failed") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
