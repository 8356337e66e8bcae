"""Real transformers attention modules whose eager attention uses the
spellings of issue 20 (batch views around bmm, ALiBi via baddbmm, per-head
logit scales, shifted-window masks): tiny random configs, CPU fp32; every
attention block is rewritten and outputs (and, in training, parameter
gradients) match eager."""

from __future__ import annotations

import pytest
import torch

from fxutil import compile_and_compare

T = pytest.importorskip("transformers")


class LastHidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw).last_hidden_state


def _ids():
    return {"input_ids": torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))}


def _pixels():
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}


def bloom():
    cfg = T.BloomConfig(vocab_size=100, hidden_size=64, n_layer=2, n_head=4, attention_dropout=0.0,
                        hidden_dropout=0.0, attn_implementation="eager")
    return T.BloomModel(cfg), _ids()


def falcon_alibi():
    cfg = T.FalconConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                         new_decoder_architecture=False, multi_query=False, attention_dropout=0.0,
                         hidden_dropout=0.0, attn_implementation="eager")
    return T.FalconModel(cfg), _ids()


def deberta_v2():
    cfg = T.DebertaV2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, relative_attention=False, position_biased_input=True,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs = _ids()
    inputs["attention_mask"] = torch.ones(2, 7, dtype=torch.long)
    inputs["attention_mask"][0, 5:] = 0
    return T.DebertaV2Model(cfg), inputs


def swin():
    cfg = T.SwinConfig(image_size=32, patch_size=4, embed_dim=32, depths=[2], num_heads=[2], window_size=4,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                       attn_implementation="eager")
    return T.SwinModel(cfg), _pixels()


def swinv2():
    # Two blocks: the second shifts its windows (the 5-D window-mask view).
    cfg = T.Swinv2Config(image_size=32, patch_size=4, embed_dim=32, depths=[2], num_heads=[2], window_size=4,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return T.Swinv2Model(cfg), _pixels()


MODELS = [bloom, falcon_alibi, deberta_v2, swin, swinv2]


def _check(make, train: bool):
    torch.manual_seed(0)
    model, inputs = make()
    m = LastHidden(model).train(train)
    _, backend = compile_and_compare_kw(m, inputs, train)
    assert backend.candidates and all(c.rewritten for c in backend.candidates), [c.reason for c in backend.candidates]


def compile_and_compare_kw(m, inputs, train):
    # compile_and_compare takes positional inputs: bind the keywords.
    names = list(inputs)

    class Positional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = m

        def forward(self, *args):
            return self.inner(**dict(zip(names, args)))

    n_blocks = 2
    return compile_and_compare(Positional().train(train), *inputs.values(), expect=n_blocks,
                               compiler="aot_eager" if train else "eager", grad=train, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("make", MODELS, ids=lambda f: f.__name__)
def test_eval(make):
    _check(make, train=False)


@pytest.mark.parametrize("make", [bloom, swinv2], ids=lambda f: f.__name__)
def test_train_step_gradients(make):
    _check(make, train=True)
