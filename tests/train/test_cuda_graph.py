"""`--cuda-graph` on GPU: training steps replayed from one CUDA graph give the losses, gradient norms and parameter
updates of the same steps run eagerly (the trainer's loop): Mamba-2, Mamba-1 and a hybrid, fp32 (tight) and bf16
autocast (tests/helpers.py tolerances), with gradient accumulation, clipping that engages and an lr schedule that
changes every step; a non-finite step leaves the weights untouched; the trainer end to end (checkpoint + resume
under the graph); tensor parallel on 2 GPUs."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from helpers import assert_close
from mamba_parallel import get_preset
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.cuda_graph import GraphedTrainStep
from mamba_parallel.train.optim import build_optimizer, build_scheduler
from mamba_parallel.train.trainer import _grad_norm

pytestmark = pytest.mark.gpu

STEPS, ACCUM, BATCH, SEQ, CLIP = 4, 2, 2, 64, 0.25


def _model(preset: str, checkpointing: bool = False) -> MambaLMHeadModel:
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(preset), device="cuda")
    if checkpointing:  # as parallelize(activation_checkpointing=True)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.backbone.layers):
            model.backbone.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model


def _batches(steps: int = STEPS, accum: int = ACCUM, seed: int = 1, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (accum, BATCH, SEQ + 1), generator=g)
        out.append((ids[..., :-1].contiguous().to(device), ids[..., 1:].contiguous().to(device)))
    return out


def _optim(model):
    opt = build_optimizer(model, 3e-3, 0.1, fused=True)
    return opt, build_scheduler(opt, warmup=2, total=STEPS, min_ratio=0.1)  # lr: x0.5, x1, then cosine


def _eager(model, batches, dtype):
    """The trainer's eager step: micro-batch forward/backward, _grad_norm clip, fused AdamW, schedule."""
    opt, sched = _optim(model)
    losses, norms = [], []
    for inputs, labels in batches:
        total = torch.zeros((), device="cuda")
        for i in range(inputs.shape[0]):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(inputs[i], targets=labels[i]).loss
            (loss / inputs.shape[0]).backward()
            total += loss.detach().float()
        norms.append(_grad_norm(model, CLIP).float())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / inputs.shape[0])
    return torch.stack(losses), torch.stack(norms)


def _graphed(model, batches, dtype):
    opt, sched = _optim(model)
    step = GraphedTrainStep(model, opt, grad_accum=batches[0][0].shape[0], grad_clip=CLIP,
                            autocast_dtype=dtype if dtype == torch.bfloat16 else None)
    losses, norms = [], []
    for inputs, labels in batches:
        loss, norm = step(inputs, labels)
        losses.append(loss.clone())
        norms.append(norm.clone())
        sched.step()
    assert step.graph is not None and not hasattr(opt, "found_inf")
    return torch.stack(losses), torch.stack(norms)


def _updates(model, start: dict) -> torch.Tensor:
    return torch.cat([(p.detach() - start[n]).flatten().float() for n, p in model.named_parameters()])


@pytest.mark.parametrize("preset, dtype, checkpointing", [
    ("tiny-mamba2", torch.float32, False), ("tiny-mamba2", torch.bfloat16, False),
    ("tiny-mamba", torch.float32, False), ("tiny-mamba", torch.bfloat16, False),
    ("tiny-hybrid", torch.float32, False), ("tiny-mamba2", torch.bfloat16, True),
])
def test_graphed_steps_match_eager(preset, dtype, checkpointing):
    batches = _batches()
    eager_model = _model(preset, checkpointing)
    graph_model = copy.deepcopy(eager_model)
    start = {n: p.detach().clone() for n, p in eager_model.named_parameters()}
    e_loss, e_norm = _eager(eager_model, batches, dtype)
    g_loss, g_norm = _graphed(graph_model, batches, dtype)
    assert (e_norm > CLIP).any(), f"clipping never engaged (norms {e_norm.tolist()}): the test would not see it"
    assert_close(g_loss, e_loss, dtype, name="losses")
    assert_close(g_norm, e_norm, dtype, grad=True, name="grad norms")
    e_upd, g_upd = _updates(eager_model, start), _updates(graph_model, start)
    assert e_upd.norm() > 0
    assert_close(g_upd, e_upd, dtype, grad=True, name="parameter updates after 4 steps")


def test_non_finite_step_skips_update_and_shapes_are_fixed():
    model = _model("tiny-mamba2")
    opt, _ = _optim(model)
    step = GraphedTrainStep(model, opt, grad_accum=ACCUM, grad_clip=1.0)
    batches = _batches(steps=2)
    loss, norm = step(*batches[0])
    assert torch.isfinite(loss) and torch.isfinite(norm)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps_before = [s["step"].clone() for s in opt.state.values()]
    with torch.no_grad():
        model.backbone.norm_f.weight[0] = float("nan")
    loss, norm = step(*batches[1])
    assert not (torch.isfinite(loss) and torch.isfinite(norm))
    for n, p in model.named_parameters():
        if n != "backbone.norm_f.weight":
            assert torch.equal(p, before[n]), f"{n} was updated by a non-finite step"
    assert all(torch.equal(s["step"], b) for s, b in zip(opt.state.values(), steps_before))
    inputs, labels = batches[0]
    with pytest.raises(ValueError, match="captured batch shape"):
        step(inputs[..., :32], labels[..., :32])


def test_trainer_cuda_graph_matches_eager_with_resume(tmp_path):
    """`train --cuda-graph`: 4 steps, a checkpoint, then `--resume` to 8 steps; the losses equal the eager run's.
    (warmup 3 and min_lr_ratio 1: the lr schedule does not depend on --steps, so the resumed run continues it.)"""
    from mamba_parallel.train.config import resolve_config
    from mamba_parallel.train.trainer import train

    text = tmp_path / "corpus.txt"
    g = torch.Generator().manual_seed(0)
    words = ["def", "class", "return", "import", "self", "value", "for", "in", "if", "else", "(", ")", ":", "\n"]
    text.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (6000,), generator=g).tolist()))
    common = dict(preset="tiny-mamba2", data=str(text), seq_len=SEQ, batch_size=BATCH, grad_accum=ACCUM,
                  warmup=3, min_lr_ratio=1.0, grad_clip=CLIP, device="cuda", dtype="fp32", eval_every=0,
                  eval_batches=1, save_every=0, sample_tokens=0, progress=False, log_every=1)
    # Documents kept apart need a host sync a graph cannot hold: the graphed run packs them as one stream, as here.
    eager = train(resolve_config(out=str(tmp_path / "eager"), steps=8, doc_boundaries=False, **common))["losses"]
    first = train(resolve_config(out=str(tmp_path / "graph"), steps=4, cuda_graph=True, **common))
    assert any("--cuda-graph: warm-up + capture" in line for line in first["log"])
    assert any("--doc-boundaries: the kernels' document packing" in line for line in first["log"])
    rest = train(resolve_config(out=str(tmp_path / "graph"), steps=8, cuda_graph=True, resume=True, **common))
    graphed = {**first["losses"], **rest["losses"]}
    assert sorted(graphed) == sorted(eager) == list(range(1, 9))
    e = torch.tensor([eager[k] for k in sorted(eager)])
    assert_close(torch.tensor([graphed[k] for k in sorted(eager)]), e, torch.float32, grad=True, name="losses")
    assert e[-1] < e[0]


def test_bench_train_cuda_graph(tmp_path):
    """`bench train --cuda-graph --grad-clip 0` (no gradient norm in the graph) runs and records both flags."""
    import json
    import math

    from mamba_parallel.bench import bench_train

    path = tmp_path / "train.json"
    assert bench_train.main(["--preset", "tiny-mamba", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
                             "--steps", "3", "--warmup-steps", "1", "--cuda-graph", "--grad-clip", "0",
                             "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["cuda_graph"] is True and rec["grad_clip"] == 0.0
    assert math.isfinite(rec["final_loss"]) and rec["step_ms_median"] > 0 and rec["peak_mem_gib"] > 0


# ---- tensor parallel, 2 GPUs ---------------------------------------------------------------------------------------
def _tp_entry(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        torch.save(_tp_worker(world), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _tp_worker(world):
    from torch.distributed.device_mesh import init_device_mesh

    from mamba_parallel.distributed.state_dict import canonical_tensors
    from mamba_parallel.distributed.tp_plan import apply_tensor_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    out = {}
    for preset in ("tiny-mamba2", "tiny-mamba"):
        base = _model(preset)
        batches = _batches(steps=3)
        runs = {}
        for mode, run in (("eager", _eager), ("graph", _graphed)):
            model = apply_tensor_parallel(copy.deepcopy(base), mesh, sequence_parallel=True)
            losses, norms = run(model, batches, torch.float32)
            named = {n: p.detach() for n, p in model.named_parameters()}
            params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()
                      for k, v in canonical_tensors(named, model).items()}
            runs[mode] = (losses.cpu(), norms.cpu(), params)
        out[preset] = runs, {k: v.cpu() for k, v in base.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def tp_results():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_tp_entry, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True,
                           start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba"])
def test_tp2_graphed_steps_match_eager(tp_results, preset):
    """Each rank's TP=2 model: 3 graphed steps (NCCL collectives captured) = 3 eager steps, fp32."""
    for rank, res in enumerate(tp_results):
        runs, start = res[preset]
        (e_loss, e_norm, e_par), (g_loss, g_norm, g_par) = runs["eager"], runs["graph"]
        assert_close(g_loss, e_loss, name=f"rank {rank} losses")
        assert_close(g_norm, e_norm, grad=True, name=f"rank {rank} grad norms")
        assert sorted(g_par) == sorted(e_par)
        e_upd = torch.cat([(e_par[k] - start[k]).flatten() for k in sorted(e_par)])
        g_upd = torch.cat([(g_par[k] - start[k]).flatten() for k in sorted(e_par)])
        assert e_upd.norm() > 0
        assert_close(g_upd, e_upd, grad=True, name=f"rank {rank} parameter updates")
