"""PP=2 with NCCL on 2 GPUs (Triton kernels) against the 1-GPU model: 1F1B and zero-bubble (zbv) schedules on
Mamba-1, Mamba-2 and a hybrid. fp32 (no TF32), three AdamW steps: losses within 10x the fp32 bound of
tests/helpers.py (kernels reorder sums) and the first step's gradients within 10x GRAD_RTOL; bf16 autocast: the
losses within the bf16 bound."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import GRAD_RTOL, RTOL
from mamba_parallel.config import get_preset
from mamba_parallel.distributed import ParallelDims
from mamba_parallel.distributed.materialize import materialize
from mamba_parallel.distributed.parallelize import parallelize_pipeline
from mamba_parallel.distributed.pipeline import ZERO_BUBBLE_MIN_TORCH, PipelinePlan, pipeline_step
from mamba_parallel.distributed.state_dict import canonical_tensors
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.optim import build_optimizer

pytestmark = pytest.mark.gpu
# zero bubble where torch passes each output its own gradient in the weight pass (distributed/pipeline.py)
_ZB = "zbv" if torch.torch_version.TorchVersion(torch.__version__) >= ZERO_BUBBLE_MIN_TORCH else "interleaved-1f1b"
CASES = [("mamba-130m", 4, "1f1b"), ("mamba2-130m", 4, _ZB), ("tiny-hybrid", None, "1f1b")]
EMB, HEAD = "backbone.embedding.weight", "lm_head.weight"


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


def _worker(rank, world):
    dev = torch.device("cuda", rank)
    dims = ParallelDims(pp=2, world_size=world)
    dims.build_mesh("cuda")
    out = {}
    for preset, n_layer, schedule in CASES:
        config = get_preset(preset, n_layer=n_layer) if n_layer else get_preset(preset)
        for dtype in (None, torch.bfloat16):
            pm = parallelize_pipeline(MambaLMHeadModel(config, device="meta"), dims, PipelinePlan(2, schedule, 4),
                                      dev, materialize=lambda m: materialize(m, config, dev, 3))
            ref = MambaLMHeadModel(config, device="meta")
            materialize(ref, config, dev, 3)
            ref.tie_weights()
            opt, ref_opt = build_optimizer(pm, 1e-3, 0.1), build_optimizer(ref, 1e-3, 0.1)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, config.vocab_size, (4, 257), generator=g).to(dev)
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            losses, grad_err = [], None
            for step in range(3):
                with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                    loss = pipeline_step(pm, x, y)
                    ref_loss = ref(x, targets=y).loss
                ref_loss.backward()
                losses.append(abs(loss.item() - ref_loss.item()) / ref_loss.item())
                if step == 0 and dtype is None:
                    got = canonical_tensors({k: p.grad for k, p in pm.named_parameters()}, pm)
                    want = dict(ref.named_parameters())
                    grad_err = max(((v - want[EMB if k == HEAD and config.tie_embeddings else k].grad).norm()
                                    / want[EMB if k == HEAD and config.tie_embeddings else k].grad.norm()
                                    .clamp_min(1e-30)).item() for k, v in got.items())
                opt.step()
                opt.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
            out[(preset, "bf16" if dtype else "fp32")] = {"loss": max(losses), "grad": grad_err}
            del pm, ref, opt, ref_opt
            torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def results():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(2, init_file, tmp), nprocs=2, join=True, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.mark.parametrize("preset", [c[0] for c in CASES])
def test_pp2_nccl_matches_one_gpu(results, preset):
    for rank, res in enumerate(results):
        fp32, bf16 = res[(preset, "fp32")], res[(preset, "bf16")]
        assert fp32["loss"] <= 10 * RTOL[torch.float32], (rank, fp32)
        assert fp32["grad"] <= 10 * GRAD_RTOL[torch.float32], (rank, fp32)
        assert bf16["loss"] <= RTOL[torch.bfloat16], (rank, bf16)
