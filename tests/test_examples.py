"""The examples run as the README tells users to run them, and reach their
own checks against eager (each raises if its comparison fails)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process for all of them, so torch is imported once; each example runs as
# __main__, as `python examples/NAME.py` would run it.
_RUNNER = """
import runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")
    print("EXAMPLE DONE", path, flush=True)
"""

EXAMPLES = {
    "demo.py": "match eager",
    "nanogpt_block.py": "compiled and eager training agree",
    "hf_model.py": "logits and gradients match eager",
}


def test_examples_run_and_match_eager():
    pytest.importorskip("transformers")
    paths = [os.path.join(ROOT, "examples", name) for name in EXAMPLES]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, *paths], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for name, success in EXAMPLES.items():
        assert f"EXAMPLE DONE {os.path.join(ROOT, 'examples', name)}" in proc.stdout, name
        assert success in proc.stdout, name
