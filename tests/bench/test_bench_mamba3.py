"""bench mamba3 on a CPU with the stand-in peer, and the mamba_ssm adapter's argument translation (checked with
stand-ins that read mamba_ssm's conventions into our reference). No timing asserted."""

import math

import pytest

import torch

from mamba_parallel.bench import bench_mamba3, peer_mamba3
from mamba_parallel.bench.peer import load_peer
from mamba_parallel.ops.mamba3 import naive


def siso_convention(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, chunk_size):
    """mamba_ssm's mamba3_siso_combined contract: ADT / DT / Trap (b, h, L), Trap before its sigmoid, Angles
    (b, L, h, a) before tanh * pi."""
    dt = DT.transpose(1, 2)
    return naive.mamba3_chunk_scan(V, dt, ADT.transpose(1, 2) / dt, K, Q, torch.sigmoid(Trap.transpose(1, 2)),
                                   math.pi * torch.tanh(Angles), chunk_size, D=D, z=Z, B_bias=K_bias,
                                   C_bias=Q_bias)


def mimo_convention(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, chunk_size, MIMO_V, MIMO_Z, MIMO_Out,
                    rotary_dim_divisor, dtype):
    """mamba_ssm's mamba3_mimo contract: rank-major Q / K (b, L, R, g, n), halved rotary on n / divisor pairs."""
    assert Angles.shape[-1] == Q.shape[-1] // rotary_dim_divisor
    dt = DT.transpose(1, 2)
    return naive.mamba3_chunk_scan(V, dt, ADT.transpose(1, 2) / dt, K, Q, torch.sigmoid(Trap.transpose(1, 2)),
                                   math.pi * torch.tanh(Angles), chunk_size, D=D, z=Z, B_bias=K_bias, C_bias=Q_bias,
                                   mimo_x=MIMO_V, mimo_z=MIMO_Z, mimo_o=MIMO_Out, rope="halved")


def step_convention(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None):
    """mamba_ssm's Triton mamba3_siso_step contract (raw trap / angles, states returned, not updated)."""
    state = naive.Mamba3State(*(s.clone() for s in Input_States))
    y = naive.mamba3_state_update(state, V, DT, ADT / DT, K, Q, torch.sigmoid(Trap), math.pi * torch.tanh(Angles),
                                  D=D, z=Z, B_bias=K_bias, C_bias=Q_bias)
    return y, list(state)


def test_mamba_ssm_adapter_feeds_the_same_computation():
    for R, chunk in ((1, 16), (2, 8)):
        inp = bench_mamba3.scan_inputs(1, 20, 2, 8, 16, R, torch.float32, "cpu", chunk=chunk)
        ours = peer_mamba3.ours_scan(**inp)
        theirs = peer_mamba3.peer_scan_call(siso_convention, mimo_convention, **inp)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    tok = bench_mamba3.step_inputs(2, 2, 8, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    state = naive.Mamba3State(torch.rand(2, 2, 4, generator=g), torch.randn(2, 2, 8, 16, generator=g),
                              torch.randn(2, 2, 16, generator=g), torch.randn(2, 2, 8, generator=g))
    theirs = peer_mamba3.peer_step_call(step_convention, state, **tok)
    ours = peer_mamba3.ours_step(naive.Mamba3State(*(s.clone() for s in state)), **tok)  # discretized in the op
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ref = peer_mamba3.ours_step(naive.Mamba3State(*(s.clone() for s in state)), **tok, op=naive.mamba3_state_update)
    torch.testing.assert_close(ref, theirs, rtol=1e-5, atol=1e-5)


def test_every_section_runs_with_the_stand_in_peer():
    peer = load_peer("reference")
    res = bench_mamba3.run(peer, "cpu", "fp32", scan_shapes=[(1, 24, 2, 8, 16, 1), (1, 16, 2, 8, 16, 2)],
                           step_shapes=[(2, 2, 8, 16)], layer_shapes=[(32, 1, 16)], warmup=0, reps=1,
                           log=lambda _: None)
    rows = res["rows"]
    assert {r["section"] for r in rows} == {"scan", "step", "layer"}
    assert len(rows) == 2 * 3 + 1 + 2  # scan: 3 modes per shape; step: one row; layer: fwd and fwd+bwd
    for r in rows:
        assert not r.get("errors"), r
        assert r["ours"] > 0 and r["peer"] > 0 and r["x_peer"] > 0
    layer = [r for r in rows if r["section"] == "layer"]  # timed in turns like the kernels: a spread per side
    assert all(set(r["spread"]) == {"ours", "peer"} for r in layer), layer


def test_scan_shape_flag_picks_the_shapes(tmp_path, capsys):
    import json

    out = tmp_path / "m3.json"
    assert bench_mamba3.main(["--peer", "--peer-impl", "reference", "--device", "cpu", "--dtype", "fp32",
                              "--sections", "scan", "--scan-shape", "1", "20", "2", "8", "16", "1",
                              "--warmup", "0", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["case"] for r in rows} == {"b1 L20 h2 p8 n16"} and len(rows) == 3
    with pytest.raises(SystemExit):
        bench_mamba3.main(["--no-peer", "--sections", "scan", "--scan-shape", "1", "20", "2", "8", "15", "1"])
    assert "--scan-shape 1 20 2 8 15 1" in capsys.readouterr().err


def test_train_side_by_side_runs_a_mamba3_preset():
    from mamba_parallel.bench import train_side_by_side

    rows, check = train_side_by_side.run_preset("tiny-mamba3", load_peer("reference"), "cpu", seq_len=16, batch=2,
                                                warmup=0, steps=1, log=lambda _: None)
    assert check["agree"], check  # the same weights handed over: the same step-1 loss
    assert all(r["ours"] > 0 and r["peer"] > 0 for r in rows if r["metric"] != "peak memory")


@pytest.mark.gpu
@pytest.mark.timeout(540)  # compiling mamba_ssm's Mamba-3 backward on a fresh machine alone takes minutes
def test_gpu_peer_mamba3_model_trains_beside_ours():
    """mamba_ssm's LM with its Mamba3 mixers, our from_pretrained of its save_pretrained: same step-1 loss."""
    from mamba_parallel.bench import train_side_by_side
    from mamba_parallel.bench.peer import PeerUnavailable

    try:
        peer = load_peer("mamba_ssm")
        peer_mamba3.mamba3_side(peer)
    except PeerUnavailable as e:
        pytest.skip(str(e))
    rows, check = train_side_by_side.run_preset("mamba3-180m", peer, "cuda", seq_len=512, batch=2, warmup=1,
                                                steps=2, log=print)
    assert check.get("agree"), check
    assert all(not r.get("errors") for r in rows), rows
