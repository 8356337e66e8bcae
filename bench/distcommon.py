"""Distributed start-up shared by the multi-GPU benchmarks
(``bench_context_parallel.py``, ``bench_data_parallel.py``): the process
group from torchrun's environment, or a world of one for a plain ``python``
run (``--smoke`` on the CPU over gloo), and this rank's device."""

from __future__ import annotations

import os
import socket

import common
import torch
import torch.distributed as dist


def init_group(device_type: str) -> None:
    """torchrun's environment, or a world of one (a plain ``python`` run)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")


def start(args) -> tuple[torch.device, int, int]:
    """The process group and this rank's device: ``(device, world, rank)``
    (NCCL and the rank's GPU, or gloo on the CPU for ``--smoke``)."""
    common.quiet_warnings()
    common.interrupt_on_sigterm()
    device_type = (args.device or ("cpu" if args.smoke else "cuda")).split(":")[0]
    init_group(device_type)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device()), world, rank
    return common.pick_device(args), world, rank
