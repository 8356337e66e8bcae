"""The eager fast path of ``flashfuse::attention`` (``flashfuse.fastpath``):
a plain eager call whose signature passed the op's checks before skips the
dispatcher and the checks. It must give bitwise the op's results, raise the
op's errors for every bad input, never reuse a signature whose keyed
properties changed, and leave tracing to the op."""

import contextlib
import math

import pytest
import torch

import flashfuse
from flashfuse import config, fastpath
from flashfuse.kernels import decode

OP = torch.ops.flashfuse.attention


@pytest.fixture(autouse=True)
def fresh():
    """No signature and no decode plan from another test: tests patch the
    decode module's constants (MIN_KEYS, MIN_SPLIT_KEYS), and a call kept
    under the same signature would keep the split count they gave."""
    fastpath.forget_signatures()
    decode.forget_plans()
    yield
    fastpath.forget_signatures()
    decode.forget_plans()


def _qkv(Hq=4, Hkv=2, N=1, M=37, D=16, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, D, generator=g).to(dtype) for h, n in ((Hq, N), (Hkv, M), (Hkv, M)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _hits():
    return fastpath.HITS[0]


DECODE = dict(is_causal=True, alignment="bottom_right", enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,kw", [(1, DECODE), (5, dict(enable_gqa=True, window_left=7, scale=0.3)),
                                  (3, dict(enable_gqa=True, softcap=5.0))])
def test_fast_path_is_bitwise_the_op(monkeypatch, dtype, N, kw):
    monkeypatch.setattr(decode, "MIN_KEYS", 1)  # the decode kernels at these sizes
    q, k, v = _qkv(N=N, dtype=dtype)
    want = OP(q, k, v, **kw)
    first = flashfuse.attention(q, k, v, **kw)  # takes the op, remembers the signature
    before = _hits()
    got = flashfuse.attention(q, k, v, **kw)
    assert _hits() == before + 1
    assert torch.equal(first, want) and torch.equal(got, want)
    assert got.stride() == want.stride()


def test_fast_path_gradients_are_bitwise_the_op():
    q, k, v = _qkv(N=5, grad=True)
    g = torch.randn(1, 4, 5, 16)
    want = torch.autograd.grad(OP(q, k, v, is_causal=True, enable_gqa=True), (q, k, v), g)
    flashfuse.attention(q, k, v, is_causal=True, enable_gqa=True)
    before = _hits()
    out = flashfuse.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert _hits() == before + 1
    got = torch.autograd.grad(out, (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_growing_cache_keeps_its_signature():
    # A dynamic cache is one key longer at every token: one signature.
    q, k, v = _qkv(M=40)
    flashfuse.attention(q, k[:, :, :30], v[:, :, :30], **DECODE)
    before = _hits()
    for M in (31, 33, 40):
        got = flashfuse.attention(q, k[:, :, :M], v[:, :, :M], **DECODE)
        assert torch.equal(got, OP(q, k[:, :, :M], v[:, :, :M], **DECODE))
    assert _hits() == before + 3


def _bad_calls():
    """(name, args, kwargs) of bad inputs, each a small change of the good
    decode call ``(q, k, v), DECODE``."""
    q, k, v = _qkv()
    mask = torch.ones(1, 1, 1, 37, dtype=torch.bool)
    return [
        ("value dtype", (q, k, v.double()), DECODE),
        ("value length", (q, k, v[:, :, :36]), DECODE),
        ("key length", (q, k[:, :, :36], v), DECODE),
        ("value 3-D", (q, k, v[0]), DECODE),
        ("key 5-D", (q, k[None], v), DECODE),
        ("head dim", (q[..., :8], k[..., :8], v), DECODE),
        ("no enable_gqa", (q, k, v), dict(DECODE, enable_gqa=False)),
        ("alignment", (q, k, v), dict(DECODE, alignment="center")),
        ("alignment type", (q, k, v), dict(DECODE, alignment=3)),
        ("dropout", (q, k, v), dict(DECODE, dropout_p=1.5)),
        ("dropout nan", (q, k, v), dict(DECODE, dropout_p=math.nan)),
        ("window", (q, k, v), dict(DECODE, window_left=-1)),
        ("window type", (q, k, v), dict(DECODE, window_left=1.5)),
        ("scale", (q, k, v), dict(DECODE, scale=math.inf)),
        ("softcap", (q, k, v), dict(DECODE, softcap=-1.0)),
        ("sinks", (q, k, v), dict(DECODE, sinks=torch.zeros(3))),
        ("mask length", (q, k, v, mask[..., :36]), DECODE),
        ("mask dtype", (q, k, v, mask.int()), DECODE),
        ("mask_fill", (q, k, v, mask), dict(DECODE, mask_fill=math.nan)),
        ("mask_fill float mask", (q, k, v, mask.float()), dict(DECODE, mask_fill=-1.0)),
    ]


def _error(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("i", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_input_on_a_cached_signature_raises_the_op_error(i):
    q, k, v = _qkv()
    mask = torch.ones(1, 1, 1, 37, dtype=torch.bool)
    for good in ((q, k, v), (q, k, v, mask)):  # both good signatures cached, twice
        flashfuse.attention(*good, **DECODE)
        flashfuse.attention(*good, **DECODE)
    _, args, kwargs = _bad_calls()[i]
    before = _hits()
    want = _error(OP, *args, **kwargs)
    assert _error(flashfuse.attention, *args, **kwargs) == want
    assert _error(fastpath.attention_op, *args, **kwargs) == want  # still, the second time
    assert _hits() == before


@pytest.mark.parametrize("change", ["dtype", "requires_grad", "query length", "heads", "scale", "is_causal type",
                                    "window", "mask", "sinks", "parameter"])
def test_changed_signature_takes_the_op_first(change):
    q, k, v = _qkv(N=2)
    kw = dict(enable_gqa=True, is_causal=True)
    args = (q, k, v)
    flashfuse.attention(*args, **kw)
    flashfuse.attention(*args, **kw)
    if change == "dtype":
        args = tuple(t.bfloat16() for t in args)
    elif change == "requires_grad":
        args = (q.detach().requires_grad_(), k, v)
    elif change == "query length":
        args = (q[:, :, :1], k, v)
    elif change == "heads":
        args = (q[:, :2], k, v)
    elif change == "scale":
        kw["scale"] = 0.5
    elif change == "is_causal type":
        kw["is_causal"] = 1
    elif change == "window":
        kw["window_left"] = 3
    elif change == "mask":
        args = (q, k, v, torch.ones(2, 37, dtype=torch.bool))
    elif change == "sinks":
        kw["sinks"] = torch.zeros(4)
    elif change == "parameter":
        args = (torch.nn.Parameter(q.clone()), k, v)
    before = _hits()
    try:
        got = flashfuse.attention(*args, **kw)
    except Exception as exc:  # a change the op refuses is refused here too
        assert _error(OP, *args, **kw) == (type(exc), str(exc))
        return
    assert _hits() == before, "a changed signature must first take the op"
    assert torch.equal(got, OP(*args, **kw))
    flashfuse.attention(*args, **kw)
    assert _hits() == before + 1


def _decode_fn(q, k, v):
    return flashfuse.attention(q, k, v, **DECODE) * 2


def test_make_fx_records_the_op_after_the_signature_is_cached():
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = _qkv()
    _decode_fn(q, k, v)
    _decode_fn(q, k, v)
    before = _hits()
    gm = make_fx(_decode_fn)(q, k, v)
    assert _hits() == before
    # make_fx decomposes the composite: its private forward op is recorded.
    assert any("flashfuse._attention_forward" in str(n.target) for n in gm.graph.nodes), gm.graph
    assert torch.equal(gm(q, k, v), _decode_fn(q, k, v))


def test_compile_records_the_op_after_the_signature_is_cached(fresh_dynamo):
    q, k, v = _qkv()
    _decode_fn(q, k, v)
    _decode_fn(q, k, v)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, inputs)

    got = torch.compile(_decode_fn, backend=backend, fullgraph=True)(q, k, v)
    assert graphs and any("flashfuse.attention" in str(n.target) for n in graphs[0].graph.nodes)
    assert torch.equal(got, _decode_fn(q, k, v))


def test_fake_tensors_and_modes_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    q, k, v = _qkv()
    _decode_fn(q, k, v)
    ref = _decode_fn(q, k, v) / 2
    before = _hits()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        assert flashfuse.attention(fq, fk, fv, **DECODE).shape == q.shape

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        flashfuse.attention(q, k, v, **DECODE)
    assert OP in seen or OP.default in seen
    assert torch.equal(torch.vmap(lambda a: flashfuse.attention(a[None], k, v, **DECODE)[0])(q),
                       ref)
    assert _hits() == before


def test_profiled_calls_take_the_op():
    """Under the profiler the op runs through the dispatcher, so its traces
    name it (a fast-path call would not appear)."""
    q, k, v = _qkv()
    _decode_fn(q, k, v)
    before = _hits()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flashfuse.attention(q, k, v, **DECODE)
    assert _hits() == before
    assert any(e.name == "flashfuse::attention" for e in prof.events())
    flashfuse.attention(q, k, v, **DECODE)
    assert _hits() == before + 1


class _Sub(torch.Tensor):
    pass


def _context(name, q, k, v):
    """Where the fast path must or may run, and the tensors to pass there."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    if name == "plain":
        return contextlib.nullcontext(), (q, k, v)
    if name == "parameter":
        return contextlib.nullcontext(), (torch.nn.Parameter(q, requires_grad=False), k, v)
    if name == "subclass":
        return contextlib.nullcontext(), (q.as_subclass(_Sub), k, v)
    if name == "fake":
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        return mode, tuple(mode.from_tensor(t) for t in (q, k, v))
    if name == "torch function mode":
        class Passing(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        return Passing(), (q, k, v)
    if name == "profiler":
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), (q, k, v)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["plain", "parameter", "subclass", "fake", "torch function mode", "profiler"])
def test_not_compiling_entry_takes_the_fast_path_where_attention_op_does(name):
    """``attention_op_not_compiling`` (the Hugging Face hook's entry for a
    call it knows is not compiled) is ``attention_op`` less its
    ``is_compiling`` read: the same results, and the fast path (a hit)
    exactly where ``attention_op`` takes it."""
    q, k, v = _qkv()
    kw = dict(window_left=None, alignment="bottom_right")
    hits = {}
    for fn in (fastpath.attention_op, fastpath.attention_op_not_compiling):
        fastpath.forget_signatures()
        ctx, (a, b, c) = _context(name, q, k, v)
        with ctx:
            first = fn(a, b, c, None, 0.0, True, None, True, **kw)  # remembers a plain call's signature
            before = _hits()
            got = fn(a, b, c, None, 0.0, True, None, True, **kw)
            hits[fn] = _hits() - before
        if name != "fake":
            want = OP(q, k, v, None, 0.0, True, None, True, alignment="bottom_right")
            assert torch.equal(first, want) and torch.equal(got, want)
    assert hits[fastpath.attention_op] == hits[fastpath.attention_op_not_compiling]
    assert hits[fastpath.attention_op] == (1 if name in ("plain", "parameter") else 0)


@pytest.mark.parametrize("N,mask", [(1, False), (1, True), (5, False), (40, False)])
def test_not_compiling_entry_transposes_its_output_as_the_hook_did(monkeypatch, N, mask):
    """``transpose_out=True`` gives ``out.transpose(1, 2).contiguous()``
    bitwise, on the decode lane (which makes the output in that order) and
    off it, first call and later ones."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)  # the decode kernels at these sizes
    q, k, v = _qkv(N=N, M=41)
    m = (torch.rand(1, 1, N, 41, generator=torch.Generator().manual_seed(1)) > 0.3) if mask else None
    kw = dict(window_left=None, alignment="bottom_right")
    want = OP(q, k, v, m, 0.0, m is None, None, True, alignment="bottom_right").transpose(1, 2).contiguous()
    lanes = fastpath.LANE_HITS[0]
    for _ in range(3):
        got = fastpath.attention_op_not_compiling(q, k, v, m, 0.0, m is None, None, True, transpose_out=True, **kw)
        assert got.shape == (1, N, 4, 16) and got.is_contiguous() and torch.equal(got, want)
    assert fastpath.LANE_HITS[0] == lanes + (0 if N == 40 else 2)  # 40 queries: not a decode call


def test_config_reads_follow_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "3")
    assert config.decode_splits() == 3
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "5")
    assert config.decode_splits() == 5
    monkeypatch.delenv("FLASHFUSE_DECODE_SPLITS")
    assert config.decode_splits() is None
    monkeypatch.setenv("FLASHFUSE_DECODE", "0")
    assert config.decode() == "0"


@pytest.mark.parametrize("variable,values", [("FLASHFUSE_DECODE", ["0", "1", None]),
                                             ("FLASHFUSE_DECODE_SPLITS", ["3", "7", None]),
                                             ("FLASHFUSE_AUTOTUNE", ["0", "1", None]),
                                             ("TRITON_INTERPRET", ["0", "1", None])])
def test_decode_settings_read_what_the_single_reads_read(monkeypatch, variable, values):
    """``config.decode_settings`` keeps its readings per raw values: each
    change of any of its four variables shows at the next call."""
    for value in values:
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
        assert config.decode_settings() == (config.decode(), config.decode_knobs()), (variable, value)


def _lane_hits():
    return fastpath.LANE_HITS[0]


def test_decode_lane_is_bitwise_the_op_as_the_cache_grows_past_the_kernels_threshold(monkeypatch):
    # The lane asks the key count per call: below MIN_KEYS the op's route
    # takes the forward kernel, and so does the lane's fallback.
    monkeypatch.setattr(decode, "MIN_KEYS", 34)
    q, k, v = _qkv(M=40)
    mask = torch.rand(1, 1, 1, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    for m in (None, mask):
        fastpath.forget_signatures()
        extra = () if m is None else (m[..., :30],)
        flashfuse.attention(q, k[:, :, :30], v[:, :, :30], *extra, **DECODE)
        for M, lane in ((31, False), (34, True), (40, True), (33, False)):
            before = _lane_hits()
            extra = () if m is None else (m[..., :M],)
            got = flashfuse.attention(q, k[:, :, :M], v[:, :, :M], *extra, **DECODE)
            assert torch.equal(got, OP(q, k[:, :, :M], v[:, :, :M], *extra, **DECODE))
            assert _lane_hits() == before + lane, (M, m is not None)


def test_decode_lane_on_a_growing_cache_takes_its_plan_directly(monkeypatch):
    """A dynamic cache through the lane: each length a fresh contiguous
    (B, Hkv, M, D) tensor (new strides every call). A length whose strides
    specialise as a recorded one's takes that plan's call without
    ``_cached_call`` (head dim 24: M * 24 is a multiple of 16 for even M
    only, so each parity builds once), and each is bitwise the op's."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    decode.forget_plans()
    built = []
    real = decode._cached_call
    monkeypatch.setattr(decode, "_cached_call", lambda *a: built.append(a[1].shape[2]) or real(*a))
    Hkv, D = 2, 24
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1, D, generator=g)
    buf = torch.randn(Hkv * 64 * D, generator=g)
    lengths = (30, 31, 32, 33, 34, 40, 41, 48)

    def cache(M, source):
        return torch.as_strided(source, (1, Hkv, M, D), (Hkv * M * D, M * D, D, 1))

    got = {}
    for M in lengths:
        before = _lane_hits()
        got[M] = flashfuse.attention(q, cache(M, buf), cache(M, buf.flip(0)), **DECODE)
        assert _lane_hits() == before + (M != 30), M  # the first call makes the lane
    # 30 passes the op (no lane yet); the lane builds 31 (odd) and 32 (even), then reuses.
    assert [m for m in built if m != 30] == [31, 32], built
    monkeypatch.setattr(decode, "_cached_call", real)
    decode.forget_plans()
    for M in lengths:
        assert torch.equal(got[M], OP(q, cache(M, buf), cache(M, buf.flip(0)), **DECODE)), M


def test_decode_lane_step_serves_growing_and_repeated_lengths_without_lookups(monkeypatch):
    """Once a lane has made a call without a mask, its next calls with the
    same fixed arguments and strides of the same specialisation take its
    step (``decode._LaneStep``): no exact-key and no grown-plan lookup,
    whether the length grows (a dynamic cache, across split counts and
    buckets) or repeats; each bitwise the op's, and each the call
    ``decode_forward``'s own key keeps (split count, launches, integers)."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    monkeypatch.setattr(decode, "MIN_SPLIT_KEYS", 16)  # one split up to 16 keys, then two
    decode.forget_plans()

    class Lookups(dict):
        gets = 0

        def get(self, *args):
            Lookups.gets += 1
            return super().get(*args)

    monkeypatch.setattr(decode, "_CALLS", Lookups())
    monkeypatch.setattr(decode, "_LANE_GROWN", Lookups())
    Hkv, D = 2, 16
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 1, D, generator=g)
    buf = torch.randn(Hkv * 64 * D, generator=g)

    def cache(M, source):
        return torch.as_strided(source, (1, Hkv, M, D), (Hkv * M * D, M * D, D, 1))

    launches = set()

    def call(M):
        k, v = cache(M, buf), cache(M, buf.flip(0))
        got = flashfuse.attention(q, k, v, **DECODE)
        assert torch.equal(got, OP(q, k, v, **DECODE)), M
        if not decode._LANE_STEPS:  # the first call: the op's, which makes the lane
            return
        (step,) = decode._LANE_STEPS.values()
        own = decode._cached_call(q, k, v, None, None, None, None, 0, True, "bhsd", None, config.decode_knobs())
        last = step.last_call()
        assert (last.plan, last.L, last.ints, last.windows, last.fuse) == (
            own.plan, own.L, own.ints, own.windows, own.fuse), M
        launches.add((last.L.S, id(last.L)))

    for M in (5, 6):  # the lane made, its step
        call(M)
    for M in [*range(7, 41), 40, 40, 40]:  # growing, then repeated
        before, hits = Lookups.gets, _lane_hits()
        call(M)
        assert _lane_hits() == hits + 1, M
        # Only the op's call and the check's own _cached_call look up exact keys.
        assert Lookups.gets - before == 2, M
    # Both split counts (the interpreter's plans have one bucket each).
    assert {S for S, _ in launches} == {1, 2}, launches


@pytest.mark.parametrize("setting", ["FLASHFUSE_DECODE=0", "TRITON_INTERPRET=0"])
def test_decode_lane_follows_settings_changed_between_calls(monkeypatch, setting):
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    q, k, v = _qkv()
    flashfuse.attention(q, k, v, **DECODE)
    before = _lane_hits()
    flashfuse.attention(q, k, v, **DECODE)
    assert _lane_hits() == before + 1
    name, value = setting.split("=")
    monkeypatch.setenv(name, value)  # the decode kernels off / the blockwise CPU path
    got = flashfuse.attention(q, k, v, **DECODE)
    assert _lane_hits() == before + 1
    assert torch.equal(got, OP(q, k, v, **DECODE))


@pytest.mark.parametrize("case", ["gradients", "dropout", "softcap", "top-left window", "float mask", "mask_fill"])
def test_calls_the_decode_kernels_cannot_serve_never_take_the_lane(monkeypatch, case):
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    q, k, v = _qkv(grad=case == "gradients")
    kw = dict(DECODE)
    args = (q, k, v)
    if case == "dropout":
        kw["dropout_p"] = 0.25
    elif case == "softcap":
        kw["softcap"] = 5.0
    elif case == "top-left window":
        kw.update(alignment="top_left", window_left=3)
    elif case == "float mask":
        args = (q, k, v, torch.zeros(1, 1, 1, 37))
    elif case == "mask_fill":
        args = (q, k, v, torch.ones(1, 1, 1, 37, dtype=torch.bool))
        kw["mask_fill"] = -5.0
    before, hits = _lane_hits(), _hits()
    for _ in range(3):
        flashfuse.attention(*args, **kw)
    assert _hits() == hits + 2 and _lane_hits() == before


def _lane_call(q, k, v):
    """The call ``decode.lane_forward`` keeps for these tensors (the key
    it builds, under the one lane of the test's signature)."""
    (lane,) = [lane for lane in fastpath._LANES.values() if lane is not None]
    key = (lane.token, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.data_ptr() & 15, k.data_ptr() & 15,
           v.data_ptr() & 15, None, config.decode_knobs(), "ieee")
    return decode._CALLS[key]


def test_decode_lane_keeps_no_stale_call(monkeypatch):
    """The lane keeps its calls per what its signature leaves free: a change
    of strides, alignment, key length or split setting between two calls of
    one signature gets the call ``decode_forward``'s own key keeps for it
    (split count included), and the op's bits; a repeat takes the kept call."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    q, k, v = _qkv(M=40, seed=3)
    flashfuse.attention(q, k, v, **DECODE)  # the signature passes the op
    big = torch.randn(1, 2, 45, 17, generator=torch.Generator().manual_seed(4))
    variants = [
        ("splits 2", q, k, v),
        ("splits 5", q, k, v),
        ("strides", q.transpose(1, 2).contiguous().transpose(1, 2), big[:, :, :40, :16], big[:, :, 5:, 1:]),
        ("misaligned", q, torch.randn(1 + k.numel())[1:].view_as(k).copy_(k), v),
        ("longer", q, big[:, :, :44, :16], big[:, :, 1:, :16]),
    ]
    for name, qq, kk, vv in variants:
        monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "5" if name == "splits 5" else "2")
        for _ in range(2):
            before = _lane_hits()
            got = flashfuse.attention(qq, kk, vv, **DECODE)
            assert _lane_hits() == before + 1, name
            assert torch.equal(got, OP(qq, kk, vv, **DECODE)), name
            call = _lane_call(qq, kk, vv)
            knobs = config.decode_knobs()
            own = decode._cached_call(qq, kk, vv, None, None, None, None, 0, True, "bhsd", None, knobs)
            assert call is own, name
            assert call.L.S == (5 if name == "splits 5" else 2), name


def test_decode_lane_calls_go_with_the_plans():
    """Dropping the plans (``forget_plans``, as a launcher's ``forget`` does)
    drops the lane's kept calls too: they live in ``decode._CALLS``."""
    decode.forget_plans()
    q, k, v = _qkv(M=600)  # past MIN_KEYS
    for _ in range(2):
        flashfuse.attention(q, k, v, **DECODE)
    call = _lane_call(q, k, v)
    decode.forget_plans()
    flashfuse.attention(q, k, v, **DECODE)
    assert _lane_call(q, k, v) is not call


@pytest.mark.gpu
def test_gpu_decode_lane_step_on_a_growing_cache_is_bitwise_the_op():
    """The lane's step on the GPU, where its plans have buckets of keys per
    split: a cache grown from 700 to 40k keys in uneven strides (several
    split counts and buckets), each call bitwise the op's through the
    dispatcher, each the call ``decode_forward``'s own key keeps, and close
    to the float64 reference."""
    from flashfuse import reference as ref

    decode.forget_plans()
    gen = torch.Generator(device="cuda").manual_seed(11)
    Hq, Hkv, D, top = 32, 8, 128, 40000
    q = torch.randn(1, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    buf = torch.randn(2, Hkv * top * D, device="cuda", dtype=torch.bfloat16, generator=gen)

    def cache(M, i):  # a fresh contiguous (B, Hkv, M, D) cache of M keys, as torch.cat leaves it
        return buf[i, :Hkv * M * D].view(1, Hkv, M, D)

    lengths = [700, 701, *range(702, 3000, 97), *range(3000, top, 1531)]
    flashfuse.attention(q, cache(699, 0), cache(699, 1), **DECODE)  # the op; the lane is made
    seen = set()
    direct, repeats, last_L, c_launches = 0, 0, None, False
    for M in lengths:
        k, v = cache(M, 0), cache(M, 1)
        before = _lane_hits()
        got = flashfuse.attention(q, k, v, **DECODE)
        assert _lane_hits() == before + 1, M
        assert torch.equal(got, OP(q, k, v, **DECODE)), M
        (step,) = decode._LANE_STEPS.values()
        direct += step.call is None  # launched directly (``_launch_direct``): no call made
        own = decode._cached_call(q, k, v, None, None, None, None, 0, True, "bhsd", None, config.decode_knobs())
        last = step.last_call()
        assert (last.plan, last.L, last.ints, last.windows, last.fuse) == (
            own.plan, own.L, own.ints, own.windows, own.fuse), M
        c_launches = c_launches or own.L.c_launch
        # (one launch: the split kernel merging its partials, or unsplit)
        repeats += own.L is last_L and (own.fuse or own.L.direct)
        last_L = own.L
        seen.add((own.L.S, id(own.L)))
        if M in (lengths[0], lengths[len(lengths) // 2], lengths[-1]):
            want = ref.reference_attention(q.double(), k.double(), v.double(), window_right=0, bottom_right=True)
            torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    assert len({S for S, _ in seen}) >= 3 and len(seen) >= 6, seen
    # With C launches (Triton 3.6's launcher) a call launches directly when
    # the one before had the same launches (split count and bucket) and it
    # is one launch (past decode.FUSED_MAX_BYTES of keys a combine kernel
    # follows the split kernel: _run launches both).
    assert direct == (repeats if c_launches else 0) and repeats >= 10, (direct, repeats, len(lengths))


_STEP_ON_THE_CUDA_PATH = r'''
import os, sys
os.environ.update(FLASHFUSE_AUTOTUNE="0", TRITON_INTERPRET="0", FLASHFUSE_DECODE="1")
sys.path.insert(0, sys.argv[1])
import torch
import host_path_cpu
import flashfuse
from flashfuse import config
from flashfuse.kernels import decode

host_path_cpu.force_cuda_path_on_cpu()  # CUDA's plans (buckets) on CPU tensors, launches stubbed
kw = dict(is_causal=True, alignment="bottom_right", enable_gqa=True)
Hq, Hkv, D, top = 32, 8, 128, 70000
q = torch.randn(1, Hq, 1, D, dtype=torch.bfloat16)
buf = torch.empty(2, Hkv * top * D, dtype=torch.bfloat16)
seen = set()
lengths = [600, 601, 602, *range(603, 5000, 37), *range(5000, top, 2111)]
direct = 0
for M in lengths:
    k, v = (buf[i, :Hkv * M * D].view(1, Hkv, M, D) for i in (0, 1))
    flashfuse.attention(q, k, v, **kw)
    if M == 600:  # the op's call, which makes the lane
        continue
    (step,) = decode._LANE_STEPS.values()
    direct += step.call is None  # launched directly (the stub has a C launch): no call made
    own = decode._cached_call(q, k, v, None, None, None, None, 0, True, "bhsd", None, config.decode_knobs())
    last = step.last_call()
    got = (last.plan, last.L, last.ints, last.windows, last.fuse)
    assert got == (own.plan, own.L, own.ints, own.windows, own.fuse), M
    seen.add((own.L.S, id(own.L)))
assert direct >= len(lengths) // 2, (direct, len(lengths))
print(len({S for S, _ in seen}), len(seen))
'''


def test_decode_lane_step_on_the_cuda_path_builds_the_calls_decode_forward_keeps():
    """The step's split counts and buckets (which the interpreter's plans do
    not have) on CUDA's launch path, run on CPU tensors with the launches
    stubbed (``bench/host_path_cpu.py``, in a subprocess: it patches
    torch.cuda): a cache grown from 600 to 70k keys, each call the one
    ``decode_forward``'s own key keeps, most of them launched directly
    (the stub's launcher has the C launch form ``launch.run_binary``
    bypasses)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _STEP_ON_THE_CUDA_PATH, os.path.join(root, "bench")], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    splits, launches = map(int, done.stdout.split()[-2:])
    assert splits >= 10 and launches > splits, done.stdout


def _site_call(q, k, v):
    """The Hugging Face hook's call of a decode step without a mask."""
    return fastpath.attention_op_not_compiling(q, k, v, None, 0.0, True, None, True, window_left=None,
                                               alignment="bottom_right", transpose_out=True)


def _made_site(q, k, v):
    """A lane site made as the hook makes one: after a call took the lane."""
    _site_call(q, k, v)  # the op, which makes the lane
    lanes = _lane_hits()
    _site_call(q, k, v)  # the lane, which makes its step
    assert _lane_hits() == lanes + 1
    site = fastpath.lane_site(q, k, v, 0.0, True, None, True, None, "bottom_right", True)
    assert site is not None
    return site


def _want(q, k, v):
    return OP(q, k, v, None, 0.0, True, None, True, alignment="bottom_right").transpose(1, 2).contiguous()


def test_lane_site_calls_are_bitwise_the_op_on_a_growing_cache(monkeypatch):
    """A site's calls on a cache that grows (and repeats a length) take the
    lane, each bitwise the op's output in the hook's (B, N, H, Dv) form."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    monkeypatch.setattr(decode, "MIN_SPLIT_KEYS", 16)  # one split up to 16 keys, then two, three
    Hkv, D = 2, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1, D, generator=g)
    buf = torch.randn(2, Hkv * 64 * D, generator=g)

    def cache(M):  # fresh contiguous (1, Hkv, M, D) tensors, as torch.cat leaves them
        return (buf[i, :Hkv * M * D].view(1, Hkv, M, D) for i in (0, 1))

    site = _made_site(q, *cache(5))
    for M in [*range(6, 50), 49, 49]:
        k, v = cache(M)
        lanes = _lane_hits()
        got = fastpath.lane_call_at(site, q, k, v)
        assert got is not None and _lane_hits() == lanes + 1, M
        assert got.shape == (1, 1, 4, D) and got.is_contiguous() and torch.equal(got, _want(q, k, v)), M


def _tensors_unlike_the_sites(case, q, k, v):
    """Tensors that a site made for (q, k, v) must not take: (q, k, v) of
    another signature, or of the same one with other strides."""
    if case == "batch":
        return q.expand(2, -1, -1, -1).contiguous(), k.expand(2, -1, -1, -1).contiguous(), v.expand(2, -1, -1, -1)
    if case == "head dim":
        return q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous()
    if case == "value dim":
        return q, k, torch.cat([v, v], -1)
    if case == "value length":
        return q, k, v[:, :, :-1]
    if case == "dtype":
        return q.double(), k.double(), v.double()
    if case == "gradients":
        return q.clone().requires_grad_(), k, v
    if case == "parameter":
        return torch.nn.Parameter(q, requires_grad=False), k, v
    if case == "subclass":
        return q.as_subclass(_Sub), k, v
    if case == "q strides":  # every other head of a wider tensor
        return torch.stack([q, q], 2).flatten(1, 2)[:, ::2], k, v
    if case == "misaligned":
        return q, torch.randn(1 + k.numel())[1:].view_as(k).copy_(k), v
    if case == "rank":
        return q, k[None], v[None]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["batch", "head dim", "value dim", "value length", "dtype", "gradients",
                                  "parameter", "subclass", "q strides", "misaligned", "rank"])
def test_lane_site_steps_back_for_tensors_unlike_its_own(monkeypatch, case):
    """A call whose tensors differ from the site's in anything its signature
    or the lane's step holds runs nothing there (None): the hook then calls
    ``attention_op_not_compiling``, which gives what it always gave."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    q, k, v = _qkv(M=40)
    site = _made_site(q, k, v)
    a, b, c = _tensors_unlike_the_sites(case, q, k, v)
    lanes, hits = _lane_hits(), _hits()
    assert fastpath.lane_call_at(site, a, b, c) is None, case
    assert (_lane_hits(), _hits()) == (lanes, hits), case
    assert torch.equal(fastpath.lane_call_at(site, q, k, v), _want(q, k, v)), "the site's own tensors still take it"


@pytest.mark.parametrize("case", ["forgotten signatures", "lane off", "plans dropped", "FLASHFUSE_DECODE=0",
                                  "fewer keys than MIN_KEYS", "torch function mode", "profiler", "fake",
                                  "dry run"])
def test_lane_site_steps_back_where_the_lane_would_not_serve(monkeypatch, case):
    """Where ``_plain_call`` would not take the lane (signatures forgotten,
    the decode kernels off or refused for the key count, a torch-function
    mode, the profiler, fake tensors, a dry run) or the lane has no step
    (plans dropped), a site runs nothing and leaves the call to
    ``attention_op_not_compiling``."""
    from flashfuse.kernels import launch

    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    q, k, v = _qkv(M=40)
    site = _made_site(q, k, v)
    ctx = contextlib.nullcontext()
    args = (q, k, v)
    if case == "forgotten signatures":
        fastpath.forget_signatures()
    elif case == "lane off":
        ctx = fastpath.decode_lane_off()
    elif case == "plans dropped":
        decode.forget_plans()
    elif case == "FLASHFUSE_DECODE=0":
        monkeypatch.setenv("FLASHFUSE_DECODE", "0")
    elif case == "fewer keys than MIN_KEYS":
        monkeypatch.delenv("FLASHFUSE_DECODE", raising=False)
        monkeypatch.setattr(decode, "MIN_KEYS", 41)
    elif case == "dry run":
        ctx = launch.dry_run()
    else:
        ctx, args = _context(case, q, k, v)
    lanes = _lane_hits()
    with ctx:
        assert fastpath.lane_call_at(site, *args) is None, case
    assert _lane_hits() == lanes, case
    if case not in ("lane off", "dry run"):
        with _context(case, q, k, v)[0] if case in ("torch function mode", "profiler") else contextlib.nullcontext():
            assert torch.equal(_site_call(q, k, v), _want(q, k, v)), case
