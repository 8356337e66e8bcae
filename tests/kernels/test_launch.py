"""The launch helpers of ``flashfuse.kernels.launch`` that need no GPU."""

from __future__ import annotations

import pytest
import torch
import triton

from flashfuse.kernels.launch import ConfigLauncher, OutOfResources, descriptor_loads


class _RecordingKernel:
    """Stands in for a Triton kernel: records launches, and refuses the
    configs whose BLOCK_M is in ``too_big`` as a GPU short of shared memory
    would (before anything runs)."""

    def __init__(self, too_big=()):
        self.too_big = set(too_big)
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs["BLOCK_M"] in self.too_big:
                raise OutOfResources(300_000, 232_448, "shared memory")
            self.launches.append((grid, args, kwargs))
        return launch


def _cfg(bm, warps=4, stages=2):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": 32}, num_warps=warps, num_stages=stages)


def test_fixed_launcher_skips_configs_that_do_not_fit_and_remembers_the_choice():
    kernel = _RecordingKernel(too_big={128, 64})
    launcher = ConfigLauncher(kernel)
    asked = []

    def candidates():
        asked.append(1)
        return [_cfg(128), _cfg(64, warps=8), _cfg(32, stages=3), _cfg(16)]

    grid = lambda m: (100 // m["BLOCK_M"], 2, 3)  # noqa: E731
    launcher("key", candidates, grid, "x", 7, FLAG=True)
    launcher("key", candidates, grid, "y", 8, FLAG=True)
    assert len(asked) == 1, "candidates are computed once per key"
    assert [(g, a) for g, a, _ in kernel.launches] == [((3, 2, 3), ("x", 7)), ((3, 2, 3), ("y", 8))]
    kw = kernel.launches[0][2]
    assert (kw["BLOCK_M"], kw["num_warps"], kw["num_stages"], kw["FLAG"]) == (32, 4, 3, True)

    launcher("other", lambda: [_cfg(16)], grid, "z")
    assert kernel.launches[-1][2]["BLOCK_M"] == 16


def test_fixed_launcher_reports_when_no_config_fits():
    launcher = ConfigLauncher(_RecordingKernel(too_big={128, 64}))
    with pytest.raises(OutOfResources):
        launcher("key", lambda: [_cfg(128), _cfg(64)], lambda m: (1, 1, 1))


def test_tuning_launcher_times_the_configs_that_fit_and_keeps_the_fastest():
    kernel = _RecordingKernel(too_big={128})
    launcher = ConfigLauncher(kernel)
    speed = {128: 0.1, 64: 3.0, 32: 1.0, 16: 2.0}  # ms; 128 is fastest but does not fit
    launched = []

    def timer(run):
        n = len(kernel.launches)
        run()
        launched.append(kernel.launches[n][2]["BLOCK_M"])
        return speed[launched[-1]]

    launcher.timer = timer
    grid = lambda m: (1, 1, 1)  # noqa: E731
    launcher("key", lambda: [_cfg(128), _cfg(64), _cfg(32), _cfg(16)], grid, "x", tune=True)
    assert launched == [64, 32, 16], "every config that fits is timed once"
    assert launcher.chosen[("key", True)].kwargs["BLOCK_M"] == 32
    assert [ms for _, ms in launcher.timings[("key", True)]] == [3.0, 1.0, 2.0]
    # the real launch comes last, with the winner
    assert kernel.launches[-1][2]["BLOCK_M"] == 32 and kernel.launches[-1][1] == ("x",)
    n = len(kernel.launches)
    launcher("key", lambda: [], grid, "y", tune=True)
    assert len(kernel.launches) == n + 1 and kernel.launches[-1][2]["BLOCK_M"] == 32


def test_fingerprint_is_at_least_as_fine_as_triton_specialisation():
    import torch

    from flashfuse.kernels.launch import _fingerprint

    t = torch.empty(64, dtype=torch.float16)
    assert _fingerprint([t]) != _fingerprint([t[1:]]), "16-byte alignment"
    assert _fingerprint([t]) != _fingerprint([t.float()]), "dtype"
    assert _fingerprint([1]) != _fingerprint([17]), "equal to 1"
    assert _fingerprint([32]) != _fingerprint([33]), "multiple of 16"
    assert _fingerprint([16]) != _fingerprint([2 ** 36]), "64-bit integers"
    assert _fingerprint([True]) != _fingerprint([1])
    assert _fingerprint([48, 3, 2.5]) == _fingerprint([64, 5, 0.5])


def test_host_arithmetic_matches_triton():
    from flashfuse.kernels.launch import cdiv, next_pow2

    for a in (0, 1, 2, 15, 16, 17, 127, 128, 129, 4095, 4097, 2 ** 21 + 3):
        assert next_pow2(max(a, 1)) == triton.next_power_of_2(max(a, 1)), a
        for b in (1, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


class _FakeBinary:
    """A compiled kernel's launch interface, recording what it is given."""

    packed_metadata = "meta"
    function = "fn"

    def __init__(self):
        self.runs = []

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, leave, *args):
        self.runs.append(((g0, g1, g2), stream, args))

    def launch_metadata(self, grid, stream, *args):
        return None


class _FakeJit:
    """Stands in for a JITFunction: ``fn`` gives the signature, indexing by a
    grid launches through "Triton's own path" and returns the binary of the
    arguments' 16-byte alignment."""

    def __init__(self):
        def fn(X, n, flag, BLOCK_M, BLOCK_N, EXTRA=7):
            pass

        self.fn = fn
        self.slow = []
        self.binaries = {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            aligned = args[0].data_ptr() % 16 == 0
            return self.binaries.setdefault(aligned, _FakeBinary())
        return launch


def test_direct_launch_passes_every_parameter_in_order_and_respects_specialisation(monkeypatch):
    import torch

    from flashfuse.kernels import launch

    monkeypatch.setattr(launch, "_current_stream", lambda: 99)
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))
    kernel = _FakeJit()
    launcher = ConfigLauncher(kernel)
    grid = lambda m: (64 // m["BLOCK_M"], 3)  # noqa: E731
    x = torch.zeros(64, dtype=torch.float16)
    launcher("k", lambda: [_cfg(16)], grid, x, 5, flag=True)  # chooses: Triton's path
    launcher("k", lambda: [], grid, x, 6, flag=True)  # first of this fingerprint: Triton's path
    assert len(kernel.slow) == 2 and not kernel.binaries[True].runs
    launcher("k", lambda: [], grid, x, 8, flag=True)  # same fingerprint: direct
    assert len(kernel.slow) == 2
    (g, stream, args), = kernel.binaries[True].runs
    assert g == (4, 3, 1) and stream == 99
    assert args == (x, 8, True, 16, 32, 7), "positional, keyword, config, default, in signature order"
    launcher("k", lambda: [], grid, x[1:], 8, flag=True)  # misaligned: a new fingerprint
    assert len(kernel.slow) == 3 and kernel.slow[-1][1][0].data_ptr() % 16 != 0
    launcher("k", lambda: [], grid, x, 16, flag=True)  # multiple of 16: a new fingerprint
    assert len(kernel.slow) == 4


def test_forget_drops_the_choice_and_its_binaries(monkeypatch):
    import torch

    from flashfuse.kernels import launch

    monkeypatch.setattr(launch, "_current_stream", lambda: 0)
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))
    kernel = _FakeJit()
    launcher = ConfigLauncher(kernel)
    grid = lambda m: (64 // m["BLOCK_M"],)  # noqa: E731
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):  # choose, cache the binary, launch it directly
        launcher("k", lambda: [_cfg(16)], grid, x, 5, flag=True)
    launcher.forget()
    launcher("k", lambda: [_cfg(32)], grid, x, 5, flag=True)
    launcher("k", lambda: [], grid, x, 5, flag=True)
    # The new choice runs through Triton's path with its own meta-parameters,
    # never through the binary cached for the old one.
    assert [kw["BLOCK_M"] for _, _, kw in kernel.slow] == [16, 16, 32, 32]
    assert [r[0] for r in kernel.binaries[True].runs] == [(4, 1, 1)]


def test_tuning_cache_spares_a_new_process_the_timing(monkeypatch, tmp_path):
    import json

    path = tmp_path / "cache" / "tuning.json"
    monkeypatch.setenv("FLASHFUSE_TUNING_CACHE", str(path))
    speed = {64: 3.0, 32: 1.0, 16: 2.0}
    candidates = lambda: [_cfg(64), _cfg(32), _cfg(16)]  # noqa: E731
    grid = lambda m: (1, 1, 1)  # noqa: E731

    def timed_launcher(kernel, name="k"):
        launcher = ConfigLauncher(kernel, name=name)
        launcher.timer = lambda run: (run(), speed[kernel.launches[-1][2]["BLOCK_M"]])[1]
        return launcher

    first = _RecordingKernel()
    timed_launcher(first)(("key", 1), candidates, grid, "x", tune=True)
    assert len(first.launches) == 7, "three candidates tried and timed, one real launch"
    assert len(json.loads(path.read_text())) == 1

    def no_timing(run):
        raise AssertionError("timed although the cache holds the choice")

    # a new process: a fresh launcher and a fresh in-memory view of the file
    from flashfuse.kernels import launch

    monkeypatch.setattr(launch, "TUNING_CACHE", launch.TuningCache())
    again = _RecordingKernel()
    launcher = ConfigLauncher(again, name="k")
    launcher.timer = no_timing
    launcher(("key", 1), candidates, grid, "y", tune=True)
    assert [(a, kw["BLOCK_M"]) for _, a, kw in again.launches] == [(("y",), 32)]

    # another kernel name or key is timed; an entry naming no candidate is ignored
    other = _RecordingKernel()
    timed_launcher(other, name="other")(("key", 1), candidates, grid, "z", tune=True)
    assert len(other.launches) == 7
    stale = _RecordingKernel()
    timed_launcher(stale)(("key", 1), lambda: [_cfg(64), _cfg(16)], grid, "w", tune=True)
    assert len(stale.launches) == 5 and stale.launches[-1][2]["BLOCK_M"] == 16


def test_tuning_cache_survives_a_broken_file_and_can_be_turned_off(monkeypatch, tmp_path):
    from flashfuse.kernels import launch

    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    monkeypatch.setenv("FLASHFUSE_TUNING_CACHE", str(path))
    cache = launch.TuningCache()
    assert cache.lookup("k", "key", [_cfg(16)]) is None
    cache.store("k", "key", _cfg(16))
    assert launch.TuningCache().lookup("k", "key", [_cfg(32), _cfg(16)]).kwargs["BLOCK_M"] == 16

    monkeypatch.setenv("FLASHFUSE_TUNING_CACHE", "0")
    off = launch.TuningCache()
    off.store("k", "key2", _cfg(16))
    assert off.lookup("k", "key2", [_cfg(16)]) is None


# -- tensor-descriptor loads ----------------------------------------------------


def _bhld(B=2, H=3, L=37, D=40, dtype=torch.bfloat16):
    return torch.randn(B, H, L, D).to(dtype)


def test_descriptor_loads_only_where_the_copy_engine_can_read(monkeypatch):
    """The rules of ``descriptor_loads`` under the interpreter, where only
    FLASHFUSE_TMA=1 turns them on: the layout must still suit the copy engine."""
    t = _bhld()
    monkeypatch.delenv("FLASHFUSE_TMA", raising=False)
    assert not descriptor_loads(t, t), "the interpreter uses them only when forced"
    monkeypatch.setenv("FLASHFUSE_TMA", "1")
    assert descriptor_loads(t, t)
    assert descriptor_loads(t.transpose(1, 2).contiguous().transpose(1, 2)), "any 16-byte strides"
    flat = torch.randn(2 * 3 * 37 * 40 + 1).to(torch.bfloat16)
    misaligned = flat[1:].view(2, 3, 37, 40)
    assert not descriptor_loads(t, misaligned), "base not 16-byte aligned"
    assert not descriptor_loads(_bhld(D=20)), "rows of 40 bytes: strides not multiples of 16 bytes"
    assert not descriptor_loads(t.transpose(2, 3).contiguous().transpose(2, 3)), "last stride must be 1"
    assert not descriptor_loads(t[:, :, :1].expand(2, 3, 37, 40)), "stride 0 over rows"
    assert descriptor_loads(t[:, :1].expand(2, 3, 37, 40)) is False, "stride 0 over heads"
    monkeypatch.setenv("FLASHFUSE_TMA", "0")
    assert not descriptor_loads(t, t)


def test_descriptor_loads_never_while_tracing(monkeypatch):
    """Fake tensors have no address to check alignment on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("FLASHFUSE_TMA", "1")
    with FakeTensorMode():
        t = _bhld()
        assert not descriptor_loads(t, t)


class _CompilingKernel:
    """Stands in for a JITFunction on the traced path: ``warmup`` compiles
    (here: reports the shared memory a config would need) without running."""

    def __init__(self, shared_by_block_m, refuse=()):
        self.shared_by_block_m = shared_by_block_m
        self.refuse = set(refuse)
        self.compiled = []

    def fn(self, X, n, BLOCK_M, BLOCK_N):  # the signature ConfigLauncher reads
        pass

    def warmup(self, *args, grid, **kwargs):
        self.compiled.append((args, kwargs["BLOCK_M"]))
        if kwargs["BLOCK_M"] in self.refuse:
            raise OutOfResources(1, 0, "shared memory")

        class Compiled:
            class metadata:
                shared = self.shared_by_block_m[kwargs["BLOCK_M"]]
        return Compiled


def test_traced_launch_takes_the_first_config_whose_compiled_kernel_fits(monkeypatch):
    import flashfuse.kernels.launch as launch

    monkeypatch.setattr(launch, "max_shared_mem", lambda index: 100_000)
    kernel = _CompilingKernel({128: 300_000, 64: 99_000, 32: 10_000}, refuse={256})
    launcher = ConfigLauncher(kernel)
    x = torch.randn(4)
    n = 5
    cands = [_cfg(256), _cfg(128), _cfg(64), _cfg(32)]
    cfg = launcher._first_fitting("key", cands, (x, n), {})
    assert cfg.kwargs["BLOCK_M"] == 64, "256 fails to compile, 128 needs too much shared memory"
    # Tensors are compiled as their dtypes (Triton's stand-ins), numbers as they are.
    assert kernel.compiled[0][0] == (torch.float32, 5)
    assert launcher._first_fitting("key", cands, (x, n), {}) is cfg and len(kernel.compiled) == 3, "once per key"


def test_traced_launch_with_no_fitting_config_raises_a_clear_error(monkeypatch):
    import flashfuse.kernels.launch as launch

    monkeypatch.setattr(launch, "max_shared_mem", lambda index: 1_000)
    launcher = ConfigLauncher(_CompilingKernel({128: 300_000, 64: 99_000}))
    with pytest.raises(launch.NoKernelConfig, match="no .* config fits this GPU"):
        launcher._first_fitting("key", [_cfg(128), _cfg(64)], (torch.randn(2),), {})


def test_dry_run_chooses_a_config_and_launches_nothing(monkeypatch):
    import flashfuse.kernels.launch as launch

    monkeypatch.setattr(launch, "max_shared_mem", lambda index: 100_000)
    kernel = _CompilingKernel({128: 300_000, 64: 99_000})
    launcher = ConfigLauncher(kernel)
    launched = []
    monkeypatch.setattr(launcher, "_launch", lambda *a: launched.append(a))
    with launch.dry_run():
        launcher("key", lambda: [_cfg(128), _cfg(64)], lambda m: (1,), torch.randn(2), 3)
    assert not launched and launcher.fitting[("key", False)].kwargs["BLOCK_M"] == 64
    monkeypatch.setattr(launch, "max_shared_mem", lambda index: 10)
    with launch.dry_run(), pytest.raises(launch.NoKernelConfig):
        launcher("other", lambda: [_cfg(128), _cfg(64)], lambda m: (1,), torch.randn(2), 3)


def test_symbolic_sizes_are_hinted_without_a_guard_and_head_dims_specialised():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import flashfuse.kernels.launch as launch

    env = ShapeEnv()
    n, d = (env.create_symintnode(env.create_symbol(val, ConstantSource(name)), hint=val)
            for val, name in ((3, "n"), (80, "d")))
    assert isinstance(n, torch.SymInt) and isinstance(d, torch.SymInt)
    assert launch.hint(n) == 3 and launch._bucket(n, 1 << 16) == 4
    assert not env.guards, "hints take no guard"
    assert launch.static_int(d) == 80 and len(env.guards) == 1, "a head dim is specialised with a guard"
    assert hash((launch.static_int(d), "key")) is not None  # the launchers' keys hold it


def test_empty_launch_hook_chains_are_passed_as_none(monkeypatch):
    """Triton keeps its launch hooks in chains that are never None; an empty
    chain calls nothing, so a direct launch passes None and builds no
    launch metadata, and a chain with a hook is passed with the metadata."""
    import triton

    from flashfuse.kernels import launch

    runtime = triton.knobs.runtime
    HookChain = getattr(triton.knobs, "HookChain", None)
    if HookChain is None:
        pytest.skip("this Triton has no hook chains")
    monkeypatch.setattr(runtime, "launch_enter_hook", HookChain())
    monkeypatch.setattr(runtime, "launch_exit_hook", HookChain(reversed=True))
    assert launch._launch_hooks() == (None, None)

    class Binary:
        function, packed_metadata = 7, 8

        def __init__(self):
            self.metadata_calls, self.runs = 0, []

        def launch_metadata(self, grid, stream, *args):
            self.metadata_calls += 1
            return {"grid": grid}

        def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
            self.runs.append((metadata, enter, leave, args))

    binary = Binary()
    kept = launch.KeptBinary(binary, (5,))
    assert kept.c_launch is None, "not Triton's CUDA launcher: launched through its run"
    launch.run_binary(kept, (1, 2, 3), (4,), 0)
    assert binary.metadata_calls == 0 and binary.runs[-1] == (None, None, None, (4, 5))
    seen = []
    runtime.launch_exit_hook.add(seen.append)
    launch.run_binary(kept, (1, 2, 3), (4,), 0)
    metadata, enter, leave, _ = binary.runs[-1]
    assert binary.metadata_calls == 1 and metadata == {"grid": (1, 2, 3)}
    assert enter is None and leave is runtime.launch_exit_hook


class CudaLauncher:
    """A stand-in with the calling convention of Triton 3.6's CUDA launcher
    wrapper (``launch._C_LAUNCH_WRAPPER``): scratch buffers asked for, then
    the C launch with the flags and the scratch before the arguments."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.c_calls, self.wrapper_calls = [], 0
        self.launch = lambda *a: self.c_calls.append(a)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.wrapper_calls += 1
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


def test_kept_binary_calls_the_c_launch_as_the_known_wrapper_would(monkeypatch):
    """Where a binary's launcher is the wrapper ``run_binary`` knows (from
    its source) and needs no scratch, the launch skips the wrapper and
    passes the C launch exactly what the wrapper passes; with a launch hook
    set, or scratch needed, or another wrapper, the launcher runs as it is."""
    import triton

    from flashfuse.kernels import launch

    class Binary:
        function, packed_metadata = 7, (4, 1, 0)

        def __init__(self, run):
            self.run = run

        def launch_metadata(self, grid, stream, *args):
            return {"grid": grid}

    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))
    launcher = CudaLauncher()
    kept = launch.KeptBinary(Binary(launcher), (5, 6))
    assert kept.c_launch is launcher.launch
    launch.run_binary(kept, (1, 2, 3), (4, 0x1000), 99)
    wrapped = CudaLauncher()
    Binary(wrapped).run(1, 2, 3, 99, 7, (4, 1, 0), None, None, None, 4, 0x1000, 5, 6)
    assert launcher.wrapper_calls == 0 and launcher.c_calls == wrapped.c_calls
    assert launcher.c_calls == [(1, 2, 3, 99, 7, False, True, None, None, (4, 1, 0), None, None, None, 4, 0x1000, 5, 6)]

    hook = object()
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (hook, None))
    launch.run_binary(kept, (1, 2, 3), (4,), 99)
    assert launcher.wrapper_calls == 1, "a launch hook: Triton's launcher, with the metadata and hooks"
    assert launcher.c_calls[-1][9:13] == ((4, 1, 0), {"grid": (1, 2, 3)}, hook, None)

    assert launch.KeptBinary(Binary(CudaLauncher(global_scratch_size=64)), ()).c_launch is None
    assert launch.KeptBinary(Binary(CudaLauncher(profile_scratch_size=64)), ()).c_launch is None

    class OtherCudaLauncher(CudaLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, *args)

    OtherCudaLauncher.__name__ = "CudaLauncher"
    assert launch.KeptBinary(Binary(OtherCudaLauncher()), ()).c_launch is None, "another wrapper: not bypassed"
    # This Triton's own wrapper: the one the check was written against on
    # Triton 3.6 (the GPU machine's), another on Triton 3.9 (this CPU's).
    from triton.backends.nvidia import driver

    if triton.__version__.startswith(("3.6", "3.9.0")):
        assert launch._c_launch_form(driver.CudaLauncher) == ("args" if triton.__version__.startswith("3.6")
                                                             else "packed")


def _installed_launcher(**attributes):
    """This Triton's own CUDA launcher, made without compiling anything (its
    ``__init__`` builds a C module): the attributes its wrapper reads, and
    a C launch that records its calls."""
    from triton.backends.nvidia import driver

    run = object.__new__(driver.CudaLauncher)
    run.c_calls = []
    run.launch = lambda *a: run.c_calls.append(a)
    values = dict(num_ctas=1, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                  profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True, gsan_enabled=False,
                  arg_annotations=("annotations",), kernel_signature=b"signature")
    values.update(attributes)
    for name, value in values.items():
        setattr(run, name, value)
    return run


def test_kept_binary_calls_the_c_launch_as_this_tritons_wrapper_does(monkeypatch):
    """With this Triton's own launcher class (3.6's form on the GPU
    machine, 3.9's packed form on the CPU's), a kept binary's C call gets
    exactly what the real wrapper, run on the same arguments, passes its C
    launch; 3.9's wrapper with its sanitiser on is called as it is."""
    import types

    import triton
    from triton.backends.nvidia import driver

    from flashfuse.kernels import launch

    if launch._c_launch_form(driver.CudaLauncher) is None:
        pytest.skip(f"Triton {triton.__version__}'s launcher is not a form run_binary bypasses")
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))

    class Driver:  # what the wrapper asks of the active driver (3.9: nothing, without scratch)
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())  # (restored after the test)
    run = _installed_launcher()
    binary = types.SimpleNamespace(run=run, function=7, packed_metadata=(4, 1, 0))
    kept = launch.KeptBinary(binary, (5, 6))
    assert kept.c_launch is run.launch
    launch.run_binary(kept, (1, 2, 3), (4, 0x1000), 99)
    type(run).__call__(run, 1, 2, 3, 99, 7, (4, 1, 0), None, None, None, 4, 0x1000, 5, 6)
    ours, wrappers = run.c_calls
    assert ours == wrappers and type(ours[-1]) is type(wrappers[-1])
    if kept.c_packed:
        sanitised = launch.KeptBinary(types.SimpleNamespace(run=_installed_launcher(gsan_enabled=True),
                                                            function=7, packed_metadata=(4, 1, 0)), ())
        assert sanitised.c_launch is None, "GSan appends arguments: its wrapper runs"


@pytest.mark.gpu
def test_gpu_c_launches_match_the_launchers():
    """On the GPU: a decode call (its tensors as addresses) and a Hopper or
    portable forward launched through their kept binaries' C launches give
    bitwise what Triton's launcher gives; on Triton 3.6, whose wrapper
    ``run_binary`` knows, the kept binaries that need no scratch buffer
    have C launches."""
    import gc

    import flashfuse
    from flashfuse.kernels import launch

    torch.manual_seed(0)
    q = torch.randn(2, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 3000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qf, kf, vf = (torch.randn(2, 8, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = dict(is_causal=True, alignment="bottom_right", enable_gqa=True)

    def run():
        return [flashfuse.attention(q, k, v, **kw) for _ in range(3)][-1], [
            flashfuse.attention(qf, kf, vf, is_causal=True) for _ in range(3)][-1]

    fast = run()
    kept = [b for L in _decode_launches() for b in L.binaries if b is not None]
    assert kept, "the decode call kept its binaries"
    kept_elsewhere = [b for obj in gc.get_objects() if isinstance(obj, (launch.ConfigLauncher, launch.DirectLaunch))
                      for b in obj._binaries.values()]
    assert len(kept_elsewhere) > len(kept), "the forward kept its binaries too"
    if triton.__version__.startswith("3.6"):
        # Every binary without scratch buffers (kernels that build tensor
        # descriptors on the device need a global scratch) has a C launch.
        def scratch(b):
            return b.binary.run.global_scratch_size > 0 or b.binary.run.profile_scratch_size > 0

        assert all((b.c_launch is None) == scratch(b) for b in kept + kept_elsewhere)
        assert all(b.c_launch is not None for b in kept)
    for b in kept + kept_elsewhere:
        b.c_launch = None
    for L in _decode_launches():
        L.c_launch = False
    from flashfuse.kernels import decode

    for step in decode._LANE_STEPS.values():  # the lane steps' direct launches hold the C launch too
        step.direct = None
    slow = run()
    torch.cuda.synchronize()
    for got, want in zip(fast, slow):
        assert torch.equal(got, want)
    want = flashfuse.reference.reference_attention(q.double(), k.double(), v.double(), window_right=0,
                                                   bottom_right=True)
    torch.testing.assert_close(fast[0].double(), want, atol=2e-2, rtol=2e-2)


def _decode_launches():
    from flashfuse.kernels import decode

    return [L for plan in decode._PLANS.values() for L in plan.launches.values()]
