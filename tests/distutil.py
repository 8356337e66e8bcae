"""Helpers for the multi-process tests: spawn ``world`` CPU processes joined
by a gloo process group, and collect what each rank returns.

Each child runs ``fn(rank, world, *args)`` and its return value is pickled
into ``out_dir``; the parent gets the list of results by rank. Children use
the blockwise CPU path unless ``interpret`` is set (Triton's interpreter is
then switched on before flashfuse is imported)."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, out_dir, interpret, fn, args):
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    os.environ.setdefault("FLASHFUSE_AUTOTUNE", "0")
    # Two shared cores: one thread per rank, so ranks do not fight over them.
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world: int, out_dir, *args, interpret: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; return
    the results by rank, raising with the child's traceback on failure."""
    out_dir = str(out_dir)
    mp.spawn(_child, args=(world, free_port(), out_dir, interpret, fn, args), nprocs=world, join=True)
    results = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results.append(value)
    return results
