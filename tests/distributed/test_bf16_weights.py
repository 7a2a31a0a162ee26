"""--param-dtype bf16's optimizer (train/bf16_adamw.py): torch AdamW's result on fp32 weights, fp32 moments on bf16
weights, unbiased stochastic rounding, torch AdamW's state keys; and the batch resolution of --global-batch-size."""

import pytest
import torch

from mamba_parallel.config import ConfigError
from mamba_parallel.train.batching import resolve_micro_steps
from mamba_parallel.train.bf16_adamw import AdamWFp32State, stochastic_round_
from mamba_parallel.train.config import resolve_config


def _pair(dtype):
    torch.manual_seed(0)
    w = torch.randn(64, 32)
    return torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone().to(dtype))


def test_fp32_weights_get_torch_adamw_result():
    ref, mine = _pair(torch.float32)
    o_ref = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    o_mine = AdamWFp32State([mine], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(64, 32)
        ref.grad, mine.grad = g.clone(), g.clone()
        o_ref.step()
        o_mine.step()
    assert torch.allclose(ref, mine, rtol=1e-6, atol=1e-7)
    assert set(o_mine.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bf16_weights_keep_fp32_moments_and_small_updates():
    # 50 updates of ~1e-4 on weights of 1.0: each far below half a bf16 step (2^-9), so rounding to nearest keeps
    # 1.0 forever; stochastic rounding lands, on average, where fp32 does.
    def run(opt_cls, dtype):
        p = torch.nn.Parameter(torch.ones(4096, dtype=dtype))
        opt = opt_cls([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        return p, opt

    ref, _ = run(torch.optim.AdamW, torch.float32)
    nearest, _ = run(torch.optim.AdamW, torch.bfloat16)
    mine, opt = run(AdamWFp32State, torch.bfloat16)
    assert mine.dtype == torch.bfloat16 and opt.state[mine]["exp_avg"].dtype == torch.float32
    assert torch.all(nearest == 1.0)
    assert abs(mine.float().mean().item() - ref.mean().item()) < 5e-4, (mine.float().mean(), ref.mean())


def test_host_update_in_slices_matches_torch_adamw_and_is_reproducible(monkeypatch):
    from mamba_parallel.train import bf16_adamw

    monkeypatch.setattr(bf16_adamw, "CPU_SLICE", 300)  # several slices and a short last one
    monkeypatch.setattr(bf16_adamw, "NOISE_POOL", 1000)  # windows overlap and wrap nothing
    ref, mine = _pair(torch.float32)
    o_ref = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    o_mine = AdamWFp32State([mine], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        ref.grad = torch.randn(64, 32)
        mine.grad = ref.grad.clone()
        o_ref.step()
        o_mine.step()
    assert torch.allclose(ref, mine, rtol=1e-6, atol=1e-7)

    def bf16_run(seed):
        torch.manual_seed(seed)
        noise = bf16_adamw._HostNoise(size=1000, span=300)
        torch.manual_seed(1)
        p = torch.nn.Parameter(torch.randn(64, 32).bfloat16())
        opt = AdamWFp32State([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        opt._noise = noise
        for _ in range(3):
            p.grad = torch.randn(64, 32).bfloat16()
            opt.step()
        st = opt.state[p]
        return p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()

    one, again, other = bf16_run(7), bf16_run(7), bf16_run(8)
    for a, b in zip(one, again):  # the pool and its window offsets follow torch's seed: the same bits
        assert torch.equal(a, b)
    assert not torch.equal(one[0], other[0])  # another seed rounds some weights the other way
    w, m, v = one
    torch.manual_seed(1)
    p = torch.randn(64, 32).bfloat16()
    m_ref, v_ref = torch.zeros(64, 32), torch.zeros(64, 32)
    for _ in range(3):
        g = torch.randn(64, 32).bfloat16().float()
        m_ref.lerp_(g, 0.1)
        v_ref.mul_(0.95).addcmul_(g, g, value=0.05)
    # the compiled update forms the moments with other roundings: within a few fp32 ulps of O(1) values
    assert torch.allclose(m, m_ref, rtol=1e-6, atol=5e-7) and torch.allclose(v, v_ref, rtol=1e-6, atol=5e-7)


def test_compiled_host_update_matches_the_uncompiled_one(monkeypatch):
    """CPU offload's compiled update (one pass per slice) against the fused-op path: the same moments, and the same
    bf16 weights but where the two fp32 results straddle a rounding threshold."""
    from mamba_parallel.train import bf16_adamw

    monkeypatch.setattr(bf16_adamw, "CPU_SLICE", 3000)  # several slices and a short last one
    assert bf16_adamw._compiled_host_update() is not None  # CI has a C++ compiler: the compiled path is tested

    def run(compile_host):
        torch.manual_seed(0)
        p = torch.nn.Parameter((torch.randn(10_000) * 0.02).bfloat16())
        opt = AdamWFp32State([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, compile_host=compile_host)
        for _ in range(3):
            p.grad = (torch.randn(10_000) * 1e-2).bfloat16()
            opt.step()
        return p.detach().float(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]

    (w1, m1, v1), (w0, m0, v0) = run(True), run(False)
    assert torch.allclose(m1, m0, rtol=1e-6, atol=1e-9) and torch.allclose(v1, v0, rtol=1e-5, atol=1e-12)
    differ = w1 != w0
    assert differ.float().mean() < 1e-3, differ.sum()
    assert torch.all((w1 - w0)[differ].abs() <= w0[differ].abs() * 2**-7)  # one bf16 step at most


def test_host_noise_windows_are_uniform_and_change_with_the_step():
    from mamba_parallel.train.bf16_adamw import _HostNoise

    torch.manual_seed(0)
    noise = _HostNoise(size=1 << 16, span=1 << 12)
    a, b = noise.window(1 << 12, 1, 0, 0), noise.window(1 << 12, 2, 0, 0)
    assert a.dtype == torch.int32 and int(a.min()) >= 0 and int(a.max()) < 1 << 16
    assert not torch.equal(a, b) and torch.equal(a, noise.window(1 << 12, 1, 0, 0))
    offsets = [int(noise.window(1, s, 3, 0).data_ptr()) for s in range(200)]
    assert len(set(offsets)) > 190  # offsets spread over the pool
    with pytest.raises(ValueError, match="span 4096"):
        noise.window(1 << 13, 1, 0, 0)


def test_host_rounding_is_unbiased():
    """The offloaded path: a constant update a tenth of a bf16 step moves the mean weight by that much."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(400_000, dtype=torch.bfloat16))
    opt = AdamWFp32State([p], lr=2**-7 / 10, betas=(0.0, 0.999), weight_decay=0.0)
    p.grad = torch.full_like(p, -1.0)
    opt.step()  # Adam's first step moves every weight by lr (the sign of the gradient)
    assert set(p.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(p.float().mean().item() - (1.0 + 2**-7 / 10)) < 2e-5


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way between two bf16 values
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    stochastic_round_(out, x)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - x[0].item()) < 2e-5


def test_global_batch_resolution():
    cfg = resolve_config(batch_size=2, global_batch_size=16, progress=False)
    assert resolve_micro_steps(cfg, dp=2, pp=1) == 4 and cfg.grad_accum == 4
    cfg = resolve_config(batch_size=2, pp=2, progress=False)
    assert resolve_micro_steps(cfg, dp=1, pp=2) == 2 and cfg.global_batch_size == 4
    with pytest.raises(ConfigError, match="--global-batch-size 10 is not a multiple"):
        resolve_micro_steps(resolve_config(batch_size=2, global_batch_size=10, progress=False), dp=2, pp=1)
    with pytest.raises(ConfigError, match="--microbatches 3 disagrees"):
        resolve_micro_steps(resolve_config(batch_size=2, global_batch_size=8, microbatches=3, progress=False),
                            dp=1, pp=1)
