"""TP=2 (+SP) with NCCL on 2 GPUs (Triton kernels) against the 1-GPU model. fp32: logits, loss and every gradient
within 10x the fp32 bounds of tests/helpers.py (matmul splits reorder sums). bf16 autocast: the tp error against
the fp32 model stays within a few times the 1-GPU bf16 error (tp_cases.bf16_failures)."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import GRAD_RTOL, RTOL
from tp_cases import CASES, batch, bf16_failures, bf16_parity, build, full, grads, rel_errs
from mamba_parallel import get_preset
from mamba_parallel.models import MambaLMHeadModel

pytestmark = pytest.mark.gpu
GPU_CASES = {**CASES, "mamba2_130m_2layers": None}


def _entry(rank, world, init_file, out_dir, fn):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        torch.save(fn(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _build(case):
    if case == "mamba2_130m_2layers":  # real widths: 24 heads of 64, d_state 128, chunk 256
        torch.manual_seed(0)
        return MambaLMHeadModel(get_preset("mamba2-130m", n_layer=2))
    return build(case)


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from mamba_parallel.distributed.tp_plan import apply_tensor_parallel

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    out = {}
    for case in GPU_CASES:
        ref = _build(case).cuda()
        ids, labels = (t.cuda() for t in batch(b=2, L=512))
        tp = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=True)
        logits = rel_errs({"x": full(tp(ids).logits).float()}, {"x": ref(ids).logits.float()})["x"]
        lt, lr = tp(ids, targets=labels).loss, ref(ids, targets=labels).loss
        lt.backward()
        lr.backward()
        out[case, "fp32"] = {"logits": logits, "loss": abs(lt.item() - lr.item()) / lr.item(),
                             "grads": rel_errs({k: v.cpu() for k, v in grads(tp).items()},
                                               {k: v.cpu() for k, v in grads(ref).items()})}
        out[case, "bf16"] = bf16_parity(lambda m: apply_tensor_parallel(m, mesh), _build(case).cuda(), ids,
                                        labels, "cuda")
    return out


@pytest.fixture(scope="module")
def results():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(2, os.path.join(tmp, "init"), tmp, _worker), nprocs=2, join=True,
                           start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_tp2_nccl_fp32_matches_one_gpu(results, case):
    fwd, bwd = 10 * RTOL[torch.float32], 10 * GRAD_RTOL[torch.float32]
    for r in range(2):
        res = results[r][case, "fp32"]
        assert res["logits"] <= fwd, f"rank {r} logits {res['logits']:.2e} > {fwd:.1e}"
        assert res["loss"] <= fwd, f"rank {r} loss {res['loss']:.2e} > {fwd:.1e}"
        bad = {k: v for k, v in res["grads"].items() if not v <= bwd}
        assert not bad, f"rank {r} gradients above {bwd:.1e}: {bad}"


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_tp2_nccl_bf16_error_is_bf16_noise(results, case):
    for r in range(2):
        res = results[r][case, "bf16"]
        assert res["logits"][0] <= RTOL[torch.bfloat16], f"rank {r} bf16 logits error {res['logits']}"
        bad = bf16_failures(res)
        assert not bad, f"rank {r} (tp err, 1-GPU err): {bad}"
