"""The divergence guard: a step whose loss or gradient norm is not finite stops the run before its update, and no
checkpoint is ever written of weights that are not finite or of a step whose loss exploded. The message names
the last checkpoint (all of them are finite) and how to resume from it with a lower learning rate."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

# A loss this many times that of a uniform guess over the vocabulary means the run diverged (a trained model is far
# below 1x; a fresh one starts at 1x).
EXPLODED = 2.0


@torch.no_grad()
def weights_finite(model: torch.nn.Module) -> bool:
    """Every parameter of every rank is finite (collective under torch.distributed)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    ok = torch.ones((), device=local[0].device if local else "cpu")
    for (dev, _), (group, _) in torch.utils._foreach_utils._group_tensors_by_device_and_dtype([local]).items():
        norms = torch._foreach_norm(group[0], 2)
        ok = ok * torch.isfinite(torch.stack(norms).sum()).to(ok.device, ok.dtype)
    if dist.is_initialized():
        if dist.get_backend() == "nccl" and ok.device.type == "cpu":  # CPU-offloaded weights: NCCL reduces on GPU
            ok = ok.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def exploded(loss: float, vocab_size: int) -> bool:
    return loss > EXPLODED * math.log(max(vocab_size, 2))


def resume_hint(out: str, last: tuple[int, str] | None, lr: float) -> str:
    if last is None:
        return (f"no checkpoint was written yet: start again with a lower learning rate (e.g. --lr {lr / 2:.3g}) "
                f"in a new --out")
    return (f"the last checkpoint, {last[1]} (step {last[0]}), is finite: resume from it with a lower learning "
            f"rate: mamba-parallel train --out {out} --resume --lr {lr / 2:.3g}")


def non_finite_message(step: int, loss: float, grad_norm: float, out: str, last, lr: float) -> str:
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    return (f"non-finite {what} at step {step} (loss {loss}, grad norm {grad_norm}): stopped before the optimizer "
            f"update; nothing was saved for this step. {resume_hint(out, last, lr)}")


def unsafe_to_save(model, loss: float, vocab_size: int) -> str | None:
    """Why the state of this step must not be checkpointed (collective), or None."""
    if not weights_finite(model):
        return "the weights are no longer finite after the update"
    if exploded(loss, vocab_size):
        return (f"the loss {loss:.4g} exploded (above {EXPLODED:g} x ln(vocab {vocab_size}) = "
                f"{EXPLODED * math.log(vocab_size):.4g})")
    return None


def not_saved_message(step: int, why: str, out: str, last, lr: float) -> str:
    return (f"step {step}: {why}: stopped without saving it. {resume_hint(out, last, lr)}")


def last_checkpoint(out: str) -> tuple[int, str] | None:
    from mamba_parallel.train.checkpoint import latest_checkpoint

    found = latest_checkpoint(out)
    return found if found and os.path.isdir(found[1]) else None
