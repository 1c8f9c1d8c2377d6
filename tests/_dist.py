"""Test helpers: in-process gloo worlds for Megatron-Core on CPU.

``single_process_world()`` initializes a world of size 1 in the test process (once per process) and
Megatron's parallel_state at TP=1. ``run_spawned(fn, world_size, tp=..., pp=...)`` spawns a fresh
gloo world (TP = world_size unless given), applies the CPU patch in every worker, calls ``fn(rank, *args)`` and returns each
rank's (picklable) result, rank order. Spawns cost seconds each (every worker imports Megatron), so
tests do several checks per spawn.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def single_process_world(seed: int = 1234) -> None:
    """World size 1 on gloo, parallel_state at TP=1, CPU patch applied, model-parallel seed set."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    from megatron_tree.patches import megatron_cpu

    megatron_cpu.apply()
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    mp_random.model_parallel_cuda_manual_seed(seed)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn, args, tp: int, pp: int) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    from megatron_tree.patches import megatron_cpu

    result: Any
    try:
        megatron_cpu.apply()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        mp_random.model_parallel_cuda_manual_seed(1234)
        result = ("ok", fn(rank, *args))
    except BaseException:  # report the worker's traceback to the test process
        result = ("error", traceback.format_exc())
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_spawned(
    fn: Callable[..., Any], world_size: int, *args: Any, tp: int | None = None, pp: int = 1
) -> list[Any]:
    """Run ``fn(rank, *args)`` on a fresh gloo world; results by rank.

    Parallel layout: TP = ``tp`` (default: the whole world), PP = ``pp``, DP = the rest.
    """
    tp = world_size // pp if tp is None else tp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _worker,
            args=(world_size, free_port(), out_dir, fn, args, tp, pp),
            nprocs=world_size,
            join=True,
        )
        results = [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
    errors = [f"rank {r}:\n{res[1]}" for r, res in enumerate(results) if res[0] == "error"]
    if errors:
        raise RuntimeError("spawned worker failed\n" + "\n".join(errors))
    return [res[1] for res in results]
