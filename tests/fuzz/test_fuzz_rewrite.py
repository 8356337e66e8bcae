"""Differential fuzzing of the graph pass: random attention programs, eager
versus ``torch.compile(backend=flashfuse)``.

Every program must give eager's outputs and gradients, and must be rewritten
exactly when its spec says it is a supported attention (see
``programs.expected_rewrites``). A failure prints the program's source: paste
it into ``test_regressions.py``.

Profiles (see FUZZING.md):

* default (CI): a few hundred programs, derandomized so every run tests the
  same programs, no example database written;
* long: ``FLASHFUSE_FUZZ_EXAMPLES=10000 pytest tests/fuzz -m slow -k long``
  (random seeds unless ``FLASHFUSE_FUZZ_SEED`` is set).
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, note, seed, settings

from .harness import run_differential
from .programs import expected_rewrites, render, repro, specs

LONG_EXAMPLES = int(os.environ.get("FLASHFUSE_FUZZ_EXAMPLES", "0") or 0)
LONG_SEED = os.environ.get("FLASHFUSE_FUZZ_SEED")


pytestmark = pytest.mark.usefixtures("blockwise_cpu", "fresh_dynamo")


def _ci(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def _check(spec, compiler):
    note(repro(spec))
    run_differential(spec, compiler)


# Most programs go through the rewrite and then run the graph as is (the
# cheapest post-rewrite compiler); training goes through AOTAutograd for a
# share, so the op's backward is used the way Inductor uses it; a handful
# go all the way through Inductor.
@_ci(80)
@given(spec=specs())
def test_rewrite_matches_eager(spec):
    _check(spec, "eager")


@_ci(20)
@given(spec=specs(hostile_rate=0.1))
def test_rewrite_matches_eager_aot(spec):
    _check(spec, "aot_eager")


@_ci(4)
@given(spec=specs(hostile_rate=0.0, allow_bf16=False))
def test_rewrite_matches_eager_inductor(spec):
    _check(spec, "inductor")


@pytest.mark.slow
@pytest.mark.skipif(LONG_EXAMPLES <= 0, reason="set FLASHFUSE_FUZZ_EXAMPLES to run the long profile")
def test_long_profile():
    """The long run documented in FUZZING.md: ``FLASHFUSE_FUZZ_EXAMPLES``
    programs, alternating post-rewrite compilers."""

    @settings(
        max_examples=LONG_EXAMPLES,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(spec=specs())
    def run(spec):
        compiler = "aot_eager" if spec.seed % 4 == 0 else "eager"
        _check(spec, compiler)
        tally["programs"] += 1
        tally[f"expect={expected_rewrites(spec, compiler)}"] += 1
        tally[compiler] += 1

    tally: collections.Counter = collections.Counter()
    if LONG_SEED is not None:
        run = seed(int(LONG_SEED))(run)
    start = time.time()
    try:
        run()
    finally:
        # Passing programs (shrinking replays included), for FUZZING.md.
        print(f"\nflashfuse fuzz: {dict(tally)} in {time.time() - start:.0f} s, torch {torch.__version__}")


def test_render_is_readable_source():
    """The printed program is valid Python that names the spelling it tests."""
    from hypothesis import find

    spec = find(specs(), lambda s: s.product == "einsum" and s.mask == "window")
    src = render(spec)
    compile(src, "<program>", "exec")
    assert "torch.einsum" in src and "keep = (j <= i)" in src
