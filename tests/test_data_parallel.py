"""Data parallel training with the backend: ``DistributedDataParallel`` and
FSDP2 (``fully_shard``), then ``torch.compile(backend=flashfuse...)``, on two
CPU processes joined by gloo.

Dynamo's DDP optimiser splits a graph at gradient-bucket boundaries before
the backend sees it; the tests count, per piece the backend compiles, the
attention ops in it and the softmaxes left over, and compare the loss and
every gradient with one process running the global batch eagerly (no dropout).
All scenarios run in one spawn of two processes (process start-up and
imports are most of the cost)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_models import MODELS, loss_fn, make_model  # noqa: E402
from distutil import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2
LOCAL_BATCH = 2
# AOTAutograd after the rewrite (the op's backward as Inductor would see it),
# without Inductor's code generation, which takes too long on two shared cores.
COMPILER = "aot_eager"
# (wrapper, model, bucket_cap_mb): 1 KB buckets put a boundary before nearly
# every parameter; 25 MB (DDP's default) keeps these models in one piece.
SCENARIOS = [
    ("ddp", "gpt2", 0.001), ("ddp", "llama", 0.001), ("ddp", "llama", 25.0),
    ("ddp", "param_in_chain", 0.001), ("fsdp2", "gpt2", None),
]


def _global_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (WORLD * LOCAL_BATCH, 17), generator=g)


def _reference(name):
    """One process, the global batch, eager: loss and gradients of step 1,
    then the loss after one SGD step."""
    model = make_model(name)
    idx = _global_batch()
    loss = loss_fn(model, idx)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.item(), grads, loss_fn(model, idx).item()


def _scenarios(rank, world):
    import torch.distributed as dist
    from torch._dynamo.backends.registry import lookup_backend
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flashfuse

    op = torch.ops.flashfuse.attention.default
    results = {}
    for wrapper, name, cap in SCENARIOS:
        torch._dynamo.reset()
        pieces, runs = [], []
        start = time.perf_counter()

        def record(gm, example_inputs):
            nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
            ops = sum(n.target is op for n in nodes)
            pieces.append((ops, sum("softmax" in str(n.target) for n in nodes)))
            compiled = lookup_backend(COMPILER)(gm, example_inputs)

            def run(*args):
                runs.append(ops)  # attention ops run, counted per call (FSDP2 reuses one block's graph)
                return compiled(*args)

            return run

        backend = flashfuse.make_backend(compiler=record, record=True)
        model = make_model(name)
        if wrapper == "ddp":
            # The DDP optimiser's first bucket is at least this constant
            # (1 MiB): lower it with the cap so that small caps split these
            # small models.
            dist._DEFAULT_FIRST_BUCKET_BYTES = min(int(cap * 2**20), 2**20)
            wrapped = DDP(model, bucket_cap_mb=cap)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        compiled = torch.compile(wrapped, backend=backend)
        idx = _global_batch()[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        loss = loss_fn(compiled, idx)
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n.replace("_fsdp_wrapped_module.", "")] = g.detach().clone()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        runs.clear()  # the DDP optimiser runs the pieces on fake tensors while compiling
        loss2 = loss_fn(compiled, idx).detach()
        ran = sum(runs)
        losses = torch.stack([loss.detach(), loss2])
        dist.all_reduce(losses)
        results[(wrapper, name, cap)] = dict(
            pieces=pieces, ran=ran, seconds=time.perf_counter() - start, losses=(losses / world).tolist(), grads=grads,
            rewritten=sum(c.rewritten for c in backend.candidates),
            reasons=[c.reason for c in backend.candidates if not c.rewritten],
        )
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_scenarios, WORLD, tmp_path_factory.mktemp("dp"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: "-".join(map(str, s)))
def test_every_attention_rewritten_and_training_matches(results, scenario):
    wrapper, name, cap = scenario
    layers = 2
    ref_loss, ref_grads, ref_loss2 = _reference(name)
    for rank, by_scenario in enumerate(results):
        r = by_scenario[scenario]
        # Every attention ran as the op, from pieces the backend compiled,
        # and no piece holds a softmax left over from a cut chain.
        assert r["ran"] == layers, (rank, r["pieces"], r["reasons"])
        assert sum(sm for _, sm in r["pieces"]) == 0, (rank, r["pieces"])
        assert r["rewritten"] >= 1 and not r["reasons"], r["reasons"]
        if wrapper == "ddp":
            assert sum(ops for ops, _ in r["pieces"]) == layers == r["rewritten"], r["pieces"]
        if wrapper == "ddp" and cap < 1:
            assert len(r["pieces"]) > layers  # the small buckets did split the graph
        assert r["losses"][0] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert r["losses"][1] == pytest.approx(ref_loss2, rel=1e-5, abs=1e-6)
        assert set(r["grads"]) == set(ref_grads)
        for n, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][n], g, atol=2e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_models_cover_grouped_heads():
    assert MODELS["llama"]["heads"] > MODELS["llama"]["kv_heads"]
    assert MODELS["llama"]["width"] // MODELS["llama"]["heads"] == 32
