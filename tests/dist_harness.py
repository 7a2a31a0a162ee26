"""Run a function on N CPU ranks (gloo) in spawned processes and collect what each rank returns.

Spawn once per test module (a module-scoped fixture that runs every check of the module in one go): starting
processes and a process group costs seconds on the 2-core CI machine.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import fast_interpreter

    fast_interpreter.install()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears down while a peer still has collectives in flight
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown: gloo / profiler threads still being destroyed there can abort the process
    # ("terminate called without an active exception") after the work is done and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the list of their results.

    ``fn`` must be a module-level function (it is pickled) and return something ``torch.save`` can store.
    A failure on any rank raises here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world_size, init_file, tmp, fn, args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
