"""Trace the private ops on fake CUDA tensors the way AOTAutograd does for
``torch.compile``, without a GPU, and print what the graph launches as JSON.

Run as a script in a fresh process (tests/test_ops.py does): the kernels must
be compiled Triton functions, not the interpreter's, so TRITON_INTERPRET must
be off when flashfuse is imported. Nothing is launched: the graph is printed
by the compiler hook and never run, and Triton is given a stand-in driver
that names a Hopper GPU, which is all the tracer asks of it (it compiles each
kernel to Triton IR to learn which arguments the kernel writes).

    python tests/trace_cuda_graph.py CASE[:dynamic] [CASE[:dynamic] ...]
        (CASE: causal, bool_mask, float_mask_dropout; ":dynamic": the sequence
        length is symbolic, as Dynamo makes it after a second length;
        ":dynamic_head": the head dim too, as after a second head dim)

Prints one JSON line per CASE, {"case": ..., "dynamic": ..., "graphs": [...],
"guards": [...]}: each graph's launches (see ``_describe``) and the guards
the trace put on the symbolic length. The cases share the process (and its
imports), each with its own fake tensors and shape environment.
"""

import contextlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from torch._dynamo.source import ConstantSource  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import flashfuse  # noqa: E402,F401
from flashfuse.kernels import backward  # noqa: E402


class _HopperDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


def _describe(gm) -> dict:
    """Each kernel launch in the graph (kernel name, the arguments it
    writes, and which node made each of those), the other ops, and the
    shapes of the graph's inputs."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    launches, ops, inputs = [], [], []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and hasattr(node.meta.get("val"), "shape"):
            inputs.append([str(size) for size in node.meta["val"].shape])
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            while not hasattr(kernel, "__name__") and hasattr(kernel, "fn"):
                kernel = kernel.fn
            kwargs = node.kwargs["kwargs"]
            written = {name: str(kwargs[name].target) for name in node.kwargs["tensors_to_clone"]}
            launches.append({"kernel": kernel.__name__, "written_from": written})
        else:
            ops.append(str(node.target))
    return {"launches": launches, "ops": ops, "inputs": inputs}


def _pretend_hopper() -> None:
    triton.runtime.driver.set_active(_HopperDriver())
    torch.cuda.device = lambda device: contextlib.nullcontext()  # no CUDA runtime here
    backward._max_shared_mem = lambda device: 227 * 1024


def trace(case: str, dynamic: bool, dynamic_head: bool = False) -> dict:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(_describe(gm))
        return gm

    dropout = 0.1 if case == "float_mask_dropout" else 0.0
    causal = case == "causal"

    def fwd_bwd(q, k, v, mask, grad_out, seed):
        seed = seed if dropout else None
        out, lse = torch.ops.flashfuse._attention_forward(
            q, k, v, mask, seed, dropout, 0.25, None, 0 if causal else None, False)
        dq, dk, dv, _ = torch.ops.flashfuse._attention_backward(
            grad_out, q, k, v, mask, seed, out, lse, dropout, 0.25, None, 0 if causal else None, False, False)
        return out, dq, dk, dv

    shape_env = ShapeEnv()
    n, d = 80, 32
    if dynamic:
        n = shape_env.create_symintnode(shape_env.create_symbol(80, ConstantSource("N")), hint=80)
    if dynamic_head:
        d = shape_env.create_symintnode(shape_env.create_symbol(32, ConstantSource("D")), hint=32)
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env):
        q, k, v, grad_out = (torch.randn(2, 4, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        if case == "bool_mask":
            mask = torch.ones(2, 1, 1, n, device="cuda", dtype=torch.bool)
        elif case == "float_mask_dropout":
            mask = torch.randn(2, 1, n, n, device="cuda", dtype=torch.bfloat16)
        else:
            mask = None
        seed = torch.zeros((), dtype=torch.int64, device="cuda")
        compiled = aot_function(fwd_bwd, fw_compiler=keep)
        try:
            compiled(q, k, v, mask, grad_out, seed)
        except RuntimeError as exc:
            # Running the traced graph needs CUDA; a failure before the graph
            # was kept is the test's business.
            if not graphs:
                raise
            print(f"not run: {str(exc).splitlines()[0]}", file=sys.stderr)
    return {"case": case, "dynamic": "head" if dynamic_head else dynamic, "graphs": graphs,
            "guards": [str(guard.expr) for guard in shape_env.guards]}


if __name__ == "__main__":
    _pretend_hopper()
    for spec in sys.argv[1:]:
        case, _, mode = spec.partition(":")
        print(json.dumps(trace(case, mode.startswith("dynamic"), mode == "dynamic_head")), flush=True)
