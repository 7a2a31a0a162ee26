"""Data parallel (FSDP2, DDP) and context parallel (cp = 2) with NCCL on 2 GPUs (Triton kernels) against one GPU.

Every layout is built as the trainer builds it (meta device, ``parallelize``, block-by-block ``materialize``) from
the same seed; the global batch (4 sequences of 256) is split over the data-parallel ranks (FSDP2 / DDP: 2 rows
each) or over the sequence (cp: each rank the same 4 rows, its half of every sequence). fp32 without TF32, three
AdamW steps: the global loss of every step within 10x the fp32 bound of tests/helpers.py (kernels reorder sums),
the first step's gradients and the final weights within 10x GRAD_RTOL. Mamba-1, Mamba-2 (real widths, 2 layers)
and a hybrid (attention + MLP).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import GRAD_RTOL, RTOL, rel_err
from mamba_parallel.config import get_preset
from mamba_parallel.distributed import ParallelDims
from mamba_parallel.distributed.materialize import materialize
from mamba_parallel.distributed.parallelize import parallelize
from mamba_parallel.distributed.state_dict import canonical_tensors
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.optim import build_optimizer

pytestmark = pytest.mark.gpu
PRESETS = {"mamba1": ("mamba-130m", 2), "mamba2": ("mamba2-130m", 2), "hybrid": ("tiny-hybrid", None)}
LAYOUTS = ("fsdp", "ddp", "cp")
STEPS, LR, SEED, B, L = 3, 1e-3, 3, 4, 256


def _entry(rank, world, init_file, out_dir):
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        torch.save(_worker(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _config(name):
    preset, n_layer = PRESETS[name]
    return get_preset(preset, n_layer=n_layer) if n_layer else get_preset(preset)


def _batch(config, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, L + 1), generator=g).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _full(tensors: dict, model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
            for k, v in canonical_tensors(tensors, model).items()}


def _train(model, x, y, reduce_group=None, world=1):
    """STEPS AdamW steps -> (global loss per step, first step's gradients, final weights) by canonical name."""
    opt = build_optimizer(model, LR, 0.1)
    inner = getattr(model, "module", model)
    losses, first = [], None
    for step in range(STEPS):
        loss = model(x, targets=y).loss
        loss.backward()
        if step == 0:
            first = _full({n: p.grad for n, p in inner.named_parameters()}, inner)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        if reduce_group is not None:
            dist.all_reduce(t, group=reduce_group)
            t /= world
        losses.append(t.item())
    return losses, first, _full({n: p for n, p in inner.named_parameters()}, inner)


def _worker(rank, world):
    dev = torch.device("cuda", rank)
    out = {}
    for name in PRESETS:
        config = _config(name)
        x, y = _batch(config, dev)
        for layout in LAYOUTS:
            if layout == "ddp":
                dims = ParallelDims(dp_replicate=world, dp_shard=1, world_size=world)
            elif layout == "cp":
                dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
            else:
                dims = ParallelDims(dp_shard=-1, world_size=world)
            dims.build_mesh("cuda")
            model = parallelize(MambaLMHeadModel(config, device="meta"), dims,
                                dp_mode="ddp" if layout == "ddp" else "fsdp",
                                materialize=lambda m: materialize(m, config, dev, SEED))
            if layout == "cp":
                n = L // world
                xs, ys = x[:, rank * n:(rank + 1) * n], y[:, rank * n:(rank + 1) * n]
            else:
                rows = B // world
                xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
            out[name, layout] = _train(model, xs, ys, dist.group.WORLD, world)
            del model
            torch.cuda.empty_cache()
    return out


def _reference():
    """One GPU, the same seed and the whole batch."""
    out = {}
    for name in PRESETS:
        config = _config(name)
        model = MambaLMHeadModel(config, device="meta")
        materialize(model, config, "cuda", SEED)
        model.tie_weights()
        out[name] = _train(model, *_batch(config, "cuda"))
    return out


@pytest.fixture(scope="module")
def results():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True,
                           start_method="spawn")
        two = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    allow = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        one = _reference()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = allow
    return two, one


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(PRESETS))
def test_nccl_layout_matches_one_gpu(results, name, layout):
    two, one = results
    ref_losses, ref_grads, ref_params = one[name]
    for rank in range(2):
        losses, grads, params = two[rank][name, layout]
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel <= 10 * RTOL[torch.float32], f"rank {rank} losses {losses} vs one GPU {ref_losses}"
        assert sorted(grads) == sorted(ref_grads) and sorted(params) == sorted(ref_params)
        bad = {k: e for k in ref_grads if (e := rel_err(grads[k], ref_grads[k])) > 10 * GRAD_RTOL[torch.float32]}
        assert not bad, f"rank {rank} first-step gradients: {bad}"
        bad = {k: e for k in ref_params if (e := rel_err(params[k], ref_params[k])) > 10 * GRAD_RTOL[torch.float32]}
        assert not bad, f"rank {rank} weights after {STEPS} steps: {bad}"
