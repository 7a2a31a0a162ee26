"""Benchmark: Triton causal conv1d, RMSNorm family and chunked linear cross-entropy vs the naive PyTorch path.

    python -m mamba_parallel.bench.bench_ops [--json PATH] [--dtype bf16] [--impls triton,naive,compiled]
        [--only conv,norm,ce] [--conv-bwd-paths one_pass two_pass]

Forward and forward+backward times at mamba2-2.7b training shapes (b8 L2048 = 16384 tokens): conv over
d = 2*2560 + 2*128 channels (x | B | C), width 4, channels-last input; norms on (16384, 2560) and (16384, 5120);
cross-entropy with d 2560 and vocab 50288. fwd_ms / fwd_bwd_ms are GPU kernel time per call: the summed durations
of every kernel, memcpy and memset one call launches (torch.profiler, mean over back-to-back calls after warm-up).
fwd_wall_ms / fwd_bwd_wall_ms are the CUDA-event time of one call issued alone (triton.testing.do_bench, median):
that includes the host's time to issue the call whenever the host is slower than the kernels (custom-op dispatch,
autograd, Triton launches), which for the norms at these shapes is most of it. "naive" is the reference op
(naive.py), "compiled" the same under torch.compile (conv and norms), "plain" for the loss is F.linear +
F.cross_entropy on full logits (what an unfused model does). Achieved bandwidth (from kernel time) counts the
fewest bytes a pass must move, against this GPU's copy rate measured at the start of the run (a device-to-device
copy of 2 GiB, bytes read + written; in the JSON as copy_TBps).

The conv backward alone (op causal_conv1d_bwd) is timed per backward path (one_pass, two_pass: ops/conv1d/launch.py)
at mamba2-1.3b's profiled shape (b8 L2048 d4352 w4 silu, channels-last), one row each, with its error against the
two-pass result (max_rel_err: the largest |difference| of dx, dweight, dbias over that tensor's largest |value|).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _median_ms(fn, rep_ms: float = 200.0) -> float:
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def _kernel_ms(fn, calls: int = 20) -> tuple[float, float]:
    """(GPU kernel ms per call, launches per call) of ``calls`` back-to-back calls of fn, profiled after warm-up.

    Kernel time, not elapsed time: the sum of the durations of the kernels, memcpys and memsets fn launches, so
    host overhead between launches (which CUDA-event timing of a host-bound call measures instead) is left out.
    """
    from torch.profiler import ProfilerActivity, profile

    from mamba_parallel.bench.profile_train import _gpu_kernels

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # as profile_train does
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        per_name, _ = _gpu_kernels(path)
    finally:
        os.remove(path)
    total_us = sum(sum(d) for d in per_name.values())
    if total_us <= 0:
        raise RuntimeError("bench_ops: the profiler recorded no GPU kernels (is CUPTI available?)")
    return total_us / calls / 1e3, sum(len(d) for d in per_name.values()) / calls


def _fwd_and_fb(fn, inputs, grads_out) -> dict:
    """Forward (under no_grad) and forward+backward of fn(*inputs) -> tensor or tuple; the inputs that require
    grad get gradients (torch.autograd.grad, so nothing accumulates). -> kernel ms, launches and wall ms of each."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fb():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad([o for o in out], leaves, grads_out[:len(out)])

    res = {}
    for key, f in (("fwd", fwd), ("fwd_bwd", fb)):
        res[f"{key}_ms"], res[f"{key}_launches"] = _kernel_ms(f)
        res[f"{key}_wall_ms"] = _median_ms(f)
    return res


def copy_tbps(nbytes: int = 2 * 2**30) -> float:
    """This GPU's device-to-device copy rate in TB/s (bytes read + written per second), the bandwidth reference."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), rep_ms=100.0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e9


class Recorder:
    """Collects result rows, prints each, rewrites the JSON file after each row (a killed run keeps its rows)."""

    def __init__(self, path: str | None, copy_rate: float):
        self.path, self.rows, self.copy_rate = path, [], copy_rate
        self.meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "copy_TBps": round(copy_rate, 3)}

    def add(self, **row):
        self.rows.append(row)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if self.path:
            with open(self.path, "w") as f:
                json.dump({**self.meta, "rows": self.rows}, f, indent=1)


def _variants(triton_fn, naive_fn, impls):
    make = {"triton": lambda: triton_fn, "naive": lambda: naive_fn, "compiled": lambda: torch.compile(naive_fn)}
    return [(name, make[name]()) for name in impls]


def _record(rec, op, shape, impl, fn, inputs, grads_out, nbytes_fwd, nbytes_fb):
    try:
        t = _fwd_and_fb(fn, inputs, grads_out)
        fwd, fb = t["fwd_ms"], t["fwd_bwd_ms"]
        rec.add(op=op, shape=shape, impl=impl, **t,
                fwd_TBps=nbytes_fwd / fwd / 1e9, fwd_bwd_TBps=nbytes_fb / fb / 1e9,
                fwd_bw_frac=nbytes_fwd / fwd / 1e9 / rec.copy_rate,
                fwd_bwd_bw_frac=nbytes_fb / fb / 1e9 / rec.copy_rate)
    except Exception as e:  # one failing variant (e.g. out of memory) must not lose the others
        rec.add(op=op, shape=shape, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
    torch.cuda.empty_cache()


def bench_conv(rec, dtype, impls, bwd_paths):
    from mamba_parallel.ops.conv1d import naive
    from mamba_parallel.ops.conv1d import triton_impl as tri

    b, L, d, w = 8, 2048, 2 * 2560 + 2 * 128, 4
    es = torch.finfo(dtype).bits // 8
    x = torch.randn(b, L, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()  # channels-last
    weight = (torch.randn(d, w, device="cuda", dtype=dtype) * 0.3).requires_grad_()
    bias = torch.randn(d, device="cuda", dtype=dtype).requires_grad_()
    dy = torch.randn(b, L, d, device="cuda", dtype=dtype).transpose(1, 2)
    bdl = b * d * L * es
    shape = f"b{b} d{d} L{L} w{w} silu ch-last"
    for impl, mod_fn in _variants(tri.causal_conv1d, naive.causal_conv1d, impls):
        _record(rec, "causal_conv1d", shape, impl, lambda x, wt, bs, f=mod_fn: f(x, wt, bs, "silu"),
                [x, weight, bias], [dy], 2 * bdl, 5 * bdl)
    if "triton" not in impls:
        return
    bench_conv_bwd(rec, dtype, bwd_paths)
    # decode step: mamba2-2.7b, batch 64
    xs = torch.randn(64, d, device="cuda", dtype=dtype)
    state = torch.randn(64, d, w - 1, device="cuda", dtype=dtype)
    with torch.no_grad():
        for impl, f in (("triton", tri.causal_conv1d_update), ("naive", naive.causal_conv1d_update)):
            ms = _median_ms(lambda f=f: f(xs, state, weight, bias, "silu"))
            nbytes = (2 * state.numel() + 2 * xs.numel()) * es
            rec.add(op="causal_conv1d_update", shape=f"b64 d{d} w{w}", impl=impl, fwd_ms=ms,
                    fwd_TBps=nbytes / ms / 1e9)


def bench_conv_bwd(rec, dtype, paths: list[str], b=8, L=2048, d=2 * 2048 + 2 * 128, device="cuda"):
    """The conv backward alone, one row per backward path, at mamba2-1.3b's shape (the profiled step)."""
    from mamba_parallel.ops.conv1d import launch
    from mamba_parallel.ops.conv1d import triton_impl as tri

    w = 4
    es = torch.finfo(dtype).bits // 8
    x = torch.randn(b, L, d, device=device, dtype=dtype).transpose(1, 2)  # channels-last
    weight = torch.randn(d, w, device=device, dtype=dtype) * 0.3
    bias = torch.randn(d, device=device, dtype=dtype)
    dy = torch.randn(b, L, d, device=device, dtype=dtype).transpose(1, 2)
    nbytes = 3 * b * d * L * es  # read x and dy, write dx
    shape = f"b{b} d{d} L{L} w{w} silu ch-last"

    def call(path):
        return tri.conv1d_backward(x, weight, bias, None, None, dy, None, True, None, path)

    ref = [t.float() for t in call(launch.TWO_PASS)[:3]]
    for path in paths:
        run = launch.backward_launch(True, d, L, tri.backward_path(x, w, path), on_gpu=True)
        impl = f"{run.path}[{run.block_l},{run.block_d},{run.num_warps},{run.tiles_per_program}]"
        try:
            err = max((a.float() - r).abs().max().item() / r.abs().max().clamp_min(1e-30).item()
                      for a, r in zip(call(path)[:3], ref))
            ms, launches = _kernel_ms(lambda: call(path))
            wall = _median_ms(lambda: call(path), rep_ms=50.0)
            rec.add(op="causal_conv1d_bwd", shape=shape, impl=impl, bwd_ms=ms, bwd_launches=launches,
                    bwd_wall_ms=wall, bwd_TBps=nbytes / ms / 1e9, bwd_bw_frac=nbytes / ms / 1e9 / rec.copy_rate,
                    max_rel_err=err)
        except Exception as e:  # one failing path (a compile error, out of resources) must not lose the others
            rec.add(op="causal_conv1d_bwd", shape=shape, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
    torch.cuda.empty_cache()


def bench_norm(rec, dtype, impls):
    from mamba_parallel.ops.norm import naive
    from mamba_parallel.ops.norm import triton_impl as tri

    m = 16384
    es = torch.finfo(dtype).bits // 8
    for d in (2560, 5120):
        x = torch.randn(m, d, device="cuda", dtype=dtype).requires_grad_()
        res = torch.randn(m, d, device="cuda", dtype=torch.float32).requires_grad_()
        wt = (1 + 0.1 * torch.randn(d, device="cuda", dtype=dtype)).requires_grad_()
        dy = torch.randn(m, d, device="cuda", dtype=dtype)
        dres = torch.randn(m, d, device="cuda", dtype=torch.float32)
        md = m * d
        # add_rms_norm: x, res in; y, res_out out. Backward: dy, dres_out, res_out in; dx, dres out.
        for impl, f in _variants(tri.add_rms_norm, naive.add_rms_norm, impls):
            _record(rec, "add_rms_norm", f"{m}x{d} res fp32", impl, lambda x, r, w, f=f: f(x, r, w, 1e-5, True),
                    [x, res, wt], [dy, dres], md * (2 * es + 8), md * (2 * es + 8) + md * (2 * es + 12))
        z = torch.randn(m, d, device="cuda", dtype=dtype).requires_grad_()
        # gated: x, z in; y out. Backward: x, z, dy in; dx, dz out.
        for impl, f in _variants(tri.gated_rms_norm, naive.gated_rms_norm, impls):
            _record(rec, "gated_rms_norm", f"{m}x{d} group {d}", impl, lambda x, z, w, f=f: f(x, z, w, 1e-5),
                    [x, z, wt], [dy], 3 * md * es, 3 * md * es + 5 * md * es)
        for impl, f in _variants(tri.rms_norm, naive.rms_norm, impls):
            _record(rec, "rms_norm", f"{m}x{d}", impl, lambda x, w, f=f: f(x, w, 1e-5), [x, wt], [dy],
                    2 * md * es, 2 * md * es + 3 * md * es)


def bench_ce(rec, dtype):
    from mamba_parallel.ops.cross_entropy import naive
    from mamba_parallel.ops.cross_entropy import triton_impl as tri

    n, d, v = 16384, 2560, 50288
    h = torch.randn(n, d, device="cuda", dtype=dtype).requires_grad_()
    wt = (torch.randn(v, d, device="cuda", dtype=dtype) / d ** 0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::50] = -100
    one = torch.ones((), device="cuda")
    flops = 2 * n * d * v

    def plain(h, w, lab):
        return F.cross_entropy(F.linear(h, w).float(), lab, ignore_index=-100)

    for impl, f in (("triton", tri.linear_cross_entropy), ("naive", naive.linear_cross_entropy), ("plain", plain)):
        try:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t = _fwd_and_fb(lambda h, w, f=f: f(h, w, labels), [h, wt], [one])
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            rec.add(op="linear_cross_entropy", shape=f"N{n} d{d} V{v}", impl=impl, **t,
                    fwd_bwd_TFLOPs=3 * flops / t["fwd_bwd_ms"] / 1e9, extra_peak_GiB=peak)
        except Exception as e:
            rec.add(op="linear_cross_entropy", shape=f"N{n} d{d} V{v}", impl=impl,
                    error=f"{type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench ops", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation / weight dtype")
    ap.add_argument("--impls", default="triton,naive",
                    help="comma-separated implementations of conv and norms to time: triton, naive, compiled "
                         "(torch.compile of naive); the loss always times triton, naive and plain")
    ap.add_argument("--conv-bwd-paths", nargs="*", default=["one_pass", "two_pass"], choices=["one_pass", "two_pass"],
                    help="conv backward paths to time alone (default: both)")
    ap.add_argument("--only", default="conv,norm,ce", help="comma-separated subset of conv, norm, ce")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops: needs a CUDA GPU")
    dtype = DTYPES[args.dtype]
    only = set(args.only.split(","))
    unknown = only - {"conv", "norm", "ce"}
    if unknown:
        raise SystemExit(f"bench_ops: --only got unknown parts {sorted(unknown)}")
    impls = [i for i in args.impls.split(",") if i]
    bad = set(impls) - {"triton", "naive", "compiled"}
    if bad:
        raise SystemExit(f"bench_ops: --impls got unknown implementations {sorted(bad)}")
    rec = Recorder(args.json, copy_tbps())
    if "conv" in only:
        bench_conv(rec, dtype, impls, args.conv_bwd_paths)
    if "norm" in only:
        bench_norm(rec, dtype, impls)
    if "ce" in only:
        bench_ce(rec, dtype)


if __name__ == "__main__":
    main()
