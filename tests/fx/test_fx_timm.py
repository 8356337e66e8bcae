"""Real timm attention blocks with their unfused (matmul-softmax-matmul)
path: tiny random configs (image 32, patch 8, width 32, 2 heads, one block
or one window stage), CPU fp32. Every attention that is the value product of
a softmax is rewritten, in static and dynamic compiles, in inference and
training, and outputs and gradients match eager; CaiT's talking-heads
attention (a head-mixing projection between the softmax and the value
product) stays as it is, with its reason."""

from __future__ import annotations

import sys

import pytest
import torch

from fxutil import compile_and_compare


def _import_timm():
    """timm, or a skip. timm imports torchvision when it is imported (data
    transforms, a frozen batch norm), but its model code does not use it. The
    torchvision wheels on PyPI for Linux are built against a CUDA torch and do
    not import next to a CPU torch; then timm is imported with an empty
    stand-in for torchvision, removed again right after, so that nothing else
    sees it. The attention blocks tested here need nothing from it."""
    try:
        import timm

        return timm
    except ImportError as e:
        if getattr(e, "name", None) == "timm":
            pytest.skip("timm is not installed", allow_module_level=True)
        err = e
    except Exception as e:  # noqa: BLE001 - a torchvision that fails to load
        err = e
    if "torchvision" not in repr(err) and not any(k.startswith("torchvision") for k in sys.modules):
        pytest.skip(f"timm does not import: {err!r}", allow_module_level=True)
    _forget("timm", "torchvision")
    finder = _StandIn()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"timm does not import even without torchvision: {e!r}", allow_module_level=True)
    finally:
        sys.meta_path.remove(finder)
        _forget("torchvision")
    return timm


def _forget(*packages):
    for name in [k for k in sys.modules if k.split(".")[0] in packages]:
        del sys.modules[name]


class _Anything(type):
    # Any attribute of a stand-in (``InterpolationMode.BICUBIC``,
    # ``transforms.Compose``) is a fresh empty class: enough for module-level
    # code that only names them.
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {"__init__": lambda self, *a, **k: None})


class _StandIn:
    """A meta-path finder that makes every ``torchvision.*`` an empty module."""

    def find_spec(self, fullname, path, target=None):
        import importlib.machinery

        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        import types

        class Module(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return _Anything(name, (), {"__init__": lambda self, *a, **k: None})

        module = Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


timm = _import_timm()
from timm.models import beit, cait, eva, pvt_v2, swin_transformer, swin_transformer_v2, twins, vision_transformer, xcit  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=4)
# Swin: 4x4 patches make an 8x8 grid of four 4x4 windows; the second block
# shifts them (the window mask).
WINDOWS = dict(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(2,), num_heads=(2,), num_classes=4)


def vit():
    return vision_transformer.VisionTransformer(**TINY), 1


def swin():
    return swin_transformer.SwinTransformer(**WINDOWS), 2


def swinv2():
    # Cosine attention: normalised q and k, a per-head logit_scale (H, 1, 1)
    # after the product, a bias MLP with an in-place ReLU.
    return swin_transformer_v2.SwinTransformerV2(**WINDOWS), 2


def eva_rope():
    return eva.Eva(**TINY, use_rot_pos_emb=True), 1


def beit_rel_pos():
    return beit.Beit(**TINY, use_rel_pos_bias=True), 1


def xcit_channels():
    # Cross-covariance attention: the softmax runs over channels (head size
    # = tokens), with a learned per-head temperature; then class attention.
    return xcit.Xcit(**TINY, cls_attn_layers=1), 2


def pvt_v2_reduced():
    # Keys and values from a spatially reduced sequence (M < N).
    return pvt_v2.PyramidVisionTransformerV2(depths=(1,), embed_dims=(32,), num_heads=(2,), sr_ratios=(2,),
                                             mlp_ratios=(2,), num_classes=4), 1


def cait_class_attn():
    # One talking-heads block (left alone) and one class-attention block.
    return cait.Cait(**TINY, depth_token_only=1), 1


def twins_svt():
    # One locally grouped block (windows of 4x4 tokens, q/k/v 5-D: (B,
    # windows, heads, tokens, head dim)) and one global sub-sampled block.
    return twins.Twins(img_size=32, patch_size=4, embed_dims=(32,), num_heads=(2,), mlp_ratios=(2,), depths=(2,),
                       sr_ratios=(2,), wss=(4,), num_classes=4), 2


def twins_svt_padded():
    # A 7x7 token grid: the windows are padded to 8x8 before the attention.
    return twins.Twins(img_size=28, patch_size=4, embed_dims=(32,), num_heads=(2,), mlp_ratios=(2,), depths=(1,),
                       sr_ratios=(1,), wss=(4,), num_classes=4), 1


def _unfused(model):
    # timm takes SDPA where it can; its own matmul-softmax-matmul path is what
    # the pass reads. Per module, so the global flag of timm stays as it is.
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


def _check(make, *, train, dynamic, size=32):
    torch.manual_seed(0)
    model, expect = make()
    model = _unfused(model).train(train)
    x = torch.randn(2, 3, size, size, requires_grad=train)
    # fp32 against eager: 1e-4 relative on outputs, 1e-3 on gradients.
    _, backend = compile_and_compare(model, x, expect=expect, compiler="aot_eager" if train else "eager",
                                     dynamic=dynamic, grad=train, atol=1e-5, rtol=1e-4)
    return backend


EVAL = [vit, swin, swinv2, eva_rope, beit_rel_pos, xcit_channels, pvt_v2_reduced, twins_svt]


@pytest.mark.parametrize("make", EVAL, ids=lambda f: f.__name__)
def test_eval_static(make):
    backend = _check(make, train=False, dynamic=False)
    assert backend.candidates and all(c.rewritten for c in backend.candidates), [c.reason for c in backend.candidates]
    if make is swinv2:
        # explain names the learned factor and the bias it folded.
        for c in backend.candidates:
            assert "per-head scale" in c.facts.get("scale", "") and c.facts.get("mask") == "additive", c.facts


@pytest.mark.parametrize("make", [vit, swinv2], ids=lambda f: f.__name__)
def test_eval_dynamic(make):
    backend = _check(make, train=False, dynamic=True)
    assert all(c.rewritten for c in backend.candidates), [c.reason for c in backend.candidates]


@pytest.mark.parametrize("make", [vit, swinv2, beit_rel_pos, twins_svt], ids=lambda f: f.__name__)
def test_train_gradients(make):
    backend = _check(make, train=True, dynamic=False)
    assert all(c.rewritten for c in backend.candidates), [c.reason for c in backend.candidates]


def test_cait_talking_heads_left_alone():
    """CaiT's talking heads mix the heads' probabilities (a linear layer over
    the head axis) before the value product: not attention the op computes.
    Its class attention is rewritten."""
    backend = _check(cait_class_attn, train=False, dynamic=False)
    by_module = {c.where()[0]: c for c in backend.candidates}
    talking = by_module["blocks.0.attn"]
    assert not talking.rewritten
    assert "not a product with v" in talking.reason, talking.reason
    assert by_module["blocks_token_only.0.attn"].rewritten


def test_twins_locally_grouped_attention_folded():
    """Twins' locally grouped attention is rewritten with its (B, windows)
    dims folded into the op's batch, also when the token grid is padded to
    whole windows; its global sub-sampled attention is rewritten as it is."""
    backend = _check(twins_svt, train=False, dynamic=False)
    by_module = {c.where()[0]: c for c in backend.candidates}
    local, global_ = by_module["blocks.0.0.attn"], by_module["blocks.0.1.attn"]
    assert local.rewritten and global_.rewritten, [c.reason for c in backend.candidates]
    assert local.facts["layout"] == "batch dims folded: (2, 4)", local.facts
    assert "layout" not in global_.facts
    backend = _check(twins_svt_padded, train=False, dynamic=False, size=28)
    assert backend.candidates[0].rewritten and "batch dims folded: (2, 4)" in backend.candidates[0].facts["layout"]


def test_twins_locally_grouped_attention_dynamic():
    # The block alone, its batch marked dynamic (the model, or a symbolic
    # token grid, takes Dynamo tens of seconds to trace): a 7x7 grid padded
    # to 4x4 windows.
    torch.manual_seed(0)
    attn = _unfused(twins.LocallyGroupedAttn(32, num_heads=2, ws=4)).eval()
    x = torch.randn(3, 49, 32)
    torch._dynamo.mark_dynamic(x, 0)
    _, backend = compile_and_compare(attn, x, (7, 7), expect=1, compiler="eager", dynamic=None, grad=False,
                                     atol=1e-5, rtol=1e-4)
    assert "batch dims folded" in backend.candidates[0].facts["layout"], backend.candidates[0].facts
