"""GPU: our Mamba-3 scan and decode step against mamba_ssm's Triton SISO kernels on the same inputs (both measured
against the float64 reference: the peer computes in bf16). Skips without CUDA or without mamba_ssm importable."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import rel_err
from mamba_parallel.bench.bench_mamba3 import scan_inputs
from mamba_parallel.bench.peer_mamba3 import ours_scan, peer_scan_call
from mamba_parallel.ops.mamba3 import Mamba3State, mamba3_state_update, naive

pytestmark = pytest.mark.gpu
PEER_BF16 = 3e-2  # relative RMS error of the peer's bf16 outputs against float64


def _peer():
    try:
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step
    except Exception as e:
        pytest.skip(f"mamba_ssm's Mamba-3 kernels are not importable: {type(e).__name__}: {e}")
    return mamba3_siso_combined, mamba3_siso_step


def _reference(inp, chunk):
    d = {k: v.double().cpu() for k, v in inp.items() if isinstance(v, torch.Tensor)}
    b, L, h, _ = d["x"].shape
    angles = (math.pi * torch.tanh(d["angles"]))[:, :, None].expand(b, L, h, -1)
    return naive.mamba3_chunk_scan(d["x"], d["dt"], d["A"], d["B"], d["C"], torch.sigmoid(d["trap"]), angles, chunk,
                                   D=d["D"], z=d["z"], B_bias=d["B_bias"], C_bias=d["C_bias"],
                                   return_final_states=True)


def test_scan_and_final_states_match_the_peer():
    scan, _ = _peer()
    inp = scan_inputs(2, 1000, 8, 64, 128, 1, torch.bfloat16, "cuda")
    y_ref, fin_ref = _reference(inp, 64)
    with torch.no_grad():
        ours = ours_scan(**inp)
        peer_out = peer_scan_call(scan, None, **inp)
    e_ours, e_peer = rel_err(ours.cpu(), y_ref), rel_err(peer_out.cpu(), y_ref)
    print(f"y error vs float64: ours {e_ours:.2e}, peer {e_peer:.2e}")
    assert e_peer <= PEER_BF16, "the peer computes something else from the same inputs"
    assert e_ours <= 1.6e-2
    # the final states, in the peer's layout (angle, ssm (b, h, p, n), k, v)
    x = inp["x"]
    b, L, h, _ = x.shape
    with torch.no_grad():
        _, *peer_fin = scan(Q=inp["C"], K=inp["B"], V=x, ADT=(inp["A"] * inp["dt"]).transpose(1, 2),
                            DT=inp["dt"].transpose(1, 2), Trap=inp["trap"].transpose(1, 2), Q_bias=inp["C_bias"],
                            K_bias=inp["B_bias"], Angles=inp["angles"].float()[:, :, None].expand(b, L, h, -1),
                            D=inp["D"], Z=inp["z"], chunk_size=64, return_final_states=True)
    for name, p, r in zip(Mamba3State._fields, peer_fin, fin_ref):
        if name == "angle":  # compare on the circle
            p, r = torch.stack([p.cos(), p.sin()]), torch.stack([r.cos(), r.sin()])
        assert rel_err(p.float().cpu(), r) <= PEER_BF16, f"final {name}"


def test_decode_step_matches_the_peer():
    _, step = _peer()
    b, h, p, n = 4, 8, 64, 128
    inp = {k: (v[:, 0] if k in ("x", "z", "B", "C", "dt", "A", "trap", "angles") else v)
           for k, v in scan_inputs(b, 1, h, p, n, 1, torch.bfloat16, "cuda").items() if k != "chunk_size"}
    a = n // 4
    g = torch.Generator(device="cuda").manual_seed(3)
    state = Mamba3State(torch.rand(b, h, a, device="cuda", generator=g) * 6.28,
                        torch.randn(b, h, p, n, device="cuda", generator=g) * 0.1,
                        torch.randn(b, h, n, device="cuda", generator=g),
                        torch.randn(b, h, p, device="cuda", generator=g).to(torch.bfloat16))
    peer_state = tuple(s.clone() for s in state)
    angles = (math.pi * torch.tanh(inp["angles"].float()))[:, None].expand(b, h, a)
    with torch.no_grad():
        ours = mamba3_state_update(state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                   torch.sigmoid(inp["trap"].float()), angles, D=inp["D"], z=inp["z"],
                                   B_bias=inp["B_bias"], C_bias=inp["C_bias"])
        out, peer_new = step(inp["C"], inp["B"], inp["x"], inp["A"] * inp["dt"], inp["dt"], inp["trap"],
                             inp["C_bias"], inp["B_bias"], inp["angles"].float()[:, None].expand(b, h, a),
                             D=inp["D"], Z=inp["z"], Input_States=peer_state)
    assert rel_err(ours.float(), out.float()) <= PEER_BF16
    assert rel_err(state.ssm, peer_new[1].float()) <= PEER_BF16
