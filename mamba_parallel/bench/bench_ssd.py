"""Benchmark the Triton SSD chunked scan on the shapes of /work/shared/ANCHORS.md (mamba_ssm 2.3.2 on one H200).

    python -m mamba_parallel.bench.bench_ssd [--json PATH] [--compare-naive] [--dtype bf16]

Times forward and forward+backward (median of >= 10 timed runs after warm-up, CUDA events through
triton.testing.do_bench), and the achieved bandwidth against the minimum bytes each pass must move (every input
read once, every output written once) and the ~4.3 TB/s copy ceiling measured on an H200.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from mamba_parallel.bench._timing import COPY_TBPS, DTYPES, require_cuda, write_json

# (b, L, h, p, n, g) and mamba_ssm's (fwd ms, fwd+bwd ms) from ANCHORS.md; chunk 256, with D, no z, bf16
SHAPES = [
    ((8, 4096, 64, 64, 128, 1), (1.44, 5.80)),
    ((4, 16384, 64, 64, 128, 1), (2.62, 10.75)),
    ((8, 4096, 32, 64, 64, 1), (1.21, 5.35)),
]


def make_inputs(b, L, h, p, n, g, dtype, device="cuda", seed=0):
    """Random SSD inputs like a Mamba-2 layer's (dt raw before dt_bias + softplus, A < 0)."""
    torch.manual_seed(seed)
    return dict(
        x=torch.randn(b, L, h, p, device=device, dtype=dtype),
        dt=(torch.randn(b, L, h, device=device) * 0.5 - 1.0).to(dtype),
        A=-torch.exp(torch.rand(h, device=device) * math.log(16)),
        B=torch.randn(b, L, g, n, device=device, dtype=dtype),
        C=torch.randn(b, L, g, n, device=device, dtype=dtype),
        D=torch.randn(h, device=device),
        dt_bias=torch.randn(h, device=device) * 0.3,
    )


def min_bytes(b, L, h, p, n, g, dtype, backward):
    """Fewest bytes a pass must move: forward reads x, dt, B, C and writes y; backward also reads dy and
    re-reads the inputs, and writes dx, ddt, dB, dC."""
    e = torch.finfo(dtype).bits // 8
    inputs = b * L * (h * p + h + 2 * g * n) * e
    fwd = inputs + b * L * h * p * e
    return fwd + (2 * inputs + b * L * h * p * e if backward else 0)


def bench_one(fn, args, chunk, backward, rep_ms):
    from triton.testing import do_bench

    if not backward:
        def run():
            with torch.no_grad():
                fn(**args, chunk_size=chunk, dt_softplus=True)
        return do_bench(run, warmup=50, rep=rep_ms, return_mode="median")
    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in args.items()}
    dy = torch.randn_like(args["x"])

    def run_bwd():
        y = fn(**leaves, chunk_size=chunk, dt_softplus=True)
        y.backward(dy)
    return do_bench(run_bwd, warmup=50, rep=rep_ms, grad_to_none=list(leaves.values()), return_mode="median")


def stage_breakdown(shape, dtype, chunk, rep_ms):
    """Median ms of each kernel stage of the Triton path on one shape (where the time goes)."""
    from triton.testing import do_bench

    from mamba_parallel.ops.ssd import triton_dbc as tdb
    from mamba_parallel.ops.ssd import triton_dt as tdt
    from mamba_parallel.ops.ssd import triton_scan_bwd as tsb
    from mamba_parallel.ops.ssd import triton_scan_fwd as tsf
    from mamba_parallel.ops.ssd import triton_states as tst

    a = make_inputs(*shape, dtype)
    x, dt, A, B, C, D, bias = (a[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    hpg = shape[2] // shape[5]
    dy = torch.randn_like(x)
    dtp, acs = tdt.dt_forward(dt, A, bias, True, 0.0, math.inf, None, chunk)
    st = tst.weighted_outer(x, B, dtp, acs, 0, hpg)
    hin, final = tst.state_pass_fwd(st, acs, None, None, shape[0], dtype)
    dhy = tst.weighted_outer(dy, C, dtp, acs, 1, hpg)
    ds, _, dlast = tst.state_pass_bwd(dhy, acs, hin, final, None, None, False)
    _, _, dac, cb = tdb.dbc_bwd(x, dy, B, C, hin, ds, dtp, acs, hpg)
    _, ddir, _ = tsb.dx_bwd(x, dy, B, cb, ds, dtp, acs, D, hpg)
    stages = {
        "fwd dt+cumsum": lambda: tdt.dt_forward(dt, A, bias, True, 0.0, math.inf, None, chunk),
        "fwd chunk states": lambda: tst.weighted_outer(x, B, dtp, acs, 0, hpg),
        "fwd state pass": lambda: tst.state_pass_fwd(st, acs, None, None, shape[0], dtype),
        "fwd chunk scan": lambda: tsf.scan_fwd(x, None, B, C, hin, dtp, acs, D, hpg),
        "bwd dstates": lambda: tst.weighted_outer(dy, C, dtp, acs, 1, hpg),
        "bwd state pass": lambda: tst.state_pass_bwd(dhy, acs, hin, final, None, None, False),
        "bwd dx": lambda: tsb.dx_bwd(x, dy, B, cb, ds, dtp, acs, D, hpg),
        "bwd dB dC": lambda: tdb.dbc_bwd(x, dy, B, C, hin, ds, dtp, acs, hpg),
        "bwd dt": lambda: tdt.dt_backward(dt, A, bias, True, 0.0, math.inf, None, dtp, dac, ddir, dlast),
    }
    return {k: do_bench(f, warmup=25, rep=rep_ms, return_mode="median") for k, f in stages.items()}


def check_against_naive(shape, dtype, chunk):
    """Relative errors of the (autotuned) Triton path vs the fp32 reference on the same inputs: y, final states
    and every gradient. The tests run with one config each; this covers the configs the autotuner picked."""
    from mamba_parallel.ops.ssd import naive, triton_impl

    a = make_inputs(*shape, dtype)
    gy = torch.randn_like(a["x"], dtype=torch.float32)
    out = {}
    for name, fn, cast in (("triton", triton_impl.ssd_chunk_scan, lambda t: t),
                           ("naive", naive.ssd_chunk_scan, lambda t: t.float())):
        leaves = {k: cast(v).detach().requires_grad_(True) for k, v in a.items()}
        y, fin = fn(**leaves, chunk_size=chunk, dt_softplus=True, return_final_states=True)
        ((y.float() * gy).sum() + fin.sum()).backward()
        out[name] = dict(y=y.detach(), final=fin.detach(), **{"d" + k: v.grad for k, v in leaves.items()})
        del leaves, y, fin
    rel = lambda u, v: ((u.double() - v.double()).norm() / v.double().norm()).item()  # noqa: E731
    return {k: rel(out["triton"][k], out["naive"][k]) for k in out["naive"]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="mamba-parallel bench ssd", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results to this JSON file")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (ANCHORS use bf16)")
    ap.add_argument("--chunk", type=int, default=256, help="chunk size (ANCHORS use 256)")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement (>= 10 runs)")
    ap.add_argument("--compare-naive", action="store_true", help="also time the pure-PyTorch reference")
    ap.add_argument("--shapes", type=int, nargs="*", help="indices into the shape list (default: all)")
    ap.add_argument("--breakdown", action="store_true", help="also time each kernel stage on the first shape")
    ap.add_argument("--check", action="store_true",
                    help="also report relative errors vs the fp32 reference on the first shape (autotuned configs)")
    args = ap.parse_args(argv)
    require_cuda("bench_ssd")
    from mamba_parallel.ops.ssd import naive, triton_impl

    dtype = DTYPES[args.dtype]
    impls = {"triton": triton_impl.ssd_chunk_scan}
    if args.compare_naive:
        impls["naive"] = naive.ssd_chunk_scan
    rows = []
    picked = [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES
    for shape, (peer_fwd, peer_fb) in picked:
        inputs = make_inputs(*shape, dtype)
        for name, fn in impls.items():
            row = dict(impl=name, shape=dict(zip("b L h p n g".split(), shape)), chunk=args.chunk,
                       dtype=args.dtype, peer_fwd_ms=peer_fwd, peer_fwd_bwd_ms=peer_fb)
            for backward, key in ((False, "fwd"), (True, "fwd_bwd")):
                try:
                    ms = bench_one(fn, inputs, args.chunk, backward, args.rep_ms)
                except torch.cuda.OutOfMemoryError:
                    ms = float("nan")
                    torch.cuda.empty_cache()
                gbs = min_bytes(*shape, dtype, backward) / (ms * 1e-3) / 1e9
                row[f"{key}_ms"] = ms
                row[f"{key}_GBps"] = gbs
                row[f"{key}_of_copy_ceiling"] = gbs / (COPY_TBPS * 1e3)
            row["speedup_fwd"] = peer_fwd / row["fwd_ms"]
            row["speedup_fwd_bwd"] = peer_fb / row["fwd_bwd_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    print(f"\n{'impl':7s} {'shape (b L h p n g)':24s} {'fwd ms':>8s} {'peer':>6s} {'x':>5s} {'f+b ms':>8s} "
          f"{'peer':>6s} {'x':>5s} {'fwd GB/s':>9s} {'f+b GB/s':>9s}")
    for r in rows:
        s = " ".join(str(v) for v in r["shape"].values())
        print(f"{r['impl']:7s} {s:24s} {r['fwd_ms']:8.3f} {r['peer_fwd_ms']:6.2f} {r['speedup_fwd']:5.2f} "
              f"{r['fwd_bwd_ms']:8.3f} {r['peer_fwd_bwd_ms']:6.2f} {r['speedup_fwd_bwd']:5.2f} "
              f"{r['fwd_GBps']:9.0f} {r['fwd_bwd_GBps']:9.0f}")
    result = dict(device=torch.cuda.get_device_name(), copy_ceiling_TBps=COPY_TBPS, rows=rows)
    if args.breakdown:
        shape = picked[0][0]
        result["breakdown_shape"] = shape
        result["breakdown_ms"] = stage_breakdown(shape, dtype, args.chunk, args.rep_ms / 2)
        print(f"\nstages on {shape}:")
        for k, v in result["breakdown_ms"].items():
            print(f"  {k:18s} {v:7.3f} ms")
    if args.check:
        result["check_rel_err"] = check_against_naive(picked[0][0], dtype, args.chunk)
        errs = " ".join(f"{k}={v:.1e}" for k, v in result["check_rel_err"].items())
        print(f"\nrelative error vs fp32 reference: {errs}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
