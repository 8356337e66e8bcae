"""Smoke tests of the benchmark scripts: each runs with ``--smoke`` (tiny
shapes on the CPU) into a temporary directory and must write its CSV (and
plot) with the version columns. They check that the scripts run, not what
they measure."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import sys

import pytest

import script_runner

pytest.importorskip("matplotlib")
pytest.importorskip("tabulate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
VERSION_COLUMNS = {"gpu", "torch_version", "triton_version", "date"}


def run_script(name: str, out_dir, *extra: str, timeout: int = 300) -> str:
    env = dict(os.environ)
    # The op's fast blockwise CPU path, not Triton's interpreter.
    env["TRITON_INTERPRET"] = "0"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("MPLBACKEND", "Agg")
    # One thread, as the test workers run (conftest): two workers each
    # starting a multi-threaded script would oversubscribe two cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    # Each script runs as `python bench/NAME --smoke ...` would, in a process
    # forked from one that has imported torch already (script_runner).
    proc = script_runner.run(os.path.join(BENCH, name), "--smoke", "--out", str(out_dir), *extra,
                             cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, f"{path} has no rows"
    assert VERSION_COLUMNS <= set(rows[0]), f"{path} lacks version columns"
    return rows


def test_common_flops():
    sys.path.insert(0, BENCH)
    try:
        import common
    finally:
        sys.path.remove(BENCH)
    # Forward: 4*B*H*N*M*D for D == Dv; causal halves it; backward is 2.5x.
    assert common.attention_flops(2, 3, 128, 128, 64, 64) == 4 * 2 * 3 * 128 * 128 * 64
    assert common.attention_flops(2, 3, 128, 128, 64, 64, causal=True) == 2 * 2 * 3 * 128 * 128 * 64
    assert common.attention_flops(1, 1, 8, 8, 16, 16, mode="fwd+bwd") == 3.5 * common.attention_flops(1, 1, 8, 8, 16, 16)
    # Bottom-right causal with N < M: N*M - N*N/2 visible pairs.
    assert common.visible_pairs(100, 400, causal=True, bottom_right=True) == 100 * 400 - 100 * 100 / 2


def test_bench_attention_smoke(tmp_path):
    out = run_script("bench_attention.py", tmp_path)
    rows = read_csv(tmp_path / "attention.csv")
    ok = {(r["provider"], r["section"]) for r in rows if r["status"] == "ok"}
    assert ("flashfuse", "sweep") in ok and ("sdpa", "sweep") in ok
    assert ("flashfuse", "feature") in ok and ("flashfuse", "host") in ok
    assert any(r["status"] != "ok" for r in rows), "an unsupported provider should give an error row"
    assert (tmp_path / "attention_tflops.png").exists()
    assert "TFLOP/s" in out


def test_bench_long_context_smoke(tmp_path):
    run_script("bench_long_context.py", tmp_path)
    rows = read_csv(tmp_path / "long_context.csv")
    assert {r["provider"] for r in rows if r["status"] == "ok"} == {"flashfuse", "sdpa", "naive"}
    assert (tmp_path / "long_context_memory.png").exists()


def test_bench_models_smoke(tmp_path):
    pytest.importorskip("transformers")
    run_script("bench_models.py", tmp_path, "--only", "gpt2", "--variants", "eager,sdpa,eager+flashfuse")
    rows = read_csv(tmp_path / "models.csv")
    by_variant = {r["variant"]: r for r in rows}
    assert all(by_variant[v]["status"] == "ok" for v in ("eager", "sdpa", "eager+flashfuse")), rows
    assert int(by_variant["eager+flashfuse"]["attn_rewritten"]) >= 1
    assert by_variant["eager+flashfuse"]["compile_scope"] == "model"  # compiled whole by default


def test_bench_models_llama128_smoke(tmp_path):
    """The LLaMA-shaped model at head dim 128 (tiny here: head dim 128, grouped
    heads), rewritten by the backend in training and inference."""
    pytest.importorskip("transformers")
    run_script("bench_models.py", tmp_path, "--only", "llama128", "--variants", "sdpa,eager+flashfuse")
    rows = read_csv(tmp_path / "models.csv")
    assert {r["task"] for r in rows} == {"train", "infer"}, rows
    assert all(r["status"] == "ok" and r["model"] == "llama128" for r in rows), rows
    assert all(int(r["attn_rewritten"]) >= 1 for r in rows if r["variant"] == "eager+flashfuse")


def test_bench_models_redraws_the_committed_results(tmp_path):
    committed = os.path.join(BENCH, "results", "models.csv")
    out = run_script("bench_models.py", tmp_path, "--from-csv", committed, "--since", "2026-11-30 18:00")
    assert (tmp_path / "models.png").exists()
    assert "eager+flashfuse" in out and "sdpa+compile" in out


def test_bench_convergence_smoke(tmp_path):
    out = run_script("bench_convergence.py", tmp_path, "--repeat")
    rows = read_csv(tmp_path / "convergence.csv")
    assert {"loss_eager", "loss_flashfuse", "loss_flashfuse_repeat"} <= set(rows[0])
    assert (tmp_path / "convergence.png").exists()
    assert "max |smoothed loss difference|" in out
    # On the CPU the flashfuse run is deterministic: the repeat matches bit for bit.
    assert all(r["loss_flashfuse"] == r["loss_flashfuse_repeat"] for r in rows)


def test_bench_long_context_single_pass_and_redraw(tmp_path):
    # From --single-pass-from on, one timed call per size (after a small warm-up).
    run_script("bench_long_context.py", tmp_path, "--providers", "flashfuse", "--min-n", "128",
               "--single-pass-from", "128", "--no-plot")
    rows = read_csv(tmp_path / "long_context.csv")
    assert [int(r["N"]) for r in rows] == [128, 256] and {r["reps"] for r in rows} == {"1"}
    redraw = tmp_path / "redraw"
    out = run_script("bench_long_context.py", redraw, "--from-csv", str(tmp_path / "long_context.csv"))
    assert "peak memory" in out and (redraw / "long_context_memory.png").exists()


def test_compile_time_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = run_script("compile_time.py", tmp_path, "--compile-scope", "block")
    assert "first step" in out and "Triton compiles" in out


def test_profile_model_smoke(tmp_path):
    pytest.importorskip("transformers")
    # The op is among the first few rows by CPU time, but its rank moves with
    # the machine's timing (five rows once missed it in CI): fifteen.
    out = run_script("profile_model.py", tmp_path, "--variant", "ffuse-hook", "--steps", "1", "--top", "15")
    assert "ms per step" in out and "flashfuse::attention" in out


def test_tuning_report_smoke(tmp_path):
    out = run_script("tuning_report.py", tmp_path)
    assert "tiny-causal-dropout" in out and "autotuner picks" in out


def test_host_overhead_smoke(tmp_path):
    out = run_script("host_overhead.py", tmp_path)
    rows = read_csv(tmp_path / "host_overhead.csv")
    assert {r["call"] for r in rows} == {"impl f+b", "op fwd", "op f+b", "compiled f+b"}
    assert "host time per call" in out


def test_backward_schedules_smoke(tmp_path):
    out = run_script("backward_schedules.py", tmp_path)
    assert "tiny drop:" in out and "ff-one_pass bwd=" in out and "ff-two_pass f+b=" in out


def test_host_path_cpu_smoke(tmp_path):
    out = run_script("host_path_cpu.py", tmp_path)
    assert "launches stubbed: fwd" in out and "fwd+bwd" in out
    assert "hopper route" in out and "forward+backward" in out  # both ways on the Hopper route
    if importlib.util.find_spec("transformers") is not None:  # the hook inside generate(), by stage
        assert "generate() host path" in out and "of which lane step" in out and "in a loop" in out


def test_host_thread_probe_smoke(tmp_path):
    out = run_script("host_thread_probe.py", tmp_path)
    # Every implementation and step, each timed four ways, then the two profiles.
    for impl in ("flashfuse", "sdpa"):
        for mode in ("fwd", "bwd", "fwd+bwd"):
            assert re.search(rf"\| {impl} +\| {re.escape(mode)} +\|( +[0-9.]+ +\|){{4}}", out), (impl, mode)
    assert out.count("===== flashfuse") == 2 and "_EagerAttentionBackward" in out


def test_kernel_times_smoke(tmp_path):
    out = run_script("kernel_times.py", tmp_path, "--one-pass")
    assert "tiny drop: fwd candidates" in out and "tiny drop: dkdv_dq candidates" in out


def kernel_report(*args: str, **env_overrides: str) -> dict:
    """Rows of ``bench/kernel_report.py --json`` by kernel name (compiles for
    sm_90a on this machine; no GPU needed)."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               **env_overrides)
    proc = script_runner.run(os.path.join(BENCH, "kernel_report.py"), *args, "--json", cwd=ROOT, env=env,
                             timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["kernel"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def test_kernel_report_compiles_for_hopper():
    # The kernels compile for sm_90a with this Triton (no GPU needed): every
    # kernel of a dropout forward+backward, with Hopper matrix instructions.
    # Two passes, so that the dQ kernel is compiled too (one pass is the
    # default with dropout at this head dim).
    rows = kernel_report("--d", "64", "--n", "256", "--causal", "--dropout", "0.1", FLASHFUSE_BWD="two_pass")
    assert {"_attn_fwd", "_bwd_dkdv", "_bwd_dq", "_bwd_preprocess"} <= set(rows), rows
    for name in ("_attn_fwd", "_bwd_dkdv", "_bwd_dq"):
        assert "error" not in rows[name] and rows[name]["HGMMA"] > 0, rows[name]
        assert rows[name]["regs"] is not None, rows[name]


def test_kernel_report_compiles_the_hopper_kernels():
    # --hopper compiles the Gluon kernels as their launchers launch them:
    # each has Hopper matrix instructions and the launch's register cap.
    # Gluon's API is version-bound, so this runs where the Triton
    # flashfuse's Gluon code is written for is installed.
    from flashfuse.kernels import hopper

    if not hopper.gluon_available():
        pytest.skip(f"the Gluon kernels are written for Triton {hopper.SUPPORTED_TRITON}")
    import json

    # The caller's path stays after the root: it may be where that Triton is.
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = script_runner.run(os.path.join(BENCH, "kernel_report.py"), "--hopper", "--d", "64", "--n", "256",
                             "--causal", "--json", cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["config"].split(",")[0] for r in rows] == [
        "forward", "forward", "forward", "dK/dV (deterministic)", "dQ (deterministic)", "fused", "fused", "fused",
        "fused", "fused", "fused", "fused"]
    # The forward and the fused backward, bool and float; the backward also
    # with the mask loads hopper.BWD_MASK_LOADS does not take at this D.
    assert sum("mask" in r["config"] for r in rows) == 6
    assert sum("loads" in r["config"] for r in rows) == 2
    assert sum("(default)" in r["config"] for r in rows) == 1
    for r in rows:
        assert "error" not in r and r["HGMMA"] > 0 and r["regs"] == 168, r


def test_dropout_adds_no_layout_conversion_to_the_forward():
    # The dropout stream is laid out as the accumulator holds the scores, so
    # drawing it must not move data between threads: as many layout
    # conversions with dropout as without (same tile config at D = 128).
    plain = kernel_report("--d", "128", "--n", "256", "--no-backward")["_attn_fwd"]
    drop = kernel_report("--d", "128", "--n", "256", "--no-backward", "--dropout", "0.1")["_attn_fwd"]
    assert plain["config"] == drop["config"]
    assert drop["cvt_layout"] == plain["cvt_layout"], (plain, drop)


def test_kernel_times_forces_one_config_and_restores_the_lists():
    sys.path.insert(0, BENCH)
    try:
        import kernel_times
    finally:
        sys.path.remove(BENCH)
    from flashfuse.kernels import backward, forward
    from flashfuse.kernels.launch import config_tuple

    before = (list(forward._FWD_CONFIGS), dict(backward._CONFIGS), backward._DKDV_TILES, backward._DQ_TILES)
    forward._attn_fwd_launcher.chosen["stale"] = object()
    with kernel_times.forced("fwd", (64, 32, 4, 2)):
        assert [config_tuple(c) for c in forward._FWD_CONFIGS] == [(64, 32, 4, 2)]
        assert not forward._attn_fwd_launcher.chosen, "choices made with other configs are dropped"
    with kernel_times.forced("dq", (128, 32, 8, 3)):
        assert [config_tuple(c) for c in backward._CONFIGS["dq"]] == [(128, 32, 8, 3)]
        assert backward._DQ_TILES[128] == [(128, 32, 8, 3)] and backward._DKDV_TILES is before[2]
    assert [config_tuple(c) for c in forward._FWD_CONFIGS] == [config_tuple(c) for c in before[0]]
    assert backward._CONFIGS == before[1]
    assert backward._DKDV_TILES is before[2] and backward._DQ_TILES is before[3]


def test_compile_matrix_smoke(tmp_path):
    out = run_script("compile_matrix.py", tmp_path, timeout=600)
    rows = read_csv(tmp_path / "compile_matrix_smoke.csv")
    assert [r["status"] for r in rows] == ["rewritten", "rewritten"], rows
    assert VERSION_COLUMNS - {"date"} <= set(rows[0]) and "rewritten" in out
    for r in rows:
        assert float(r["err_out"]) <= max(2 * float(r["eager_err_out"]), 2e-5)


def test_bench_decode_smoke(tmp_path):
    run_script("bench_decode.py", tmp_path)
    # The table redrawn from the CSV, nothing measured.
    redraw = tmp_path / "redraw"
    out = run_script("bench_decode.py", redraw, "--from-csv", str(tmp_path / "decode_smoke.csv"))
    assert "Decoding (Hq 32, Hkv 8, D 128)" in out and "| 1   | 1" in out


def test_profile_generate_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = run_script("profile_generate.py", tmp_path)
    assert "== ffuse" in out and "== sdpa" in out
    assert (tmp_path / "profile_generate_smoke.txt").exists()


def test_static_cache_inputs_smoke(tmp_path):
    """Both implementations compile a prefill and a decoding graph whose
    parameters and buffers are static inputs."""
    pytest.importorskip("transformers")
    out = run_script("static_cache_inputs.py", tmp_path)
    for impl in ("sdpa", "ffuse"):
        section = out.split(f"== {impl}:")[1].split("==")[0]
        assert "graphs over two generate() calls" in section
        assert "graph 0:" in section and "graph 1:" in section
        assert all(int(n) > 0 for n in re.findall(r"(\d+) static;", section))  # the weights, at least


def test_decode_configs_smoke(tmp_path):
    run_script("decode_configs.py", tmp_path)
    rows = read_csv(tmp_path / "decode_configs_smoke.csv")
    assert {r["provider"] for r in rows if r["status"] == "ok"} == {"flashfuse", "sdpa"}


def test_bench_context_parallel_smoke(tmp_path):
    """World size 1 on gloo (no torchrun): the ring runs, PyTorch's context
    parallelism is skipped on the CPU with its reason."""
    run_script("bench_context_parallel.py", tmp_path)
    rows = read_csv(tmp_path / "context_parallel_1gpu.csv")
    assert {r["status"] for r in rows if r["provider"] == "flashfuse_ring"} == {"ok"}
    assert all(r["status"].startswith("skipped") for r in rows if r["provider"] == "torch_cp_sdpa")


def test_bench_capsink_smoke(tmp_path):
    out = run_script("bench_capsink.py", tmp_path)
    rows = read_csv(tmp_path / "capsink.csv")
    assert {(r["provider"], r["variant"]) for r in rows if not r.get("error")} >= {
        ("flashfuse", "softcap+sinks"), ("eager", "softcap+sinks")}
    assert "fwd+bwd ms" in out


def test_bench_generate_smoke(tmp_path):
    run_script("bench_generate.py", tmp_path)
    rows = read_csv(tmp_path / "generate.csv")
    assert {r["impl"] for r in rows if r["status"] == "ok"} == {"sdpa", "ffuse"}
    assert all(r["tokens_match"] == "True" for r in rows)


def test_decode_host_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = run_script("decode_host.py", tmp_path)
    rows = read_csv(tmp_path / "decode_host.csv")
    assert {(r["what"], r["variant"]) for r in rows} == {
        (w, v) for w in ("decode call", "generate dynamic")
        for v in ("flashfuse", "no workspaces", "combine kernel", "no lane", "sdpa")} | {
        ("device time", v) for v in ("flashfuse", "combine kernel", "sdpa")} | {
        ("capture check", "is_current_stream_capturing")}
    assert "us per call" in out and "tok/s" in out


def test_decode_merge_smoke(tmp_path):
    out = run_script("decode_merge.py", tmp_path)
    rows = read_csv(tmp_path / "decode_merge.csv")
    assert {r["variant"] for r in rows} == {"fused", "combine", "as shipped", "sdpa"}
    assert all(float(r["device_us"]) > 0 and float(r["loop_us"]) > 0 for r in rows)
    assert "rows/tile" in out


def test_generate_probe_host_split_times_the_implementations_own_functions():
    """``generate_probe.host_split`` (a GPU script's helper, run here on the
    CPU with the smoke model): per decoding token, the attention function
    is called once per layer and its time and the mask function's are parts
    of the token's; the interfaces are left as they were."""
    pytest.importorskip("transformers")
    from transformers import AttentionInterface, AttentionMaskInterface

    sys.path.insert(0, BENCH)
    try:
        import bench_generate
        import generate_probe
    finally:
        sys.path.remove(BENCH)
    import torch

    cfg = bench_generate.config(True, 64)
    model = bench_generate.build(cfg, torch.float32, torch.device("cpu"))
    ids = torch.randint(1, cfg.vocab_size, (1, 8))
    before = (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping))
    for impl in ("sdpa", "ffuse"):
        h = generate_probe.host_split(model, impl, ids, 6, "dynamic")
        assert h["attention_calls_per_token"] == cfg.num_hidden_layers
        assert 0 < h["attention_us"] and 0 < h["mask_us"]
        assert h["attention_us"] + h["mask_us"] < h["token_us"]
    assert (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)) == before
