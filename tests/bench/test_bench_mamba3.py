"""bench mamba3: the peer adapter passes mamba_ssm the same computation as ours (checked with a stand-in that
reads mamba_ssm's argument conventions into our reference), the tables, and the CPU refusal. No timing asserted."""

import math

import pytest
import torch

from mamba_parallel.bench import bench_mamba3
from mamba_parallel.ops.mamba3 import naive


def peer_convention_reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, chunk_size):
    """mamba_ssm's mamba3_siso_combined contract (ADT / DT / Trap as (b, h, L), Trap before its sigmoid, Angles
    before tanh * pi) computed by our reference."""
    dt = DT.transpose(1, 2)
    return naive.mamba3_chunk_scan(V, dt, ADT.transpose(1, 2) / dt, K, Q, torch.sigmoid(Trap.transpose(1, 2)),
                                   math.pi * torch.tanh(Angles), chunk_size, D=D, z=Z, B_bias=K_bias,
                                   C_bias=Q_bias)


def test_peer_adapter_feeds_the_same_computation():
    inp = bench_mamba3.scan_inputs(2, 40, 4, 8, 16, torch.float32, device="cpu")
    ours = bench_mamba3.ours_scan(inp, 16)
    theirs = bench_mamba3.peer_scan(peer_convention_reference, inp, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def peer_mimo_convention_reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
                                   chunk_size, rotary_dim_divisor, dtype):
    """mamba_ssm's mamba3_mimo contract (rank-major Q / K (b, L, R, g, n), halved rotary on n / divisor pairs)."""
    assert rotary_dim_divisor == 4 and Angles.shape[-1] == Q.shape[-1] // 4
    dt = DT.transpose(1, 2)
    return naive.mamba3_chunk_scan(V, dt, ADT.transpose(1, 2) / dt, K, Q, torch.sigmoid(Trap.transpose(1, 2)),
                                   math.pi * torch.tanh(Angles), chunk_size, D=D, z=Z, B_bias=K_bias, C_bias=Q_bias,
                                   mimo_x=MIMO_V, mimo_z=MIMO_Z, mimo_o=MIMO_Out, rope="halved")


def test_peer_mimo_adapter_feeds_the_same_computation():
    inp = bench_mamba3.scan_inputs(1, 20, 2, 8, 16, torch.float32, device="cpu", R=2)
    ours = bench_mamba3.ours_scan(inp, 8)
    theirs = bench_mamba3.peer_mimo_scan(peer_mimo_convention_reference, inp, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_tables():
    rows = [dict(section="scan", shape="b1", ours_fwd_ms=1.0, ours_fwdbwd_ms=2.0, peer_fwd_ms=1.5,
                 peer_fwdbwd_ms=3.0), dict(section="step", shape="b2", ours_us=5.0)]
    text = bench_mamba3.table(rows)
    assert "| b1 | 1.000 | 1.500 | 1.50 | 2.000 | 3.000 | 1.50 |" in text and "| b2 | 5.0 | - | - |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_needs_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_mamba3.main(["--sections", "scan"])
