"""`--cuda-graph` on CPU: the flag's validation errors (train config, launch layout, trainer, bench_train), and the
pieces of GraphedTrainStep that need no GPU: the lr tensors the schedule fills in place, and the undo of warm-up
steps. The captured step itself is tested on GPU in test_cuda_graph.py."""

from __future__ import annotations

import copy

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.bench import bench_train
from mamba_parallel.config import ConfigError
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.config import MACHINE_FIELDS, resolve_config
from mamba_parallel.train.cuda_graph import GraphedTrainStep, OptimizerSnapshot, check_graph_layout, \
    install_tensor_lrs
from mamba_parallel.train.optim import build_optimizer, build_scheduler, restart_schedule


# ---- validation ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(device="cpu"), "--cuda-graph: needs a CUDA device, got --device cpu"),
    (dict(cp=2, seq_len=64), r"--cuda-graph: does not support context parallelism \(--cp 2\)"),
])
def test_config_refuses(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        resolve_config(cuda_graph=True, out=str(tmp_path), **overrides)


def test_config_accepts_and_is_a_machine_setting(tmp_path):
    cfg = resolve_config(cuda_graph=True, device="cuda", tp=2, out=str(tmp_path))
    assert cfg.cuda_graph and "cuda_graph = true" in cfg.to_toml()
    assert "cuda_graph" in MACHINE_FIELDS  # `--resume` takes it from the flags of now, not from config.toml
    assert resolve_config(out=str(tmp_path)).cuda_graph is False


@pytest.mark.parametrize("device, dp, cp, mode, message", [
    ("cpu", 1, 1, "fsdp", "--cuda-graph needs a CUDA device; this run is on cpu"),
    ("cuda", 2, 1, "fsdp", "data parallel over 2 ranks \\(--dp-mode fsdp\\)"),
    ("cuda", 4, 1, "ddp", "data parallel over 4 ranks \\(--dp-mode ddp\\)"),
    ("cuda", 1, 2, "fsdp", "--cuda-graph does not support context parallelism \\(--cp 2\\)"),
])
def test_layout_refused(device, dp, cp, mode, message):
    with pytest.raises(ConfigError, match=message):
        check_graph_layout(torch.device(device), dp, cp, mode)


def test_layout_accepted():
    check_graph_layout(torch.device("cuda", 0), dp=1, cp=1)  # one GPU, or tp ranks only: no error


def test_train_cli_refuses_cpu(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--cuda-graph", "--device", "cpu", "--out", str(out), "--no-progress"]) == 2
    assert "--cuda-graph: needs a CUDA device" in capsys.readouterr().err
    if not torch.cuda.is_available():  # no --device: the run would be on cpu; refused before preparing data
        assert cli.main(["train", "--cuda-graph", "--out", str(out), "--no-progress"]) == 2
        assert "--cuda-graph needs a CUDA device; this run is on cpu" in capsys.readouterr().err
        assert not (out / "data").exists()


def test_graph_step_refuses_cpu_model():
    model = MambaLMHeadModel(resolve_config(preset="tiny-mamba2").model_config())
    opt = build_optimizer(model, 1e-3, 0.1, fused=False)
    with pytest.raises(ConfigError, match="--cuda-graph needs a CUDA device"):
        GraphedTrainStep(model, opt)
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        GraphedTrainStep(model, opt, grad_accum=0)


def test_bench_flags(capsys):
    a = bench_train.build_parser().parse_args([])
    assert a.cuda_graph is False and a.grad_clip == 1.0
    a = bench_train.build_parser().parse_args(["--cuda-graph", "--grad-clip", "0"])
    assert a.cuda_graph and a.grad_clip == 0.0
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit):
            bench_train.build_parser().parse_args(["--grad-clip", bad])
        assert "--grad-clip" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--cuda-graph needs a CUDA device"):
        bench_train.main(["--cuda-graph", "--device", "cpu", "--preset", "tiny-mamba2"])


def test_bench_records_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    path = tmp_path / "train.json"
    assert bench_train.main(["--preset", "tiny-mamba2", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                             "--steps", "1", "--warmup-steps", "0", "--dtype", "fp32", "--grad-clip", "0",
                             "--json", str(path)]) == 0
    import json
    rec = json.loads(path.read_text())
    assert rec["cuda_graph"] is False and rec["grad_clip"] == 0.0 and rec["final_loss"] > 0


# ---- the lr tensors ------------------------------------------------------------------------------------------------
def test_tensor_lrs_follow_schedule_and_floats():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, 1e-2, 0.1, fused=False)
    sched = build_scheduler(opt, warmup=2, total=6, min_ratio=0.1)
    lrs = install_tensor_lrs(opt, torch.device("cpu"))
    assert len(lrs) == len(opt.param_groups) == 2
    assert all(g["lr"] is t and t.dtype == torch.float32 and t.dim() == 0 for g, t in zip(opt.param_groups, lrs))
    assert lrs[0].item() == pytest.approx(5e-3)  # warmup step 0: lr x 1/2
    opt.step()  # no gradients: nothing changes; keeps the scheduler's order check quiet
    sched.step()
    groups_lr = [g["lr"] for g in opt.param_groups]
    lrs = install_tensor_lrs(opt, torch.device("cpu"), lrs)  # the scheduler filled them in place (or set floats)
    assert all(g["lr"] is t for g, t in zip(opt.param_groups, lrs))
    assert lrs[1].item() == pytest.approx(1e-2) and float(groups_lr[0]) == pytest.approx(1e-2)
    restart_schedule(opt, sched, 4e-2)  # a resume sets floats: copied into the same tensors
    same = install_tensor_lrs(opt, torch.device("cpu"), lrs)
    assert same[0] is lrs[0] and lrs[0].item() == pytest.approx(4e-2)


# ---- undoing warm-up steps -----------------------------------------------------------------------------------------
def _step(model, opt, ids):
    opt.zero_grad(set_to_none=True)
    model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()
    opt.step()


@pytest.mark.parametrize("resumed", [False, True])
def test_snapshot_undoes_warmup(resumed, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    torch.manual_seed(0)
    model = MambaLMHeadModel(resolve_config(preset="tiny-mamba2").model_config())
    opt = build_optimizer(model, 1e-2, 0.1, fused=False)
    ids = torch.randint(0, 256, (2, 17))
    if resumed:  # an optimizer that already has state (a resumed run) gets it back, not zeros
        _step(model, opt, ids)
    ref_model = copy.deepcopy(model)
    ref_opt = build_optimizer(ref_model, 1e-2, 0.1, fused=False)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # own tensors, not shared ones
    params = list(model.parameters())
    storages = [p.data_ptr() for p in params]
    snap = OptimizerSnapshot(params, opt)
    for _ in range(2):
        _step(model, opt, ids)
    assert not torch.equal(params[0], next(ref_model.parameters()))
    snap.restore()
    assert [p.data_ptr() for p in params] == storages  # restored in place (a graph may point at them)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    # the next step equals the reference's next step: optimizer state (moments, step count) is as before
    _step(model, opt, ids)
    _step(ref_model, ref_opt, ids)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
