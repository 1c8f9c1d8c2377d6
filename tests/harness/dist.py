"""Distributed worlds for tests, demos and benchmarks: one harness, gloo on CPU, no free-port race.

``single_process_world()`` initializes a world of size 1 in the calling process (once) and
Megatron's parallel_state at TP=1. ``run_spawned(fn, world_size, ...)`` starts a fresh world whose
ranks meet through a file in a private temporary directory (no TCP port to race for), optionally
sets up Megatron's parallel_state with the CPU runtime patch, calls ``fn(rank, *args)`` on every
rank and returns each rank's (picklable) result, in rank order; a worker's traceback is re-raised
in the caller.

The ranks are forked from multiprocessing's fork server, one process per session that imports
torch, Megatron-Core and the model harness once (``PRELOAD``) and holds no threads, process group
or CUDA context: a freshly spawned rank imports them itself, 6.7 s for a 2-rank Megatron world and
18 s for a 4-rank one on a 2-core machine, against 0.5-0.8 s forked. Each rank takes the caller's
environment variables as they are at the call (as a spawned one would); modules imported by the
server read theirs at the server's start.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server; a module missing on a stack is skipped by multiprocessing.
PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "transformers",
    "megatron_tree",
    "megatron_tree.patches.megatron_cpu",
    "harness.dist",
    "harness.models",
)


# Imported by the fork server too where the stack has them (key: the package that must be
# installed): the framework stacks' heavy third-party imports, patch-free (verl's engine pulls in
# pandas, peft, ray, datasets, omegaconf, ...), and Megatron-Bridge, imported after megatron_tree's
# own module as a user's code does (it installs the transformer-engine import patch). A rank of
# the verl + Megatron-Bridge stack otherwise spends ~2.5 s importing them, 0.4 s with them loaded;
# a Megatron-Bridge rank ~2.2 s on Megatron-Bridge alone. Framework code with import-time side
# effects (verl's platform pick, AReaL's stand-ins) stays in the ranks.
STACK_PRELOAD = {
    "pandas": ("pandas",),
    "pyarrow": ("pyarrow",),
    "datasets": ("datasets",),
    "peft": ("peft",),
    "accelerate": ("accelerate",),
    "ray": ("ray",),
    "tensordict": ("tensordict",),
    "omegaconf": ("omegaconf",),
    "mbridge": ("mbridge",),
    "megatron.bridge": (
        "megatron_tree.bridges.megatron_bridge",
        "megatron.bridge.models.conversion.auto_bridge",
        "megatron.bridge.models.gpt_provider",
    ),
}


def installed(name: str) -> bool:
    """Whether module ``name`` can be imported here (False where a parent package is missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _fork_server_context():
    ctx = mp.get_context("forkserver")
    preload = list(PRELOAD)
    for package, modules in STACK_PRELOAD.items():
        if installed(package):
            preload += modules
    ctx.set_forkserver_preload(preload)  # read when the server starts, the first time only
    return ctx


def _file_init_method(directory: str) -> str:
    return "file://" + os.path.join(directory, "rendezvous")


def single_process_world(seed: int = 1234) -> None:
    """World size 1 on gloo, parallel_state at TP=1, CPU patch applied, model-parallel seed set."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    from megatron_tree.patches import megatron_cpu

    megatron_cpu.apply()
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=_file_init_method(tempfile.mkdtemp()), rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    mp_random.model_parallel_cuda_manual_seed(seed)


def reinitialize_model_parallel(*, tp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """Inside a spawned world: Megatron's parallel_state again at TP=``tp`` x CP=``cp`` (the rest
    data parallel), CPU patch applied, model-parallel seed set; e.g. an unpacked reference at CP=1,
    then the tree model at CP=2, in one worker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    from megatron_tree.patches import megatron_cpu

    megatron_cpu.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    mp_random.model_parallel_cuda_manual_seed(seed)


def _worker(
    rank: int, world_size: int, directory: str, fn, args, layout: dict | None, environ: dict
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group(
            "gloo", init_method=_file_init_method(directory), rank=rank, world_size=world_size
        )
        if layout is not None:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import random as mp_random

            from megatron_tree.patches import megatron_cpu

            megatron_cpu.apply()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout["tp"],
                pipeline_model_parallel_size=layout["pp"],
                context_parallel_size=layout["cp"],
                virtual_pipeline_model_parallel_size=layout["vpp"],
                expert_model_parallel_size=layout["ep"],
                expert_tensor_parallel_size=layout["etp"],
            )
            mp_random.model_parallel_cuda_manual_seed(1234)
        result = ("ok", fn(rank, *args))
    except BaseException:  # report the worker's traceback to the caller
        result = ("error", traceback.format_exc())
    finally:
        torch.save(result, os.path.join(directory, f"rank{rank}.pt"))
        if layout is not None:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_spawned(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int | None = None,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    megatron: bool = True,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on a fresh gloo world of ``world_size`` processes; results by rank.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        tp, pp, cp, vpp: Megatron layout: TP = ``tp`` (default: the whole world / (``pp`` x
            ``cp``)), PP = ``pp``, CP = ``cp``, virtual pipeline size ``vpp``, DP = the rest.
        ep, etp: expert parallel size ``ep`` and expert tensor parallel size ``etp`` (default: the
            TP size), carved by Megatron out of the data x context x tensor parallel ranks
            (``ep x etp x pp`` must divide ``world_size``).
        megatron: set up Megatron's parallel_state (with the CPU runtime patch and the
        model-parallel
            seed 1234); False gives a plain gloo world (``dist.group.WORLD``).
    """
    layout = None
    if megatron:
        layout = {
            "tp": world_size // (pp * cp) if tp is None else tp,
            "pp": pp,
            "cp": cp,
            "vpp": vpp,
            "ep": ep,
            "etp": etp,
        }
    with tempfile.TemporaryDirectory() as directory:
        _fork_server_context()
        mp.start_processes(
            _worker,
            args=(world_size, directory, fn, args, layout, dict(os.environ)),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
        results = [
            torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
    errors = [f"rank {r}:\n{res[1]}" for r, res in enumerate(results) if res[0] == "error"]
    if errors:
        raise RuntimeError("spawned worker failed\n" + "\n".join(errors))
    return [res[1] for res in results]
