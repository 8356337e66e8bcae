"""Tests of the Triton backward kernels (``flashfuse.kernels.backward``).

Gradients of q, k, v (and of a learned float mask) are compared against
float64 autograd through ``flashfuse.reference.reference_attention``. The
forward's ``out`` and ``lse`` come from the float64 reference too, so these
tests do not depend on the forward kernel (one test chains both).

Without a GPU the kernels run through Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1), so CPU shapes stay small.

Tests taking the ``bwd_mode`` fixture run under both backward schedules
(``FLASHFUSE_BWD``): two passes, and one pass with atomic dQ.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashfuse import reference as ref
from flashfuse.kernels import backward, problem
from flashfuse.kernels.backward import attention_backward
from flashfuse.kernels.launch import config_tuple

from tests.kernels.masks import hiding_mask
from tests.kernels.padding import in_nan_padding, poison_empty

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative-norm error bounds per input dtype: 16-bit inputs are rounded,
# and the kernels feed P and dS to the dots in the input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Fill every floating tensor the launcher allocates with NaN, so an
    element a kernel forgets to write shows up as NaN in the comparison."""
    poison_empty(monkeypatch)


@pytest.fixture(params=["two_pass", "one_pass"])
def bwd_mode(request, monkeypatch):
    """Run the test under each backward schedule."""
    monkeypatch.setenv("FLASHFUSE_BWD", request.param)
    return request.param


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the block, then the
    previous setting back."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


class _LaunchSpy:
    """Stands in for a kernel of ``backward._KERNELS`` (indexed by a grid) or
    a launcher of ``_LAUNCHERS`` (called), recording its kind when launched."""

    def __init__(self, kernel, kind, log):
        self.kernel, self.kind, self.log = kernel, kind, log

    def __getitem__(self, grid):
        self.log.append(self.kind)
        return self.kernel[grid]

    def __call__(self, *args, **kwargs):
        self.log.append(self.kind)
        return self.kernel(*args, **kwargs)


@pytest.fixture
def launched(monkeypatch):
    """The list of kernel kinds ("dkdv", "dkdv_dq", "dq") launched so far."""
    log = []
    for table in (backward._KERNELS, backward._LAUNCHERS):
        for kind, kernel in list(table.items()):
            monkeypatch.setitem(table, kind, _LaunchSpy(kernel, kind, log))
    return log


def _rand(shape, dtype, noncontig, gen):
    """randn tensor of ``shape``; with ``noncontig`` a strided view of a
    larger buffer (permuted, with a gap in the last dim)."""
    if not noncontig:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)
    B, H, L, D = shape
    big = torch.randn((L, B, 2 * D + 3, H), generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)
    t = big[:, :, 1 : 2 * D + 1 : 2, :].permute(1, 3, 0, 2)
    assert t.shape == shape and not t.is_contiguous()
    return t


def _check(name, got, want, dtype, floor=5e-2):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got = got.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    # The floor (an rms per element) stands in for the norm when the true
    # gradient is zero or nearly so (e.g. dq with a single key).
    scale = max(want.norm().item(), floor * want.numel() ** 0.5)
    err = (got - want).norm().item()
    assert err / scale <= TOL[dtype], f"{name}: relative error {err / scale:.3e} > {TOL[dtype]:.1e}"


def run_case(
    B=1, Hq=2, Hkv=None, N=17, M=33, D=40, Dv=None, dtype=torch.float32, *,
    mask_shape=None, mask_kind=None, mask_grad=False, window_left=None, window_right=None,
    bottom_right=False, dropout_p=0.0, noncontig=False, seed=0, scale=None, empty_rows=(),
    go_broadcast=False, deterministic=False, mask_tensor=None, zero_go_rows=(), kv_in_nan_padding=False,
):
    """Compare ``attention_backward`` with float64 autograd on fresh inputs.

    mask_kind: None, "bool" or "float"; mask_shape its (broadcastable) shape.
    go_broadcast: grad_out constant over queries (stride 0).
    empty_rows: query rows whose keys are all masked out (bool mask) or set to
    -inf (float mask), to test rows with no visible key.
    deterministic: run the kernels (only them: the float64 reference may use
    ops with no deterministic CUDA version) under
    torch.use_deterministic_algorithms(True).
    mask_tensor: a given mask (on the CPU) instead of a random one.
    zero_go_rows: query rows whose output gradient is 0.
    kv_in_nan_padding: k and v are views into buffers whose rows past M and
    columns past the head dims hold NaN, so a read past their edges shows.
    Returns the four kernel outputs.
    """
    Hkv = Hq if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    gen = torch.Generator().manual_seed(seed)
    q = _rand((B, Hq, N, D), dtype, noncontig, gen)
    k = _rand((B, Hkv, M, D), dtype, noncontig, gen)
    v = _rand((B, Hkv, M, Dv), dtype, noncontig, gen)
    go = _rand((B, Hq, N, Dv), dtype, noncontig, gen)
    if kv_in_nan_padding:
        k, v = in_nan_padding(k), in_nan_padding(v)
    if go_broadcast:  # e.g. the gradient of out.sum(dim=2): stride 0 over queries
        go = go[:, :, :1].expand(B, Hq, N, Dv)
    if zero_go_rows:
        go[:, :, list(zero_go_rows)] = 0
    scale = D ** -0.5 if scale is None else scale

    mask = None
    if mask_tensor is not None:
        mask_kind = "bool" if mask_tensor.dtype == torch.bool else "float"
        mask = mask_tensor.to(DEVICE)
    elif mask_kind == "bool":
        mask = torch.rand(mask_shape, generator=gen) > 0.25
        if mask.dim() >= 2 and mask.shape[-2] == N:
            for i in empty_rows:
                mask[..., i, :] = False
        mask = mask.to(DEVICE)
    elif mask_kind == "float":
        mask = torch.randn(mask_shape, generator=gen)
        if mask.dim() >= 2 and mask.shape[-2] == N:
            for i in empty_rows:
                mask[..., i, :] = float("-inf")
        mask = mask.to(dtype).to(DEVICE)

    seed_t = torch.tensor(1234567 + seed, dtype=torch.int64, device=DEVICE)
    keep = None
    if dropout_p > 0:
        keep = ref.dropout_keep_mask(int(seed_t), B, Hq, N, M, dropout_p, device=DEVICE)

    # float64 reference on the same device (fast on a GPU for the big shapes)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    m64 = None
    if mask is not None:
        m64 = mask
        if mask_kind == "float":
            m64 = m64.double().requires_grad_(mask_grad)
    band = dict(window_left=window_left, window_right=window_right, bottom_right=bottom_right)
    o64 = ref.reference_attention(q64, k64, v64, m64, scale=scale, dropout_mask=keep,
                                  dropout_p=dropout_p, **band)
    o64.backward(go.double())
    with torch.no_grad():
        lse = ref.reference_stored_lse(q64, k64, m64, scale=scale, **band).to(DEVICE)
    # out in the layout the forward returns
    out = torch.empty(B, N, Hq, Dv, dtype=dtype, device=DEVICE).transpose(1, 2)
    out.copy_(o64.detach())

    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        dq, dk, dv, dmask = attention_backward(
            go, q, k, v, mask, seed_t if dropout_p > 0 else None, out, lse,
            dropout_p=dropout_p, scale=scale, mask_grad=mask_grad, **band,
        )
    for name, t, src in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert t.dtype == src.dtype and t.stride() == torch.empty_like(src).stride(), name
    # When no row sees more than one key every softmax is constant: dq, dk
    # and dmask are exactly 0 and only rounding noise (sums of dS) is left.
    vis = ref.visibility_mask(N, M, **band)
    single_key = M == 1 or (vis is not None and int(vis.sum(-1).max()) <= 1)
    qk_floor = 5.0 if single_key else 5e-2
    _check("dq", dq, q64.grad, dtype, floor=qk_floor)
    _check("dk", dk, k64.grad, dtype, floor=qk_floor)
    _check("dv", dv, v64.grad, dtype)
    if mask_grad:
        assert dmask is not None and dmask.dtype == mask.dtype
        # A mask constant along keys shifts whole softmax rows: its true
        # gradient is 0 and only rounding noise (sums of many dS) remains.
        row_constant = mask.shape[-1] == 1 or single_key
        _check("dmask", dmask, m64.grad, dtype, floor=1.0 if row_constant else 5e-2)
    else:
        assert dmask is None
    return dq, dk, dv, dmask


# ---------------------------------------------------------------------------
# CPU (interpreter) tests: small shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "N, M, D, Dv",
    [(1, 1, 16, 16), (17, 33, 40, 24), (47, 17, 64, 64), (33, 47, 16, 40)],
)
@pytest.mark.usefixtures("bwd_mode")
def test_shapes_dtypes(N, M, D, Dv, dtype):
    run_case(N=N, M=M, D=D, Dv=Dv, dtype=dtype)


@pytest.mark.parametrize(
    "N, M, window_left, window_right, bottom_right",
    [
        (33, 47, None, 0, False),   # causal, top-left
        (47, 17, None, 0, True),    # causal, bottom-right; first rows see no key
        (33, 47, None, 0, True),    # causal, bottom-right, N < M
        (47, 33, 5, 3, False),      # sliding window
        (33, 47, 4, 0, True),       # causal sliding window, bottom-right
        (47, 17, 7, None, False),   # left bound only
        (33, 47, None, -3, False),  # strictly before the diagonal
    ],
)
@pytest.mark.usefixtures("bwd_mode")
def test_causal_and_windows(N, M, window_left, window_right, bottom_right):
    run_case(Hq=1, N=N, M=M, D=16, Dv=24, dtype=torch.float16, window_left=window_left,
             window_right=window_right, bottom_right=bottom_right)


@pytest.mark.parametrize(
    "shape, kind, dtype",
    [
        ((2, 1, 1, 33), "bool", torch.float32),
        ((17, 33), "bool", torch.bfloat16),
        ((2, 1, 17, 33), "bool", torch.float16),
        ((2, 1, 1, 33), "float", torch.bfloat16),
        ((17, 33), "float", torch.float32),
        ((2, 1, 17, 33), "float", torch.float16),
        ((1, 17, 1), "float", torch.float32),
    ],
    ids=str,
)
@pytest.mark.usefixtures("bwd_mode")
def test_masks(shape, kind, dtype):
    run_case(B=2, Hq=1, N=17, M=33, D=16, dtype=dtype, mask_shape=shape, mask_kind=kind)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("N, M, band", [(45, 128, {}), (19, 256, dict(window_left=40, window_right=3))], ids=str)
@pytest.mark.usefixtures("bwd_mode")
def test_masks_with_whole_key_blocks(N, M, band, kind):
    # Key counts that are a multiple of every BLOCK_N: the kernels then read
    # the mask without per-key bounds (FULL_KEY_BLOCKS), and the gradients
    # must still be exact at the band's edges and in a partial query tile
    # (odd N). Whether the rule may say yes: test_problem.py.
    run_case(B=2, Hq=2, N=N, M=M, D=16, dtype=torch.float32, mask_shape=(2, 1, N, M), mask_kind=kind,
             kv_in_nan_padding=True, **band)


def _hiding_mask(hidden, kind, values="bias"):
    return hiding_mask(hidden, kind, torch.Generator().manual_seed(1), values)


def _structured_hidden(pattern, N, M):
    """Where a mask hides keys, in whole blocks that the kernels skip."""
    i = torch.arange(N)[:, None]
    j = torch.arange(M)[None, :]
    if pattern == "causal":
        return j > i
    if pattern == "band":  # hidden on both sides of a band of 20 keys
        return (j < i - 10) | (j > i + 10)
    if pattern == "causal+hidden-rows":  # two rows see only hidden values
        h = j > i
        h[[3, 37]] = True
        return h
    raise ValueError(pattern)


@pytest.mark.parametrize(
    "pattern, kind, values",
    [
        ("causal", "bool", "bias"),
        ("causal", "float32-min", "bias"),
        ("causal", "bfloat16-min", "bias"),
        ("band", "float16-min", "bias"),
        ("band", "float32-inf", "bias"),
        ("causal+hidden-rows", "float32-min", "bias"),
        ("causal+hidden-rows", "float32-inf", "bias"),
        # Visible values mostly zero: the blocks where they all are run
        # without reading the mask.
        ("causal", "bfloat16-min", "zeros"),
        ("band", "float32-inf", "zeros"),
        ("causal+hidden-rows", "float32-min", "zeros"),
    ],
)
@pytest.mark.usefixtures("bwd_mode")
def test_masks_hiding_whole_blocks(pattern, kind, values):
    # Masks that hide whole blocks (a causal mask passed as a tensor, a band):
    # the dK/dV and dQ kernels skip those blocks; gradients stay exact. Rows
    # hidden by a finite value average all keys, so their blocks are kept,
    # and get eager's gradients.
    N, M = 50, 96
    mask = _hiding_mask(_structured_hidden(pattern, N, M), kind, values)
    run_case(B=2, Hq=2, N=N, M=M, D=16, dtype=torch.float32, mask_tensor=mask)


@pytest.mark.parametrize("kind", ["bool", "float32-inf", "bfloat16-min"])
@pytest.mark.usefixtures("bwd_mode")
def test_mask_hidden_key_blocks_are_skipped(kind):
    # Keys [128, 256) are hidden from every query: their blocks are never
    # read (NaN there must not leak into dq), and their dk, dv are exactly 0.
    # 128 is a multiple of every BLOCK_N.
    N, M, D = 20, 256, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v, go = (torch.randn(1, 2, L, D, generator=gen).to(DEVICE) for L in (N, M, M, N))
    hidden = torch.zeros(N, M, dtype=torch.bool)
    hidden[:, 128:] = True
    mask = _hiding_mask(hidden, kind).to(DEVICE)
    kc, vc = (t[:, :, :128].clone() for t in (k, v))
    k[:, :, 128:] = float("nan")
    v[:, :, 128:] = float("nan")
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, kc, vc))
    m64 = mask[:, :128] if mask.dtype == torch.bool else mask[:, :128].double()
    o64 = ref.reference_attention(q64, k64, v64, m64)
    o64.backward(go.double())
    lse = ref.reference_lse(q64, k64, m64).float()
    out = o64.detach().to(q.dtype)
    dq, dk, dv, _ = attention_backward(go, q, k, v, mask, None, out, lse, dropout_p=0.0, scale=D ** -0.5,
                                       mask_grad=False, window_left=None, window_right=None, bottom_right=False)
    assert (dk[:, :, 128:] == 0).all() and (dv[:, :, 128:] == 0).all()
    _check("dq", dq, q64.grad, torch.float32)
    _check("dk", dk[:, :, :128], k64.grad, torch.float32)
    _check("dv", dv[:, :, :128], v64.grad, torch.float32)


@pytest.mark.parametrize("values", ["bias", "zeros"])
@pytest.mark.usefixtures("bwd_mode")
def test_mask_grad_with_hidden_blocks(values):
    # A learned float mask with whole hidden blocks: skipped blocks get a
    # gradient of exactly 0, as the reference's; blocks computed without
    # reading the mask (all its values zero) still get their gradient.
    N, M = 50, 96
    mask = _hiding_mask(_structured_hidden("band", N, M), "float32-min", values)
    run_case(B=1, Hq=2, N=N, M=M, D=16, dtype=torch.float32, mask_tensor=mask, mask_grad=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.usefixtures("bwd_mode")
def test_fully_masked_rows_give_zero_gradient(kind):
    # rows 0, 5 and 16 see no key; bottom-right causal with N > M adds more.
    dq, dk, dv, _ = run_case(N=23, M=17, D=16, dtype=torch.float32, mask_shape=(23, 17),
                             mask_kind=kind, empty_rows=(0, 5, 16), window_right=0, bottom_right=True)
    assert (dq[:, :, [0, 5, 16]] == 0).all()
    assert (dq[:, :, :6] == 0).all()  # rows before the diagonal reaches key 0


@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (4, 1)])
@pytest.mark.usefixtures("bwd_mode")
def test_gqa_mqa(Hq, Hkv):
    run_case(Hq=Hq, Hkv=Hkv, N=17, M=33, D=16, Dv=24, dtype=torch.float16, window_right=0,
             bottom_right=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.usefixtures("bwd_mode")
def test_noncontiguous(dtype):
    run_case(B=2, Hq=2, N=17, M=33, D=40, Dv=24, dtype=dtype, noncontig=True,
             mask_shape=(2, 1, 17, 33), mask_kind="float")


@pytest.mark.parametrize("case", ["gqa causal", "float mask", "dropout", "odd head dims"])
def test_dq_descriptor_loads(case, monkeypatch, launched):
    """dQ reads K and V through tensor descriptors (FLASHFUSE_TMA=1, two
    passes): keys past M and columns past the head dims must arrive as zeros,
    so K and V sit in NaN padding here."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9 or more")
    monkeypatch.setenv("FLASHFUSE_TMA", "1")
    monkeypatch.setenv("FLASHFUSE_BWD", "two_pass")
    seen = []
    real = problem.descriptor_loads
    monkeypatch.setattr(problem, "descriptor_loads", lambda *ts, **kw: seen.append(real(*ts, **kw)) or seen[-1])
    if case == "gqa causal":
        run_case(B=2, Hq=4, Hkv=2, N=45, M=37, D=40, Dv=24, dtype=torch.bfloat16, window_right=0,
                 bottom_right=True, kv_in_nan_padding=True)
    elif case == "float mask":
        run_case(N=33, M=70, D=32, dtype=torch.float16, mask_shape=(1, 2, 33, 70), mask_kind="float",
                 mask_grad=True, window_left=20, kv_in_nan_padding=True)
    elif case == "dropout":
        run_case(N=17, M=45, D=16, dtype=torch.float16, dropout_p=0.3, mask_shape=(1, 1, 1, 45),
                 mask_kind="bool", kv_in_nan_padding=True)
    else:  # 72 and 8 columns: padded tiles of 128 and 16
        run_case(N=20, M=50, D=72, Dv=8, dtype=torch.bfloat16, kv_in_nan_padding=True)
    assert seen == [True] and launched == ["dkdv", "dq"]


@pytest.mark.usefixtures("bwd_mode")
def test_broadcast_grad_out():
    run_case(N=33, M=17, D=16, Dv=40, dtype=torch.float16, go_broadcast=True, window_right=0)


@pytest.mark.parametrize("dropout_p", [0.3, pytest.param(0.9, marks=pytest.mark.slow)])
@pytest.mark.usefixtures("bwd_mode")
def test_dropout(dropout_p):
    run_case(B=2, Hq=2, Hkv=1, N=17, M=33, D=16, Dv=24, dtype=torch.float32, dropout_p=dropout_p,
             window_left=9, window_right=2, mask_shape=(2, 1, 1, 33), mask_kind="float", mask_grad=True)


def test_dropout_keep_matches_triton_rule():
    """The PyTorch keep mask used as ground truth equals the kernels' rule."""
    fwd = pytest.importorskip("flashfuse.kernels.forward")
    if not hasattr(fwd, "dropout_keep_mask_triton"):
        pytest.skip("forward module has no dropout_keep_mask_triton")
    seed = torch.tensor(98765, dtype=torch.int64, device=DEVICE)
    got = fwd.dropout_keep_mask_triton(seed, 2, 2, 19, 37, 0.4).cpu()
    want = ref.dropout_keep_mask(98765, 2, 2, 19, 37, 0.4)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "shape",
    [(1, 2, 17, 33), (2, 17, 33), (2, 2, 17, 33), (17, 33), (2, 1, 1, 33), (2, 2, 17, 1), (1, 1, 1, 1)],
)
@pytest.mark.usefixtures("bwd_mode")
def test_mask_grad_shapes(shape):
    # causal + GQA: skipped blocks must give zero mask gradient, and the
    # reduction over the heads of a group must be complete.
    run_case(B=2, Hq=2, Hkv=1, N=17, M=33, D=16, dtype=torch.float32, mask_shape=shape,
             mask_kind="float", mask_grad=True, window_right=0)


@pytest.mark.usefixtures("bwd_mode")
def test_mask_grad_batch_chunks(monkeypatch):
    """A batch-broadcast mask's dS buffer filled one batch element at a time
    (dropout checks that each chunk keeps its global batch index)."""
    monkeypatch.setattr(backward, "_DMASK_BUFFER_BYTES", 4 * 2 * 17 * 33)
    run_case(B=3, Hq=2, Hkv=1, N=17, M=33, D=16, dtype=torch.float32, mask_shape=(2, 17, 33),
             mask_kind="float", mask_grad=True, dropout_p=0.25, window_left=20, window_right=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.usefixtures("bwd_mode")
def test_mask_grad_low_precision(dtype):
    run_case(B=1, N=33, M=17, D=16, dtype=dtype, mask_shape=(2, 33, 17), mask_kind="float",
             mask_grad=True, window_left=6, window_right=6, bottom_right=True)


def test_deterministic(monkeypatch):
    # Two passes are the deterministic schedule (one pass adds dQ atomically).
    monkeypatch.setenv("FLASHFUSE_BWD", "two_pass")
    kw = dict(B=1, Hq=4, Hkv=2, N=21, M=37, D=16, dtype=torch.float16, mask_shape=(4, 21, 37),
              mask_kind="float", mask_grad=True, seed=3)
    a, b = run_case(**kw), run_case(**kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# Feature mixes for comparing the two schedules: dtype, then run_case keywords.
ONE_PASS_CASES = [
    # GQA, causal, learned float mask broadcast over queries, dropout
    (torch.float32, dict(B=2, Hq=2, Hkv=1, N=21, M=37, D=24, mask_shape=(2, 1, 1, 37), mask_kind="float",
                         mask_grad=True, dropout_p=0.25, window_right=0)),
    # MQA, bottom-right sliding window, bool mask, strided inputs
    (torch.float16, dict(B=1, Hq=3, Hkv=1, N=37, M=45, D=24, Dv=40, mask_shape=(37, 45), mask_kind="bool",
                         window_left=9, window_right=2, bottom_right=True, noncontig=True)),
    # bfloat16 (the interpreter's upcast path), N > M with rows that see no key
    (torch.bfloat16, dict(B=1, Hq=2, N=45, M=37, D=24, window_right=0, bottom_right=True)),
]


@pytest.mark.parametrize("dtype, kw", ONE_PASS_CASES, ids=["gqa-causal-dmask-dropout", "mqa-window-bool",
                                                           "bf16-bottom-right"])
def test_one_pass_matches_two_pass(dtype, kw, monkeypatch, launched):
    """Each schedule against float64 (in run_case), and against each other:
    dK, dV and dmask come from the same dK/dV code, dQ differs only in the
    order of its float32 sums."""
    results = {}
    for mode, kinds in (("two_pass", ["dkdv", "dq"]), ("one_pass", ["dkdv_dq"])):
        monkeypatch.setenv("FLASHFUSE_BWD", mode)
        launched.clear()
        results[mode] = run_case(dtype=dtype, **kw)
        assert launched == kinds, mode
    one, two = results["one_pass"], results["two_pass"]
    _check("dq one pass vs two", one[0], two[0], dtype)
    for name, a, b in zip(("dk", "dv", "dmask"), one[1:], two[1:]):
        if b is None:
            assert a is None
        elif DEVICE == "cpu":  # one program order: the same bits
            assert torch.equal(a, b), name
        else:  # a fixed config may differ between the two kernels
            _check(f"{name} one pass vs two", a, b, dtype)


def test_schedule_selection(monkeypatch, launched):
    """FLASHFUSE_BWD picks the schedule at call time; unset means one pass
    with dropout at head dims up to _ONE_PASS_DROPOUT_MAX_D, else
    _ONE_PASS_DEFAULT; deterministic mode always takes two passes."""
    kw = dict(B=1, Hq=2, Hkv=1, N=5, M=7, dtype=torch.float32, window_right=0)
    # (FLASHFUSE_BWD, default, dropout-max-D, deterministic, dropout, D) -> kernels
    cases = [
        ("one_pass", False, 64, False, 0.0, 16, ["dkdv_dq"]),
        ("two_pass", True, 64, False, 0.0, 16, ["dkdv", "dq"]),
        ("two_pass", True, 64, False, 0.3, 16, ["dkdv", "dq"]),
        (None, False, 64, False, 0.0, 16, ["dkdv", "dq"]),
        (None, False, 64, False, 0.3, 16, ["dkdv_dq"]),
        (None, False, 16, False, 0.3, 24, ["dkdv", "dq"]),
        (None, True, 0, False, 0.0, 16, ["dkdv_dq"]),
        (None, True, 0, False, 0.3, 16, ["dkdv_dq"]),
        ("one_pass", True, 64, True, 0.3, 16, ["dkdv", "dq"]),
        (None, True, 64, True, 0.3, 16, ["dkdv", "dq"]),
    ]
    for env, default, max_d, det, p, D, kinds in cases:
        if env is None:
            monkeypatch.delenv("FLASHFUSE_BWD", raising=False)
        else:
            monkeypatch.setenv("FLASHFUSE_BWD", env)
        monkeypatch.setattr(backward, "_ONE_PASS_DEFAULT", default)
        monkeypatch.setattr(backward, "_ONE_PASS_DROPOUT_MAX_D", max_d)
        launched.clear()
        run_case(deterministic=det, dropout_p=p, D=D, **kw)
        assert launched == kinds, (env, default, max_d, det, p, D)
    assert not torch.are_deterministic_algorithms_enabled()

    monkeypatch.setenv("FLASHFUSE_BWD", "onepass")
    with pytest.raises(ValueError, match="FLASHFUSE_BWD"):
        run_case(D=16, **kw)


def test_deterministic_mode_takes_two_passes(monkeypatch):
    """Under torch.use_deterministic_algorithms(True), FLASHFUSE_BWD=one_pass
    gives the bits of the two-pass schedule."""
    kw = dict(B=1, Hq=4, Hkv=2, N=21, M=37, D=24, dtype=torch.float16, mask_shape=(4, 21, 37),
              mask_kind="float", mask_grad=True, window_right=0, seed=5)
    monkeypatch.setenv("FLASHFUSE_BWD", "two_pass")
    want = run_case(**kw)
    monkeypatch.setenv("FLASHFUSE_BWD", "one_pass")
    got = run_case(deterministic=True, **kw)
    assert not torch.are_deterministic_algorithms_enabled()
    for x, y in zip(got, want):
        assert torch.equal(x, y)


@pytest.mark.usefixtures("bwd_mode")
def test_chained_with_forward_kernel():
    """Forward kernel's out and lse feed the backward kernel."""
    fwd = pytest.importorskip("flashfuse.kernels.forward")
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, N, M, D, Dv = 1, 2, 1, 33, 47, 40, 24
    dtype = torch.float16
    q, k, v = (torch.randn(s, generator=gen).to(dtype).to(DEVICE)
               for s in ((B, Hq, N, D), (B, Hkv, M, D), (B, Hkv, M, Dv)))
    go = torch.randn((B, Hq, N, Dv), generator=gen).to(dtype).to(DEVICE)
    mask = torch.randn((Hq, N, M), generator=gen).to(dtype).to(DEVICE)
    seed = torch.tensor(42, dtype=torch.int64, device=DEVICE)
    kw = dict(dropout_p=0.2, scale=0.3, window_left=None, window_right=0, bottom_right=True)
    out, lse = fwd.attention_forward(q, k, v, mask, seed, **kw)
    dq, dk, dv, dmask = attention_backward(go, q, k, v, mask, seed, out, lse, mask_grad=True, **kw)

    keep = ref.dropout_keep_mask(42, B, Hq, N, M, 0.2)
    q64, k64, v64 = (t.cpu().double().requires_grad_() for t in (q, k, v))
    m64 = mask.cpu().double().requires_grad_()
    o64 = ref.reference_attention(q64, k64, v64, m64, scale=0.3, window_right=0, bottom_right=True,
                                  dropout_mask=keep, dropout_p=0.2)
    o64.backward(go.cpu().double())
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad),
                            ("dmask", dmask, m64.grad)):
        _check(name, got, want, dtype)


def test_mask_grad_rejects_bool_mask():
    q = torch.randn(1, 1, 4, 16, device=DEVICE)
    mask = torch.ones(4, 4, dtype=torch.bool, device=DEVICE)
    lse = torch.zeros(1, 1, 4, device=DEVICE)
    with pytest.raises(ValueError, match="floating"):
        attention_backward(q, q, q, q, mask, None, q, lse, dropout_p=0.0, scale=1.0, window_left=None,
                           window_right=None, bottom_right=False, mask_grad=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N, M", [(1, 47), (47, 1), (70, 70), (65, 33)])
@pytest.mark.parametrize("D, Dv", [(16, 64), (64, 16), (24, 40)])
@pytest.mark.parametrize("band", [(None, None, False), (None, 0, False), (3, 0, True), (2, 9, True)])
@pytest.mark.usefixtures("bwd_mode")
def test_sweep(N, M, D, Dv, dtype, band):
    wl, wr, br = band
    run_case(B=1, Hq=4, Hkv=2, N=N, M=M, D=D, Dv=Dv, dtype=dtype, window_left=wl, window_right=wr,
             bottom_right=br, mask_shape=(1, 4, N, M), mask_kind="float", mask_grad=True,
             dropout_p=0.1, noncontig=True, seed=N * M + D)


# ---------------------------------------------------------------------------
# GPU tests: larger shapes (run on a CUDA machine with `pytest -m gpu`)
# ---------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N, M", [(1024, 1024), (4096, 4096), (1000, 3001)])
def test_gpu_large(N, M, D, causal, dtype):
    run_case(B=2, Hq=4, Hkv=2, N=N, M=M, D=D, dtype=dtype, window_right=0 if causal else None,
             bottom_right=True, seed=D)


@gpu
@pytest.mark.parametrize("D, Dv", [(80, 80), (96, 64), (192, 128)])
def test_gpu_odd_heads_window_dropout(D, Dv):
    run_case(B=2, Hq=8, Hkv=1, N=1537, M=2049, D=D, Dv=Dv, dtype=torch.bfloat16, window_left=256,
             window_right=0, bottom_right=True, dropout_p=0.15, noncontig=True)


@gpu
@pytest.mark.parametrize("shape", [(1, 4, 1024, 1024), (4, 1024, 1024), (1024, 1024), (2, 1, 1, 1024)])
def test_gpu_mask_grad(shape):
    run_case(B=2, Hq=4, Hkv=2, N=1024, M=1024, D=64, dtype=torch.float16, mask_shape=shape,
             mask_kind="float", mask_grad=True, window_right=0)


@gpu
@pytest.mark.parametrize("mode", ["one_pass", "two_pass"])
@pytest.mark.parametrize(
    "dtype, kw",
    [
        (torch.bfloat16, dict(B=2, Hq=4, N=1000, M=1000, D=128, window_right=0)),
        (torch.float16, dict(B=2, Hq=8, Hkv=2, N=1000, M=1201, D=64, Dv=96, window_right=0, bottom_right=True,
                             dropout_p=0.15, mask_shape=(1, 8, 1000, 1201), mask_kind="float", mask_grad=True)),
    ],
    ids=["bf16-causal-d128", "fp16-gqa-dropout-dmask"],
)
@pytest.mark.parametrize("autotune", ["0", "1"])
def test_gpu_one_pass(mode, dtype, kw, autotune, monkeypatch):
    # Autotuning runs each candidate several times: the one-pass tuner must
    # zero the dQ accumulator before each run and before the real launch.
    monkeypatch.setenv("FLASHFUSE_BWD", mode)
    monkeypatch.setenv("FLASHFUSE_AUTOTUNE", autotune)
    run_case(dtype=dtype, seed=11, **kw)


@gpu
@pytest.mark.parametrize("D", [32, 64, 128])
def test_gpu_dropout_default_schedule(D, monkeypatch):
    # Unforced schedule: one pass with dropout up to D = 64, two passes above.
    monkeypatch.delenv("FLASHFUSE_BWD", raising=False)
    run_case(B=2, Hq=4, Hkv=2, N=1031, M=1031, D=D, dtype=torch.bfloat16, window_right=0, dropout_p=0.1, seed=3)


@gpu
def test_gpu_fp32_ieee(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    run_case(B=1, Hq=2, N=777, M=1111, D=128, dtype=torch.float32, mask_shape=(1, 1, 777, 1111),
             mask_kind="bool", window_left=300, window_right=100)


@pytest.mark.parametrize("kind", ["dkdv", "dkdv_dq", "dq"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("mask_kind", [0, 2])
def test_candidates_follow_the_head_dim_class_order(kind, head_dim, dropout, mask_kind, monkeypatch):
    """The pruned candidates keep the best-first order of their head-dim
    class's list, whatever order the shared config list has (a tile that
    leads one class must not lead another by accident); with a mask tensor
    at head dims up to 64 the dK/dV kernel starts from its masked tile."""
    monkeypatch.setattr(backward, "_max_shared_mem", lambda device: 227 * 1024)
    tiles = backward._DQ_TILES if kind == "dq" else backward._DKDV_TILES
    cls = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    block = max(16, 1 << (head_dim - 1).bit_length())
    q = torch.empty(1, dtype=torch.bfloat16)
    kept = backward._prune(kind)(list(reversed(backward._CONFIGS[kind])),
                                 {"Q": q, "BLOCK_D": block, "BLOCK_DV": block, "HAS_DROPOUT": dropout,
                                  "MASK_KIND": mask_kind})
    got = [config_tuple(c) for c in kept]
    order = tiles[cls]
    if mask_kind and kind != "dq" and cls == 64:
        order = sorted(order, key=lambda t: t != backward._MASKED_SMALL_HEAD_DKDV_FIRST)
        assert got[0] == backward._MASKED_SMALL_HEAD_DKDV_FIRST
    want = [t for t in order if not (dropout and t[1] < 32)]
    assert got and got == [t for t in want if t in got], (got, want)
    assert got[0] == want[0] or cls == 256, "the class's first tile fits on a Hopper-sized GPU"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_candidates_with_descriptors_have_three_stages_or_more(head_dim, monkeypatch):
    """Triton 3.6's ptxas crashes on two-stage descriptor pipelines, so the
    dQ kernel with descriptor loads never gets one; dK/dV keeps its list."""
    monkeypatch.setattr(backward, "_max_shared_mem", lambda device: 227 * 1024)
    q = torch.empty(1, dtype=torch.bfloat16)
    args = {"Q": q, "BLOCK_D": head_dim, "BLOCK_DV": head_dim, "HAS_DROPOUT": False, "DESC": True}
    dq = [config_tuple(c) for c in backward._prune("dq")(backward._CONFIGS["dq"], args)]
    assert dq and all(t[3] >= 3 for t in dq), dq
    dq_pointers = [config_tuple(c) for c in backward._prune("dq")(backward._CONFIGS["dq"], {**args, "DESC": False})]
    assert dq == [t for t in dq_pointers if t[3] >= 3]
    dkdv = [config_tuple(c) for c in backward._prune("dkdv")(backward._CONFIGS["dkdv"], args)]
    assert any(t[3] == 2 for t in dkdv), "dK/dV reads through pointers: two stages stay"
