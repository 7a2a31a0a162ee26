"""Benchmark: Triton selective scan (Mamba-1) forward and forward+backward, and the decode-step kernels.

    python -m mamba_parallel.bench.bench_selective_scan [--json PATH] [--sweep [IMPL:]CFG|IMPL ...] [--dtype bf16]

Each --sweep item picks a kernel variant (MAMBA_PARALLEL_SCAN_IMPL: v2, v3, v4) and / or a tile config
(MAMBA_PARALLEL_SCAN_CFG 'T,BDf,Wf,BDb,Wb'): ``v4``, ``v3:16,128,4,128,4``, ``16,64,2,64,2`` (the default
variant's kernels). The default (auto: v3 or v4 by the work per SM) always runs first; every swept item is also
checked against it (relative error). Without --sweep, v3 and v4 are swept too (VARIANTS.md);
``--sweep`` with no items times the default alone.

Times are medians of >= 10 timed runs (``triton.testing.do_bench``, CUDA events) after warm-up. Achieved bandwidth
counts the fewest bytes each pass must move (every (b, d, L) input read once, every output written once) against
the 4.3 TB/s copy rate measured on the H200. Peer figures: mamba_ssm 2.3.2 CUDA kernels on one H200 (ANCHORS.md).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mamba_parallel.bench._timing import COPY_TBPS, DTYPES, graph_us, median_ms, require_cuda, write_json

# (b, d, L, n) -> (peer fwd ms, peer fwd+bwd ms)
SCAN_SHAPES = {(8, 4096, 4096, 16): (2.44, 12.25), (4, 5120, 8192, 16): (3.43, 15.74)}
DEFAULT_SWEEP = ("v3", "v4", "v4+v3")  # what the default (auto) chooses between, and plain v4


def scan_inputs(b, d, L, n, dtype, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0, dt=dtype: (torch.randn(*s, generator=g, device=device) * scale).to(dt)  # noqa: E731
    return dict(u=r(b, d, L), delta=r(b, d, L, scale=0.5), A=-(torch.rand(d, n, generator=g, device=device) + 0.5),
                B=r(b, n, L), C=r(b, n, L), D=r(d, dt=torch.float32), z=r(b, d, L),
                delta_bias=r(d, scale=0.3, dt=torch.float32), delta_softplus=True)


def bench_scan(b, d, L, n, dtype) -> dict:
    from mamba_parallel.ops.selective_scan.triton_impl import selective_scan

    kw = scan_inputs(b, d, L, n, dtype)
    with torch.no_grad():
        fwd_ms = median_ms(lambda: selective_scan(**kw))
    leaves = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    kwg = {k: (v.detach().requires_grad_() if k in leaves else v) for k, v in kw.items()}
    dy = torch.randn(b, d, L, device="cuda", dtype=dtype)
    params = [kwg[k] for k in leaves]

    def fwd_bwd():
        y = selective_scan(**kwg)
        torch.autograd.grad(y, params, dy)

    fb_ms = median_ms(fwd_bwd)
    es = torch.finfo(dtype).bits // 8
    bdl = b * d * L * es
    fwd_bytes = 4 * bdl + 2 * b * n * L * es  # u, delta, z, B, C in; y out
    fb_bytes = fwd_bytes + 7 * bdl + 4 * b * n * L * es  # + u, delta, z, dy in; du, ddelta, dz out; B, C, dB, dC
    peer = SCAN_SHAPES.get((b, d, L, n), (float("nan"), float("nan")))
    return dict(shape=f"b{b} d{d} L{L} n{n}", dtype=str(dtype).split(".")[-1], fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms,
                peer_fwd_ms=peer[0], peer_fwd_bwd_ms=peer[1], fwd_speedup=peer[0] / fwd_ms,
                fwd_bwd_speedup=peer[1] / fb_ms, fwd_TBps=fwd_bytes / fwd_ms / 1e9,
                fwd_bwd_TBps=fb_bytes / fb_ms / 1e9, fwd_bw_frac=fwd_bytes / fwd_ms / 1e9 / COPY_TBPS,
                fwd_bwd_bw_frac=fb_bytes / fb_ms / 1e9 / COPY_TBPS,
                config=sweep_label())


def parse_sweep_item(item: str) -> tuple[str | None, str | None]:
    """'v2' | 'v2:T,BDf,Wf,BDb,Wb' | 'T,BDf,Wf,BDb,Wb' -> (impl or None, cfg or None), validated."""
    from mamba_parallel.ops.selective_scan.triton_common import IMPLS, MIXED, parse_config

    names = IMPLS + tuple(MIXED)
    if ":" in item:
        impl, _, cfg = item.rpartition(":")
    else:  # a bare item is a tile config when it has commas, else a variant name
        impl, cfg = ("", item) if "," in item else (item, "")
    if impl and impl not in names:
        raise SystemExit(f"bench_selective_scan: --sweep {item!r}: variant must be one of {names}")
    if cfg:
        try:
            parse_config(cfg)
        except ValueError as e:
            raise SystemExit(f"bench_selective_scan: --sweep {item!r}: {e}") from None
    return impl or None, cfg or None


def set_sweep_env(impl: str | None, cfg: str | None) -> None:
    """Select a variant / tile config for the next calls (None: the default)."""
    for key, val in (("MAMBA_PARALLEL_SCAN_IMPL", impl), ("MAMBA_PARALLEL_SCAN_CFG", cfg)):
        if val is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = val


def sweep_label() -> str:
    impl, cfg = os.environ.get("MAMBA_PARALLEL_SCAN_IMPL"), os.environ.get("MAMBA_PARALLEL_SCAN_CFG")
    return ":".join(x for x in (impl, cfg) if x) or "default"


def check_config_matches_default(b, d, L, n, dtype, impl: str | None, cfg: str | None) -> float:
    """Largest relative error between a swept variant / tile config and the default one (y and every gradient)."""
    from mamba_parallel.ops.selective_scan.triton_impl import selective_scan

    kw = scan_inputs(b, d, L, n, dtype, seed=3)
    leaves = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    outs = []
    for env in ((None, None), (impl, cfg)):
        set_sweep_env(*env)
        kwg = {k: (v.detach().requires_grad_() if k in leaves else v) for k, v in kw.items()}
        y = selective_scan(**kwg)
        outs.append([y.float()] + [t.float() for t in torch.autograd.grad(y.float().square().sum(),
                                                                          [kwg[k] for k in leaves])])
    return max(((a - c).norm() / c.norm()).item() for a, c in zip(*outs))


def bench_decode(dtype) -> list[dict]:
    """Per-layer decode step inside a CUDA graph, mamba-2.8b (d 5120, n 16) and mamba2-2.7b (h 80, p 64, n 128)
    sizes; bandwidth counts the fp32 state read and written once."""
    from mamba_parallel.ops.state_update.triton_impl import selective_state_update, ssd_state_update

    rows = []
    for batch in (1, 64):
        d, n = 5120, 16
        st = torch.randn(batch, d, n, device="cuda")
        x, dt, z = (torch.randn(batch, d, device="cuda", dtype=dtype) for _ in range(3))
        A, Bv, Cv = -torch.rand(d, n, device="cuda"), *(torch.randn(batch, n, device="cuda", dtype=dtype)
                                                       for _ in range(2))
        D, bias = torch.randn(d, device="cuda"), torch.randn(d, device="cuda")
        us = graph_us(lambda: selective_state_update(st, x, dt, A, Bv, Cv, D, z, bias, True))
        nbytes = 2 * st.numel() * 4
        rows.append(dict(op="selective_state_update", shape=f"b{batch} d{d} n{n}", us=us, TBps=nbytes / us / 1e6))
        h, p, n = 80, 64, 128
        st = torch.randn(batch, h, p, n, device="cuda")
        x, z = (torch.randn(batch, h, p, device="cuda", dtype=dtype) for _ in range(2))
        dt = torch.randn(batch, h, device="cuda", dtype=dtype)
        A, D, bias = -torch.rand(h, device="cuda"), torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
        Bv, Cv = (torch.randn(batch, 1, n, device="cuda", dtype=dtype) for _ in range(2))
        us = graph_us(lambda: ssd_state_update(st, x, dt, A, Bv, Cv, D, z, bias, True))
        nbytes = 2 * st.numel() * 4
        rows.append(dict(op="ssd_state_update", shape=f"b{batch} h{h} p{p} n{n}", us=us, TBps=nbytes / us / 1e6))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench selective_scan", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype of the scans")
    ap.add_argument("--sweep", nargs="*", default=list(DEFAULT_SWEEP), metavar="[IMPL:]CFG",
                    help="kernel variants (v2 v3 v4 v4+v3, MAMBA_PARALLEL_SCAN_IMPL) and / or tile configs "
                         "'T,BDf,Wf,BDb,Wb' to time besides the default, e.g. v4 or v3:16,128,4,128,4 (default: "
                         f"{' '.join(DEFAULT_SWEEP)}; see ops/selective_scan/VARIANTS.md)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step kernels")
    args = ap.parse_args(argv)
    require_cuda("bench_selective_scan")
    dtype = DTYPES[args.dtype]
    results = {"device": torch.cuda.get_device_name(), "scan": [], "decode": [], "sweep_errors": {}}
    sweep = [parse_sweep_item(item) for item in args.sweep]
    for item, (impl, cfg) in zip([None] + list(args.sweep), [(None, None)] + sweep):
        if item is not None:
            try:
                err = check_config_matches_default(2, 512, 1024, 16, dtype, impl, cfg)
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:200]}"
            results["sweep_errors"][item] = err
            print("partial: config", item, "error vs default", err, flush=True)
        set_sweep_env(impl, cfg)
        for (b, d, L, n) in SCAN_SHAPES:
            try:
                results["scan"].append(bench_scan(b, d, L, n, dtype))
            except Exception as e:  # a swept config may not compile (registers / shared memory)
                results["scan"].append(dict(shape=f"b{b} d{d} L{L} n{n}", config=item or "default",
                                            error=f"{type(e).__name__}: {str(e)[:200]}"))
            print("partial:", json.dumps(results["scan"][-1]), flush=True)
            torch.cuda.empty_cache()
    set_sweep_env(None, None)
    if not args.no_decode:
        results["decode"] = bench_decode(dtype)
    print(f"device: {results['device']}")
    print(f"{'config':>22} {'shape':>22} {'fwd ms':>8} {'peer':>6} {'x':>5} {'TB/s':>5} "
          f"{'f+b ms':>8} {'peer':>6} {'x':>5} {'TB/s':>5}")
    for r in results["scan"]:
        if "error" in r:
            print(f"{r['config']:>22} {r['shape']:>22}  ERROR {r['error']}")
            continue
        print(f"{r['config']:>22} {r['shape']:>22} {r['fwd_ms']:8.3f} {r['peer_fwd_ms']:6.2f} "
              f"{r['fwd_speedup']:5.2f} {r['fwd_TBps']:5.2f} {r['fwd_bwd_ms']:8.3f} {r['peer_fwd_bwd_ms']:6.2f} "
              f"{r['fwd_bwd_speedup']:5.2f} {r['fwd_bwd_TBps']:5.2f}")
    for cfg, err in results["sweep_errors"].items():
        print(f"config {cfg}: max rel err vs default {err}")
    for r in results["decode"]:
        print(f"{r['op']:>24} {r['shape']:>22} {r['us']:8.2f} us {r['TBps']:5.2f} TB/s")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
