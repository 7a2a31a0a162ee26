"""Benchmark the Mamba-3 kernels (SISO scan, decode step) and layer, beside mamba_ssm's with ``--peer``.

    mamba-parallel bench mamba3 [--peer] [--sections scan step layer] [--json PATH] [--dtype bf16]

Same inputs for both, in the layout a Mamba-3 layer produces them (raw trap and angle projections, dt and A per
token and head in fp32); each side's own preparation of them is timed with it (ours: sigmoid / tanh; mamba_ssm's:
the (b, h, L) transposes its layer makes). Forward passes run with gradients enabled (mamba_ssm's kernels always
keep what their backward needs), fwd+bwd is one forward and one backward. Median of >= 10 timed runs after warm-up
(CUDA events). The decode step is timed per call inside one CUDA graph of 100 calls, as generation runs it.
``--peer`` needs mamba_ssm 2.3 importable (its Triton SISO kernels; ../shared/peer/README.md).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from mamba_parallel.bench._timing import DTYPES, graph_us, median_ms, require_cuda, write_json

# (b, L, h, p, n): Mamba-3's defaults (headdim 64, d_state 128, chunk 64); h = 24 / 32 / 64 are the heads of the
# 180m / 440m / 1.5b presets' layers (d_inner / 64).
SCAN_SHAPES = [(8, 2048, 24, 64, 128), (8, 4096, 32, 64, 128), (4, 8192, 64, 64, 128), (2, 16384, 32, 64, 128)]
# MIMO at Mamba-3's suggested rank 4 and chunk 16 (64 rows per chunk); mamba_ssm runs it only with TileLang
MIMO_SHAPES = [(8, 2048, 24, 64, 128, 4), (8, 4096, 32, 64, 128, 4)]
MIMO_CHUNK = 16
STEP_SHAPES = [(1, 32, 64, 128), (64, 32, 64, 128), (1, 64, 64, 128), (64, 64, 64, 128)]  # (b, h, p, n)
LAYER_SHAPES = [(768, 8, 2048), (2048, 8, 2048)]  # (d_model, b, L)


def peer_ops():
    """mamba_ssm's Mamba-3 Triton entry points, or SystemExit naming why they do not import."""
    try:
        from mamba_ssm.modules.mamba3 import Mamba3
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step
    except Exception as e:  # not installed, or its compiled parts do not load here
        raise SystemExit(f"--peer: mamba_ssm's Mamba-3 is not importable ({type(e).__name__}: {e}); see "
                         "../shared/peer/README.md") from e
    try:  # MIMO needs TileLang there; without it the MIMO rows time ours alone
        from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo
    except Exception:
        mamba3_mimo = None
    return dict(scan=mamba3_siso_combined, step=mamba3_siso_step, layer=Mamba3, mimo=mamba3_mimo)


def scan_inputs(b, L, h, p, n, dtype, device="cuda", seed=0, R=None):
    """Raw inputs as a Mamba-3 layer holds them before its scan (one group of B / C, a = n / 4 rotated pairs;
    R: MIMO rank, with its scales)."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, device=device, dtype=dt, generator=g)  # noqa: E731
    a = n // 4
    rank = (R,) if R else ()
    out = dict(x=r(b, L, h, p), z=r(b, L, h, p), B=F.normalize(r(b, L, *rank, 1, n), dim=-1) * n ** 0.5,
               C=F.normalize(r(b, L, *rank, 1, n), dim=-1) * n ** 0.5,
               dt=F.softplus(r(b, L, h, dt=torch.float32) - 3), A=-F.softplus(r(b, L, h, dt=torch.float32)),
               trap=r(b, L, h), angles=r(b, L, a), D=torch.ones(h, device=device),
               B_bias=torch.ones(h, *rank, n, device=device), C_bias=torch.ones(h, *rank, n, device=device))
    if R:
        out.update(mimo_x=torch.full((h, R, p), 1.0 / R, device=device), mimo_z=torch.ones(h, R, p, device=device),
                   mimo_o=torch.full((h, R, p), 1.0 / R, device=device))
    return out


def ours_scan(inp, chunk):
    from mamba_parallel.ops.mamba3 import mamba3_chunk_scan

    x = inp["x"]
    b, L, h, _ = x.shape
    angles = (math.pi * torch.tanh(inp["angles"].float()))[:, :, None].expand(b, L, h, inp["angles"].shape[-1])
    mimo = {k: inp[k] for k in ("mimo_x", "mimo_z", "mimo_o") if k in inp}
    return mamba3_chunk_scan(x, inp["dt"], inp["A"], inp["B"], inp["C"], torch.sigmoid(inp["trap"].float()),
                             angles, chunk, D=inp["D"], z=inp["z"], B_bias=inp["B_bias"], C_bias=inp["C_bias"],
                             rope="halved" if mimo else "interleaved", **mimo)


def peer_scan(fn, inp, chunk):
    x = inp["x"]
    b, L, h, _ = x.shape
    return fn(Q=inp["C"], K=inp["B"], V=x, ADT=(inp["A"] * inp["dt"]).transpose(1, 2),
              DT=inp["dt"].transpose(1, 2), Trap=inp["trap"].transpose(1, 2), Q_bias=inp["C_bias"],
              K_bias=inp["B_bias"], Angles=inp["angles"].float()[:, :, None].expand(b, L, h, -1), D=inp["D"],
              Z=inp["z"], chunk_size=chunk)


def peer_mimo_scan(fn, inp, chunk):
    x = inp["x"]
    b, L, h, _ = x.shape
    return fn(Q=inp["C"], K=inp["B"], V=x, ADT=(inp["A"] * inp["dt"]).transpose(1, 2), DT=inp["dt"].transpose(1, 2),
              Trap=inp["trap"].transpose(1, 2), Q_bias=inp["C_bias"], K_bias=inp["B_bias"], MIMO_V=inp["mimo_x"],
              MIMO_Z=inp["mimo_z"], MIMO_Out=inp["mimo_o"],
              Angles=inp["angles"].float()[:, :, None].expand(b, L, h, -1), D=inp["D"], Z=inp["z"], chunk_size=chunk,
              rotary_dim_divisor=4, dtype=x.dtype)


def time_fwd_bwd(fn, inp, rep_ms):
    """(forward ms with gradients enabled, forward + backward ms)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in inp.items()}
    dy = torch.randn_like(inp["x"])
    fwd = median_ms(lambda: fn(leaves), rep_ms)

    def both():
        fn(leaves).backward(dy)
        for v in leaves.values():
            v.grad = None
    return fwd, median_ms(both, rep_ms)


def bench_scan(peer, dtype, chunk, rep_ms):
    rows = []
    for shape in SCAN_SHAPES:
        inp = scan_inputs(*shape, dtype)
        row = dict(section="scan", shape="b{} L{} h{} p{} n{}".format(*shape))
        row["ours_fwd_ms"], row["ours_fwdbwd_ms"] = time_fwd_bwd(lambda a: ours_scan(a, chunk), inp, rep_ms)
        if peer:
            row["peer_fwd_ms"], row["peer_fwdbwd_ms"] = time_fwd_bwd(lambda a: peer_scan(peer["scan"], a, chunk),
                                                                     inp, rep_ms)
        rows.append(row)
        del inp
        torch.cuda.empty_cache()
    for shape in MIMO_SHAPES:
        inp = scan_inputs(*shape[:5], dtype, R=shape[5])
        row = dict(section="scan", shape="MIMO R{5} b{0} L{1} h{2} p{3} n{4}".format(*shape))
        row["ours_fwd_ms"], row["ours_fwdbwd_ms"] = time_fwd_bwd(lambda a: ours_scan(a, MIMO_CHUNK), inp, rep_ms)
        if peer and peer["mimo"] is not None:
            row["peer_fwd_ms"], row["peer_fwdbwd_ms"] = time_fwd_bwd(
                lambda a: peer_mimo_scan(peer["mimo"], a, MIMO_CHUNK), inp, rep_ms)
        rows.append(row)
        del inp
        torch.cuda.empty_cache()
    return rows


def bench_step(peer, dtype):
    from mamba_parallel.ops.mamba3 import Mamba3State, mamba3_state_update

    rows = []
    for b, h, p, n in STEP_SHAPES:
        inp = {k: v[:, 0] if v.dim() >= 3 and k != "B_bias" and k != "C_bias" else v
               for k, v in scan_inputs(b, 1, h, p, n, dtype).items()}
        a = n // 4
        dev = inp["x"].device
        state = Mamba3State(torch.zeros(b, h, a, device=dev), torch.zeros(b, h, p, n, device=dev),
                            torch.zeros(b, h, n, device=dev), torch.zeros(b, h, p, device=dev, dtype=dtype))

        def ours():
            angles = (math.pi * torch.tanh(inp["angles"].float()))[:, None].expand(b, h, a)
            mamba3_state_update(state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                torch.sigmoid(inp["trap"].float()), angles, D=inp["D"], z=inp["z"],
                                B_bias=inp["B_bias"], C_bias=inp["C_bias"])

        row = dict(section="step", shape=f"b{b} h{h} p{p} n{n}")
        with torch.no_grad():
            row["ours_us"] = graph_us(ours)
            if peer:
                pstate = (state.angle.clone(), state.ssm.clone(), state.k.to(dtype), state.v.clone())

                def theirs():
                    peer["step"](inp["C"], inp["B"], inp["x"], inp["A"] * inp["dt"], inp["dt"], inp["trap"],
                                 inp["C_bias"], inp["B_bias"], inp["angles"].float()[:, None].expand(b, h, a),
                                 D=inp["D"], Z=inp["z"], Input_States=pstate)
                row["peer_us"] = graph_us(theirs)
        rows.append(row)
    return rows


def bench_layer(peer, dtype, rep_ms):
    from mamba_parallel.layers.mamba3 import Mamba3

    rows = []
    for d_model, b, L in LAYER_SHAPES:
        x = torch.randn(b, L, d_model, device="cuda")
        layers = {"ours": Mamba3(d_model, layer_idx=0, device="cuda")}
        if peer:
            layers["peer"] = peer["layer"](d_model, layer_idx=0, device="cuda")
            layers["peer"].load_state_dict(layers["ours"].state_dict())
        row = dict(section="layer", shape=f"d_model{d_model} b{b} L{L}")
        for name, layer in layers.items():
            def run(inp, layer=layer):
                with torch.autocast("cuda", dtype=dtype):
                    return layer(inp["x"])
            row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = time_fwd_bwd(run, {"x": x}, rep_ms)
        rows.append(row)
        del layers
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    """Markdown tables of the rows, one per section; peer / ours > 1 means ours is faster."""
    blocks = []
    for section in ("scan", "layer"):
        part = [r for r in rows if r["section"] == section]
        if part:
            lines = [f"| {section} | ours fwd ms | peer fwd ms | peer / ours | ours fwd+bwd ms | peer fwd+bwd ms "
                     "| peer / ours |", "|---|---|---|---|---|---|---|"]
            for r in part:
                cells = [r["shape"]]
                for k in ("fwd", "fwdbwd"):
                    o, p = r[f"ours_{k}_ms"], r.get(f"peer_{k}_ms")
                    cells += [f"{o:.3f}"] + ([f"{p:.3f}", f"{p / o:.2f}"] if p else ["-", "-"])
                lines.append("| " + " | ".join(cells) + " |")
            blocks.append("\n".join(lines))
    part = [r for r in rows if r["section"] == "step"]
    if part:
        lines = ["| decode step | ours us | peer us | peer / ours |", "|---|---|---|---|"]
        for r in part:
            o, p = r["ours_us"], r.get("peer_us")
            lines.append(f"| {r['shape']} | {o:.1f} | " + (f"{p:.1f} | {p / o:.2f} |" if p else "- | - |"))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "(nothing timed)"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="mamba-parallel bench mamba3", description=__doc__.split("\n")[0])
    ap.add_argument("--peer", action="store_true", help="also time mamba_ssm's Mamba-3 on the same inputs")
    ap.add_argument("--sections", nargs="+", default=["scan", "step", "layer"], choices=["scan", "step", "layer"],
                    help="what to time: the scan kernels, the decode step, the whole layer (default: all)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input / autocast dtype")
    ap.add_argument("--chunk", type=int, default=64, help="chunk size of the scan (Mamba-3's default: 64)")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement (>= 10 runs)")
    ap.add_argument("--json", help="write the results to this JSON file")
    args = ap.parse_args(argv)
    require_cuda("bench mamba3")
    peer = peer_ops() if args.peer else None
    dtype = DTYPES[args.dtype]
    rows = []
    if "scan" in args.sections:
        rows += bench_scan(peer, dtype, args.chunk, args.rep_ms)
    if "step" in args.sections:
        rows += bench_step(peer, dtype)
    if "layer" in args.sections:
        rows += bench_layer(peer, dtype, args.rep_ms)
    print(table(rows))
    write_json(args.json, dict(bench="mamba3", device=torch.cuda.get_device_name(), dtype=args.dtype,
                               chunk=args.chunk, peer=bool(peer), rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
