"""Host side of the kernels: how a launch finds its config and binary.

``ConfigLauncher`` chooses one config per kernel and key (timed when
autotuning, else the first that fits), then launches the compiled binary
directly; ``TuningCache`` keeps tuned choices on disk; the small helpers below
decide what the launchers are keyed on. Nothing here is a kernel: the rules
the kernels share are in ``common``.
"""

import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import os

import torch
import triton
from triton.runtime.errors import OutOfResources
from torch._subclasses.fake_tensor import FakeTensor

from .. import config

_log = logging.getLogger("flashfuse")


def _autotune_enabled() -> bool:
    """Autotune on CUDA unless FLASHFUSE_AUTOTUNE=0.

    Autotuning benchmarks every candidate config once per (size bucket, head
    dims, flags): seconds on the first call of each, then the best config.
    With FLASHFUSE_AUTOTUNE=0 each kernel takes the first candidate that fits
    (the lists are ordered best-first from H200 measurements at D = 128, bf16,
    4k-16k tokens): one compile per kernel variant, for quick start-up and
    test suites, at some cost in speed elsewhere (see bench/NOTES.md).
    """
    return config.autotune()


class ConfigLauncher:
    """Launch one Triton kernel with a config chosen once per key, then
    through its compiled binary. ``chosen`` maps ``(key, tune)`` to the
    config.

    ``key`` must capture everything the candidate list and the compiled
    kernel depend on apart from the arguments' specialisation (dtype, head
    dims, constexpr flags, device). On the first call of a key the launcher
    takes the first candidate that compiles within the GPU's resources, or,
    when ``tune`` is set, times every candidate that fits and keeps the
    fastest. Later calls cost a dict lookup.

    Launches then skip ``JITFunction.run`` (argument binding, cache-key
    hashing, option parsing: about 40 us of host time per launch on an H200
    host, more than some of the kernels take). The compiled binary is cached
    per key and per *specialisation fingerprint* of the runtime arguments:
    every property Triton specialises a kernel on (a tensor's dtype and
    16-byte alignment; an integer being 1, a multiple of 16, or beyond
    32 bits). A fingerprint never seen goes through Triton's own launch path,
    which compiles or finds the right binary, and is remembered.

    ``reset_to_zero``: names of tensor arguments the kernel accumulates into
    (atomics); they are zeroed before every benchmarked or repeated launch.
    Tuned choices are also kept on disk (``TUNING_CACHE``), under ``name``
    (default: the kernel's), so that later processes skip the timing.
    """

    def __init__(self, kernel, reset_to_zero=(), name=None):
        self.kernel = kernel
        self.name = name or getattr(getattr(kernel, "fn", kernel), "__name__", type(kernel).__name__)
        self.chosen: dict = {}
        self.timings: dict = {}  # (key, True) -> [(config, ms)] of a tuned choice
        self.fitting: dict = {}  # key -> first candidate that fits, for traced launches
        self._binaries: dict = {}
        # Called by forget(): callers holding this launcher's binaries (the
        # decode path's launch plans) drop them too.
        self.forget_hooks: list = []
        fn = getattr(kernel, "fn", None)  # the JITFunction's Python function
        self._params = list(inspect.signature(fn).parameters.values()) if fn is not None else None
        names = [p.name for p in self._params] if self._params is not None else []
        self._reset_pos = [names.index(n) for n in reset_to_zero]

    def forget(self) -> None:
        """Drop every choice and cached binary (the next call chooses again).
        The binary cache is keyed by the launcher key, not the config, so the
        two must be dropped together."""
        self.chosen.clear()
        self.timings.clear()
        self.fitting.clear()
        self._binaries.clear()
        for hook in self.forget_hooks:
            hook()

    def binary(self, key, args, kwargs, tune=False):
        """The ``KeptBinary`` this launcher launches for these arguments
        under ``key`` (``run_binary`` takes it), or None while it has none
        yet (the first launches of a key go through the chooser and Triton's
        own path). For callers that cache a launch whole: the same key and
        specialisation fingerprint then launch the same binary."""
        if self._params is None:
            return None
        return self._binaries.get(((key, tune), _fingerprint(args), tuple(kwargs.items())))

    def __call__(self, key, candidates, grid, *args, tune=False, **kwargs):
        """``candidates()``: configs in preference order; ``grid(cfg)``: the
        launch grid for a config's meta-parameters (a dict)."""
        key = (key, tune)  # a tuned choice and an untuned one are kept apart
        if _DRY_RUN.get():  # a probe (``flashfuse.kernels.launch_problem``): choose, launch nothing
            self._traced_config(key, candidates, args, kwargs, tune)
            return
        if _traced(args):
            self._record(key, candidates, grid, args, kwargs, tune)
            return
        cfg = self.chosen.get(key)
        if cfg is None:
            # Without tuning, the first launch that fits was the real one.
            if self._choose(key, candidates, grid, args, kwargs, tune):
                return
            cfg = self.chosen[key]
            self._zero(args)
        self._launch_fast(key, cfg, grid, args, kwargs)

    def _record(self, key, candidates, grid, args, kwargs, tune):
        """Put the launch into the graph being traced (``torch.compile``), so
        that Inductor launches the kernel from its generated code instead of
        calling back into this Python on every step.

        Nothing runs while tracing, so nothing can be timed: the config is
        the one this process already chose for the key (tuned by an earlier
        eager call, or untuned), else the tuning cache's, else the first
        candidate (untuned eager calls take the first that fits the GPU,
        which the candidate lists' pruning makes the first in practice).
        """
        from torch.library import wrap_triton

        cfg = self._traced_config(key, candidates, args, kwargs, tune)
        wrap_triton(self.kernel)[grid(cfg.kwargs)](
            *args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def _traced_config(self, key, candidates, args, kwargs, tune):
        """The config of a launch that cannot run (traced, or a dry run):
        this process's choice for the key, else the tuning cache's, else the
        first candidate that fits the GPU."""
        cfg = self.chosen.get(key)
        if cfg is not None:
            return cfg
        cands = list(candidates())
        if tune:
            cfg = TUNING_CACHE.lookup(self.name, key, cands)
        return cfg if cfg is not None else self._first_fitting(key, cands, args, kwargs)

    def _first_fitting(self, key, cands, args, kwargs):
        """The first candidate whose compiled kernel fits the GPU, for a
        traced launch: nothing can run, so each candidate is compiled (not
        launched) on stand-ins of the arguments until one needs no more
        shared memory than the device has. Eager calls find the same by
        launching (``_choose``); without this, a traced graph would take a
        config that Inductor then fails to load (fp32 at large head dims).
        Raises ``NoKernelConfig`` when none fits."""
        cfg = self.fitting.get(key)
        if cfg is not None:
            return cfg
        if not hasattr(self.kernel, "warmup"):  # not a JITFunction: nothing to compile
            self.fitting[key] = cands[0]
            return cands[0]
        # Triton takes a dtype for a tensor (assuming an aligned address).
        standins = [a.dtype if isinstance(a, torch.Tensor) else hint(a) for a in args]
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        cuda = device.type == "cuda"
        limit = device_shared_mem(device)
        needs = []
        for cfg in cands:
            try:
                with torch.cuda.device(device) if cuda else contextlib.nullcontext():
                    compiled = self.kernel.warmup(*standins, grid=(1,), **kwargs, **cfg.kwargs,
                                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            except OutOfResources as exc:
                needs.append(f"{_describe_config(cfg)}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - no GPU toolchain to ask (a tracing harness)
                _log.debug("flashfuse: cannot compile %s ahead of its launch (%s); taking it untested", self.name, exc)
                self.fitting[key] = cfg
                return cfg
            shared = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
            if shared <= limit:
                self.fitting[key] = cfg
                return cfg
            needs.append(f"{_describe_config(cfg)}: {shared} bytes of shared memory")
        raise NoKernelConfig(
            f"flashfuse: no {self.name} config fits this GPU ({limit} bytes of shared memory per block); "
            f"tried {len(cands)}: " + "; ".join(needs))

    # -- choosing ---------------------------------------------------------

    def _choose(self, key, candidates, grid, args, kwargs, tune) -> bool:
        """Pick the config for ``key``; True when that already launched it
        on these arguments (untuned, or tuned earlier and read from the
        tuning cache), False when timing runs have clobbered the outputs and
        a real launch must follow."""
        error, timed = None, []
        candidates = list(candidates())
        stored = TUNING_CACHE.lookup(self.name, key, candidates) if tune else None
        if stored is not None:
            try:
                self._zero(args)
                self._launch(stored, grid, args, kwargs)
            except OutOfResources:  # another GPU wrote that entry: time afresh
                pass
            else:
                self.chosen[key] = stored
                return True
        for cfg in candidates:
            try:
                self._zero(args)
                self._launch(cfg, grid, args, kwargs)
            except OutOfResources as exc:  # raised before anything runs
                error = exc
                continue
            if not tune:
                self.chosen[key] = cfg
                return True
            timed.append((cfg, self._time(cfg, grid, args, kwargs)))
        if not timed:
            raise error if error is not None else RuntimeError("flashfuse: no kernel config to launch")
        self.timings[key] = timed
        self.chosen[key] = min(timed, key=lambda ct: ct[1])[0]
        TUNING_CACHE.store(self.name, key, self.chosen[key])
        return False

    def _time(self, cfg, grid, args, kwargs) -> float:
        def run():
            self._zero(args)
            self._launch(cfg, grid, args, kwargs)

        return self.timer(run)

    @staticmethod
    def timer(run) -> float:
        """Median milliseconds of ``run()`` on the GPU."""
        from triton.testing import do_bench

        return do_bench(run, warmup=5, rep=25)

    def _zero(self, args):
        for i in self._reset_pos:
            args[i].zero_()

    # -- launching --------------------------------------------------------

    def _launch(self, cfg, grid, args, kwargs):
        """Triton's own launch path; returns the compiled kernel."""
        g = grid(cfg.kwargs)
        return self.kernel[g](*args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)

    def _launch_fast(self, key, cfg, grid, args, kwargs):
        if self._params is None:  # not a JITFunction (tests' stand-ins)
            self._launch(cfg, grid, args, kwargs)
            return
        fp = (key, _fingerprint(args), tuple(kwargs.items()))
        cached = self._binaries.get(fp)
        if cached is None:
            binary = self._launch(cfg, grid, args, kwargs)
            if binary is not None and hasattr(binary, "packed_metadata"):
                # Keyword arguments, then the config's meta-parameters: fixed by
                # the fingerprint, so computed once per binary.
                self._binaries[fp] = KeptBinary(binary, _param_tail(self._params, args, kwargs, cfg.kwargs))
            return
        run_binary(cached, _grid3(grid(cfg.kwargs)), args, _current_stream())


class DirectLaunch:
    """A kernel launched through Triton's own path once per signature and
    directly through the compiled binary after that (``run_binary``), for
    kernels launched with one fixed config (the Hopper kernels and their
    convert kernel). Triton's ``kernel[grid](...)`` binds and specialises
    every argument in Python at each call, about as long as the rest of an
    eager call's host work together (bench/NOTES.md run 26).

    ``__call__(grid, args, meta)``: ``args`` the positional arguments,
    ``meta`` the keyword ones (constexprs and launch options such as
    ``num_warps`` / ``maxnreg``). The binary is kept per device and per
    (specialisation fingerprint of ``args``, ``meta``), which fixes every
    compile-time choice, so a launch never takes a binary compiled for
    other arguments."""

    def __init__(self, kernel):
        self.kernel = kernel
        fn = getattr(kernel, "fn", None)  # None: a stand-in (tests), always launched as given
        self._params = list(inspect.signature(fn).parameters.values()) if fn is not None else None
        self._binaries: dict = {}

    def __call__(self, grid: tuple, args: tuple, meta: dict) -> None:
        if self._params is None or _interpreting(args[0]):
            self.kernel[grid](*args, **meta)
            return
        device = torch.cuda.current_device()
        key = (device, _fingerprint(args), tuple(meta.items()))
        cached = self._binaries.get(key)
        if cached is None:
            binary = self.kernel[grid](*args, **meta)
            if binary is not None and hasattr(binary, "packed_metadata"):
                self._binaries[key] = KeptBinary(binary, _param_tail(self._params, args, meta))
            return
        run_binary(cached, _grid3(grid), args, _device_stream(device))


def _param_tail(params, args: tuple, *sources: dict) -> tuple:
    """The values of the kernel parameters ``params`` after the positional
    ``args`` (``run_binary``'s tail): each from the first of ``sources``
    that names it, else its default."""
    tail = []
    for p in params[len(args):]:
        for source in sources:
            if p.name in source:
                tail.append(source[p.name])
                break
        else:
            if p.default is inspect.Parameter.empty:  # Triton's own launch would have refused this already
                raise TypeError(f"flashfuse: kernel argument {p.name!r} not given")
            tail.append(p.default)
    return tuple(tail)


def _grid3(grid: tuple) -> tuple[int, int, int]:
    """A launch grid of one to three sizes as the three a binary takes."""
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


class KeptBinary:
    """A compiled binary kept for direct launches (``run_binary``): the
    binary, ``tail`` (the values of the parameters after the runtime
    arguments: keywords, then the config's meta-parameters, fixed per
    binary), and, where Triton's launcher allows it, its C launch and what
    to pass it before the arguments (``c_launch``, ``c_head``; see
    ``_c_launch_of``)."""

    __slots__ = ("binary", "tail", "c_launch", "c_head", "c_packed")

    def __init__(self, binary, tail: tuple):
        self.binary, self.tail = binary, tail
        self.c_launch, self.c_head, self.c_packed = _c_launch_of(binary)


def run_binary(kept: KeptBinary, grid3, args, stream) -> None:
    """Launch a kept binary on ``grid3`` (three ints) with the runtime
    ``args``."""
    # Every parameter in order, constexprs included: Triton's launcher
    # takes the bound arguments as they are and skips the constexprs.
    enter, leave = _launch_hooks()
    if enter is None and leave is None:
        if kept.c_launch is not None:
            if kept.c_packed:
                kept.c_launch(grid3[0], grid3[1], grid3[2], stream, *kept.c_head, (*args, *kept.tail))
            else:
                kept.c_launch(grid3[0], grid3[1], grid3[2], stream, *kept.c_head, *args, *kept.tail)
            return
        metadata = None
    else:
        metadata = kept.binary.launch_metadata(grid3, stream, *args, *kept.tail)
    binary = kept.binary
    binary.run(grid3[0], grid3[1], grid3[2], stream, binary.function, binary.packed_metadata, metadata, enter, leave,
               *args, *kept.tail)


# Triton's CUDA launcher (a compiled binary's ``run``, a ``CudaLauncher``) is
# Python around a compiled C launch: at every launch it defines closures and
# calls them to ask for scratch buffers, then calls the C launch with the
# cooperative-grid and PDL flags and the scratch buffers besides the
# binary's arguments. For a binary that needs no scratch, ``run_binary``
# makes that C call itself (``KeptBinary.c_launch``): three Python calls a
# launch fewer and no closures (bench/NOTES.md run 38). Only where the
# wrapper is one this was written against, checked from its source once per
# class; any other launcher is called as it is. Two forms:
# * Triton 3.6's: the C launch takes the binary's arguments after the flags
#   and the scratch buffers, one by one (the prefix and suffix below, one
#   C call, no sanitiser);
# * Triton 3.9's (its whole source, by digest): one generic C launch takes
#   the flags, the packed metadata, the hooks, the scratch buffers, the
#   arguments' annotations and signature, then the arguments as one tuple
#   (``KeptBinary.c_packed``); with its sanitiser on (GSan, which appends
#   arguments) the wrapper is called as it is.
_C_LAUNCH_WRAPPER = (
    "def__call__(self,gridX,gridY,gridZ,stream,function,*args):",
    "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,"
    "global_scratch,profile_scratch,*args)",
)
_C_LAUNCH_WRAPPER_PACKED = "b3d689acc085368a2b47eb1106ae1225f912073e5d1786ab7f309ae6f5318de3"  # sha256, 3.9.0
# Launcher class -> its wrapper's form: "args" (3.6's), "packed" (3.9's) or
# None (unknown) (read once per class).
_C_LAUNCH_CLASSES: dict = {}


def _c_launch_form(cls) -> str | None:
    """The form of launcher class ``cls``'s wrapper (see above), or None."""
    if cls not in _C_LAUNCH_CLASSES:
        try:
            source = "".join(inspect.getsource(cls.__call__).split())
        except (OSError, TypeError, AttributeError):
            source = ""
        form = None
        # The two lines above, the scratch requests, and nothing else that
        # the wrapper could add (a sanitiser's arguments, say).
        if (source.startswith(_C_LAUNCH_WRAPPER[0]) and source.endswith(_C_LAUNCH_WRAPPER[1])
                and source.count("self.launch(") == 1 and "gsan" not in source):
            form = "args"
        elif hashlib.sha256(source.encode()).hexdigest() == _C_LAUNCH_WRAPPER_PACKED:
            form = "packed"
        _C_LAUNCH_CLASSES[cls] = form
    return _C_LAUNCH_CLASSES[cls]


def _c_launch_of(binary) -> tuple:
    """``(C launch, head, packed)`` for a binary whose launcher
    ``run_binary`` may bypass (see ``_c_launch_form``): ``c_launch(gx, gy,
    gz, stream, *head, *args, *tail)``, or with ``packed`` ``c_launch(gx, gy,
    gz, stream, *head, (*args, *tail))``, is then the launcher's own C call
    without launch hooks. ``(None, None, False)`` otherwise."""
    run = getattr(binary, "run", None)
    form = None if run is None or type(run).__name__ != "CudaLauncher" else _c_launch_form(type(run))
    if (form is None or getattr(run, "global_scratch_size", 1) != 0 or getattr(run, "profile_scratch_size", 1) != 0
            or getattr(run, "gsan_enabled", False)):
        return None, None, False
    if form == "packed":
        # function, flags, metadata, no launch metadata or hooks, no scratch, the arguments' description
        head = (binary.function, run.launch_cooperative_grid, run.launch_pdl, binary.packed_metadata, None, None,
                None, None, None, run.arg_annotations, run.kernel_signature)
        return run.launch, head, True
    head = (binary.function, run.launch_cooperative_grid, run.launch_pdl, None, None, binary.packed_metadata,
            None, None, None)  # function, flags, no scratch, metadata, no launch metadata or hooks
    return run.launch, head, False


# Set by ``dry_run``: launchers choose their configs but launch nothing.
_DRY_RUN = contextvars.ContextVar("flashfuse_dry_run", default=False)


@contextlib.contextmanager
def dry_run():
    """Within this context every ``ConfigLauncher`` call only finds the
    config it would launch (compiling candidates on stand-ins, raising
    ``NoKernelConfig`` when none fits) and launches nothing: how the graph
    pass asks, on fake tensors, whether the op can run a traced shape."""
    token = _DRY_RUN.set(True)
    try:
        yield
    finally:
        _DRY_RUN.reset(token)


class NoKernelConfig(RuntimeError):
    """No candidate config of a kernel fits the GPU for a launch that cannot
    run (traced, or a dry run). The graph pass's probe turns it into a
    reason to leave the attention alone; in a compile the backend falls back
    to the traced graph."""


def hint(x):
    """The example value of a symbolic size (a graph traced with dynamic
    shapes), without a guard; plain numbers as they are."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental import symbolic_shapes

        # The guard-free hint is optimization_hint in newer PyTorch, size_hint or
        # hint_int (deprecated in favour of size_hint) before.
        get = (getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "size_hint", None)
               or symbolic_shapes.hint_int)
        return get(x) if isinstance(x, torch.SymInt) else x.node.hint
    return x


def static_int(x) -> int:
    """A size the kernels compile in (a head dim: tile widths are chosen
    from it) as a plain int. A symbolic one is specialised with a guard, so
    that a graph traced with dynamic shapes recompiles for another head dim
    instead of launching a kernel built for this one."""
    return int(x)


def _describe_config(cfg) -> str:
    """A config in an error message: meta-parameters, warps, stages."""
    return f"{cfg.kwargs}, {cfg.num_warps} warps, {cfg.num_stages} stages"


class TuningCache:
    """Tuned kernel configs on disk, so that a new process on the same GPU
    and Triton takes them instead of timing every candidate again.

    One JSON file, ``flashfuse_tuning.json`` in Triton's cache directory, or
    the path in ``FLASHFUSE_TUNING_CACHE`` (``0`` turns the cache off). An
    entry maps (Triton version, GPU name, kernel, key) to a config; an entry
    that matches no current candidate is ignored. A file that cannot be read
    or written only means the configs are timed again.
    """

    def __init__(self):
        self._loaded: dict = {}  # path -> entries read from it

    def path(self) -> str | None:
        env = config.tuning_cache()
        if env == "0":
            return None
        if env:
            return env
        knobs = getattr(triton, "knobs", None)
        base = knobs.cache.dir if knobs is not None else os.path.join(os.path.expanduser("~"), ".triton", "cache")
        return os.path.join(base, "flashfuse_tuning.json")

    @staticmethod
    def _entry(name, key) -> str:
        return f"{triton.__version__}|{_device_name()}|{name}|{key!r}"

    @staticmethod
    def _describe(cfg) -> list:
        """A config as JSON gives it back: lists, not tuples."""
        return [[list(item) for item in sorted(cfg.kwargs.items())], cfg.num_warps, cfg.num_stages]

    def _read(self, path) -> dict:
        try:
            with open(path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def lookup(self, name, key, candidates):
        """The stored config of (name, key) among ``candidates``, or None."""
        path = self.path()
        if path is None:
            return None
        if path not in self._loaded:
            self._loaded[path] = self._read(path)
        want = self._loaded[path].get(self._entry(name, key))
        if want is None:
            return None
        return next((cfg for cfg in candidates if self._describe(cfg) == want), None)

    def store(self, name, key, cfg) -> None:
        path = self.path()
        if path is None:
            return
        entry = self._entry(name, key)
        data = self._read(path)  # merge with what other processes wrote
        data[entry] = self._describe(cfg)
        self._loaded[path] = data
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, path)  # readers never see half a file
        except OSError as exc:
            _log.debug("flashfuse: tuning cache %s not written: %s", path, exc)


TUNING_CACHE = TuningCache()


@functools.lru_cache(maxsize=None)
def _device_name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name() -> str:
    """Name of the current CUDA device ("cpu" without one)."""
    if not torch.cuda.is_available():
        return "cpu"
    return _device_name_of(torch.cuda.current_device())


def _traced(args) -> bool:
    """The call is being traced into a graph: its tensors are stand-ins
    (functional or fake tensors), not plain tensors holding data."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter
    return False


def bool_mask_as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask for the kernels, which read it as bytes (nonzero: takes
    part): viewed as uint8, same strides, no copy. In a traced graph the bool
    tensor itself, which Triton reads as bytes too, because Inductor cannot
    lower a view from bool to another dtype."""
    return mask if _traced((mask,)) else mask.view(torch.uint8)


# Fewest pipeline stages a kernel with tensor-descriptor loads may take:
# Triton 3.6's ptxas crashes (signal 11) on every two-stage descriptor
# pipeline tried for sm_90a, forward and backward.
DESCRIPTOR_MIN_STAGES = 3


def descriptor_loads(*tensors: torch.Tensor, faster: bool = True) -> bool:
    """Whether a kernel may read these (B, H, L, D) tensors through tensor
    descriptors (the copy engine of Hopper and later GPUs, TMA) instead of
    pointer tiles.

    ``FLASHFUSE_TMA=0`` turns them off, ``1`` forces them wherever the
    layout allows (also under the interpreter, for tests); unset, they are
    used on CUDA GPUs of compute capability 9 or more for 16-bit tensors with
    head dims of 65 to 128, where they measured faster (bench/NOTES.md run
    11), unless the caller says they are not (``faster=False``). The layout
    must suit the copy engine: unit last stride, 16-byte aligned base and
    strides. Never while tracing: a traced graph's tensors have no address
    to check, and a misaligned descriptor is not caught.
    """
    mode = config.tma()
    if mode == "0" or not hasattr(triton.language, "make_tensor_descriptor") or _traced(tensors):
        return False
    t0 = tensors[0]
    if _interpreting(t0):
        if mode != "1":
            return False
    else:
        if _capability(t0.device.index)[0] < 9 or t0.dtype not in (torch.float16, torch.bfloat16):
            return False
        head = max(t.shape[3] for t in tensors)
        if head > 128 or (mode != "1" and (head <= 64 or not faster)):
            return False
    return all(copy_engine_layout(t) for t in tensors)


def copy_engine_layout(t: torch.Tensor) -> bool:
    """Whether the copy engine can read the (B, H, L, D) tensor ``t`` row by
    row: unit last stride, 16-byte rows, a 16-byte aligned base and, for each
    dimension of more than one element, a positive stride of whole 16 bytes.
    A fake tensor (a trace) has no address: its base counts as aligned, and
    the opaque op that runs the trace checks the real tensor again."""
    elt = t.element_size()
    shape, strides = t.shape, t.stride()
    if strides[3] != 1 or (shape[3] * elt) % 16 or (not isinstance(t, FakeTensor) and t.data_ptr() % 16):
        return False
    # Written out (no generator): called for every tensor of every eager call.
    for i in (0, 1, 2):
        st = strides[i]
        if shape[i] > 1 and (st <= 0 or (st * elt) % 16):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def multiprocessors(index: int) -> int:
    """The SM count of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _scratch(size: int, alignment: int, stream):
    """Global scratch for kernels that build tensor descriptors on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for device-side scratch (tensor descriptors)
    in this thread, unless the caller already set one. Triton keeps it per
    thread (a context variable), and autograd runs backward in its own
    thread, so this runs before every launch that needs it."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _triton_device_stream(index: int):
    """Device ``index``'s current raw CUDA stream, as Triton's driver reads
    it (for a caller that has just read the current device's index,
    ``torch.cuda.current_device()``, which Triton's driver reads too when
    PyTorch is loaded)."""
    return triton.runtime.driver.active.get_current_stream(index)


# ``_triton_device_stream``: Triton's GPU drivers read the stream with
# torch's ``_cuda_getCurrentRawStream``, called here directly where this
# torch has it (a CPU build has a dummy): two Python calls less a launch.
_device_stream = ((getattr(torch._C, "_cuda_getCurrentRawStream", None) if torch.backends.cuda.is_built() else None)
                  or _triton_device_stream)


def _current_stream():
    """The raw CUDA stream Triton would launch on: the current device's."""
    return _device_stream(triton.runtime.driver.active.get_current_device())


# Triton's runtime settings, where the hooks live (Triton 3.4+; one object
# for the process, whose attributes profilers set).
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hooks():
    """Triton's global launch hooks (profilers set them), each None when
    there is none to call.

    Triton 3.5+ keeps each as a chain of hooks that is never None: passed
    as it is, an empty chain costs every launch three Python calls for
    nothing (the binary's ``launch_metadata``, then the launcher calls
    each chain), per decode call and per kernel of a step. An empty chain
    calls nothing, so it is passed as None: the launcher then skips it, and
    ``run_binary`` the metadata, which only hooks read."""
    if _RUNTIME_KNOBS is None:
        return None, None
    enter, leave = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    # A chain's hooks are its ``calls``; a plain hook (older Tritons) has none.
    if enter is not None and not getattr(enter, "calls", True):
        enter = None
    if leave is not None and not getattr(leave, "calls", True):
        leave = None
    return enter, leave


_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def _fingerprint(args) -> tuple:
    """What Triton specialises a kernel on, for each runtime argument.

    Tensors: dtype and whether the address is 16-byte aligned. Integers:
    equal to 1, multiple of 16, outside int32 (Triton then passes 64 bits).
    Floats and others: their type. Finer than Triton's own key (it also
    honours ``do_not_specialize``), never coarser, so one fingerprint never
    maps to two binaries.
    """
    # One comprehension (integers inline: most arguments are strides and
    # sizes), not a loop of appends: it runs for every direct launch.
    return tuple([(1 if a == 1 else (2 if a & 15 == 0 else 0) + (0 if _INT32_MIN <= a <= _INT32_MAX else 4))
                  if type(a) is int else _other_fingerprint(a) for a in args])


def _other_fingerprint(a):
    """``_fingerprint`` of an argument that is not an int."""
    if type(a) is bool:
        return ("bool", a)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    return type(a)


def config_tuple(cfg) -> tuple:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a tile config: how the
    kernels' candidate lists name configs."""
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. ``triton.cdiv`` does the same but costs
    microseconds per call in recent Tritons (it unwraps constexpr arguments)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), on the host; see ``cdiv``."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def device_shared_mem(device: torch.device) -> int:
    """``max_shared_mem`` of a tensor's device (the current CUDA device when
    the device has no index; index 0 for a device that is not CUDA, as a
    test's stand-in tensors are)."""
    if device.index is not None:
        return max_shared_mem(device.index)
    return max_shared_mem(torch.cuda.current_device() if device.type == "cuda" else 0)


@functools.lru_cache(maxsize=None)
def max_shared_mem(device_index: int) -> int:
    """Shared memory per block on a CUDA device, in bytes, queried once per
    device (the query goes through the driver; launches must not pay it)."""
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # conservative Hopper-class default
        return 227 * 1024


def _interpreting(t: torch.Tensor) -> bool:
    """Launch through Triton's interpreter: CPU tensors cannot run compiled."""
    return config.interpreter_on() or t.device.type != "cuda"


def _bucket(n: int, cap: int) -> int:
    """Sequence-length bucket for an autotuning key: the next power of two,
    capped, so tuning runs once per size class instead of once per length.

    A symbolic length (a graph traced with dynamic shapes) is bucketed by its
    example value, without a guard: the config changes speed, not results,
    so the graph must not be specialised to one length for it.
    """
    return min(next_pow2(hint(n)), cap)


# Longest sequence-length buckets in the launchers' config keys (``_bucket``):
# past the cap one tuning serves every longer length. No measurement behind
# either value is recorded; they are kept as they were so that the launcher
# keys, and with them the entries of the on-disk tuning cache, stay the same.
FORWARD_BUCKET_CAP = 1 << 16
BACKWARD_BUCKET_CAP = 1 << 14


def window_limit(N, M):
    """The bound window sizes are clamped to (``clamp_window``). Any bound
    past N + M excludes no key (or every key), so clamping changes no result
    and keeps the kernels' index sums (``i + diag_off + window``) inside
    int32. The forward's and the tables' results are the same for any limit
    of at least N + M (their bounds saturate at 0 and M); this value is the
    one the backward always used, kept so that its block loops visit exactly
    the blocks they did."""
    return 2 * (N + M) + 1


def clamp_window(w, limit) -> int:
    """A window bound as the kernels take it: clamped to [-limit, limit]
    (see ``window_limit``); 0 for no bound (the kernels' HAS_WINDOW flag
    says it is absent)."""
    if w is None:
        return 0
    return max(-limit, min(int(w), limit))


def kernel_band(N, M, window_left, window_right, bottom_right: bool) -> dict:
    """The visibility band as every attention and table kernel takes it:
    ``diag_off`` (M - N for bottom-right alignment, else 0), the clamped
    window bounds and whether each is present. One rule for the forward, the
    backward and the block-mask tables, which must agree on it exactly."""
    limit = window_limit(N, M)
    return dict(diag_off=(M - N) if bottom_right else 0, window_left=clamp_window(window_left, limit),
                window_right=clamp_window(window_right, limit), has_window_left=window_left is not None,
                has_window_right=window_right is not None)


def _dot_precision(q: torch.Tensor) -> str:
    """tl.dot input precision for q's dtype.

    16-bit inputs use tensor cores whatever this says. For fp32 on CUDA,
    follow PyTorch's matmul setting: "tf32" when TF32 is allowed, else
    "tf32x3" (three TF32 products, fp32-level accuracy on tensor cores;
    plain IEEE dots run on CUDA cores about a hundred times slower).
    """
    if q.dtype != torch.float32 or q.device.type != "cuda":
        return "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"
