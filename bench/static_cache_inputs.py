"""What the compiled graphs of ``generate()`` with a static cache take as
inputs, per attention implementation.

With ``cache_implementation="static"`` transformers compiles the decoding
forward and CUDA graphs it; the cudagraph tree records a graph again when a
static input moves (bench/NOTES.md run 26: ffuse's graphs re-recorded more
often than SDPA's). This script compiles ``model.forward`` of
``bench_generate.py``'s model with a backend that only records each graph's
inputs, runs ``generate()`` twice per implementation, and prints every
graph's inputs: how many, which Dynamo treats as static addresses
(parameters, buffers, tensors marked static) and the shapes of the rest.
It runs on the CPU (``--smoke`` sizes; the kernels in Triton's interpreter)
or on a GPU.

    python bench/static_cache_inputs.py --smoke
"""

from __future__ import annotations

import common
import torch

import bench_generate


def graph_inputs(impl: str, cfg, device, dtype, prompt: int, new: int) -> list[list[tuple]]:
    """Each compiled graph's inputs, ``(name, shape or value, static kind
    or None)``, over two ``generate()`` calls of ``impl``."""
    from torch._dynamo.utils import get_static_address_type

    torch._dynamo.reset()
    model = bench_generate.build(cfg, dtype, device)
    graphs = []

    def record(gm, example_inputs):
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append([(n.name, tuple(x.shape) if isinstance(x, torch.Tensor) else x,
                        get_static_address_type(x) if isinstance(x, torch.Tensor) else None)
                       for n, x in zip(nodes, example_inputs)])
        return gm.forward

    model.forward = torch.compile(model.forward, backend=record, dynamic=False)
    ids = torch.randint(1, cfg.vocab_size, (1, prompt), device=device)
    for _ in range(2):
        bench_generate.generate(model, impl, ids, new, "static")
    return graphs


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--new", type=int, default=4)
    args = p.parse_args()
    device, _ = common.start(args)
    cfg = bench_generate.config(args.smoke, args.prompt + args.new + 8)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    info = common.env_info(device)
    print(f"{info['gpu']}, torch {info['torch_version']}, triton {info['triton_version']}, {info['date']}")
    for impl in ("sdpa", "ffuse"):
        graphs = graph_inputs(impl, cfg, device, dtype, args.prompt, args.new)
        print(f"== {impl}: {len(graphs)} graphs over two generate() calls")
        for i, inputs in enumerate(graphs):
            static = sum(kind is not None for _, _, kind in inputs)
            rest = [(name.removeprefix("l_kwargs_"), shape) for name, shape, kind in inputs if kind is None]
            print(f"  graph {i}: {len(inputs)} inputs, {static} static; the others: {rest}")


if __name__ == "__main__":
    main()
