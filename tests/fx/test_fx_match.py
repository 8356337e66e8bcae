"""The plan's two vocabularies (``flashfuse.fx.match``): named tuple types
that check their kind when built and stay equal to the plain tuples their
readers index."""

from __future__ import annotations

import copy

import pytest

from flashfuse.fx.match import Step, Transform


def test_step_and_transform_are_checked_named_tuples():
    s = Step("unflatten", 1, (-1, 4))
    assert s == ("unflatten", 1, (-1, 4)) and s.name == "unflatten" and s.args == (1, (-1, 4))
    assert copy.deepcopy(s) == s and type(copy.deepcopy(s)) is Step
    t = Transform("scale", "mul", 0.5)
    assert t.kind == "scale" and t.args == ("mul", 0.5) and t[0] == "scale"
    with pytest.raises(ValueError, match="unknown view step"):
        Step("reshape", (2, 3))
    with pytest.raises(ValueError, match="unknown score transform"):
        Transform("exp")
