"""Time the Mamba-1 scan backward walked in 1, 2, 4 ... segments, with the inputs as the Mamba-1 layer passes them.

    python tools/scan_segments.py [--shapes 8x1536x2048 8x2048x2048 ...] [--counts 1 2 4 8 16] [--json FILE]

For each shape (batch x d_inner x length, n = 16, bf16): one forward that keeps checkpoints, then
``scan_backward`` as the fused layer calls it (B / C as contiguous fp32 rows, z and the gated output's gradient as
channel-contiguous views of (b, L, .) buffers, y's gradient formed token-major, dz, the gate's output and du
written through strides), timed with CUDA events for each segment count and for the count that
``launch.backward_segment_chunks`` picks. Prints one table (ms; the largest difference from the one-piece walk,
relative to each gradient's largest value) and the wave-model constants it was run with, so that a new GPU's
figures can refit them. Without CUDA, under TRITON_INTERPRET=1, it runs one tiny shape (a smoke test, no timings).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mamba_parallel.ops.layout.triton_impl import _gate_into
from mamba_parallel.ops.selective_scan import launch, triton_impl

DEFAULT_SHAPES = ("8x1536x2048", "8x2048x2048", "8x4096x2048", "8x5120x2048", "4x5120x8192", "1x1536x16384")


def layer_inputs(b: int, d: int, L: int, n: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """The scan's inputs in the layouts the fused Mamba-1 layer hands over, plus its backward's buffers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(device)  # noqa: E731
    xz = rnd(b, L, 2 * d).to(dtype)
    return dict(
        u=rnd(b, d, L).to(dtype), delta=(rnd(b, d, L, scale=0.5) - 1).to(dtype),
        A=-torch.arange(1, n + 1, dtype=torch.float32, device=device).expand(d, n).contiguous(),
        B=rnd(b, 1, n, L), C=rnd(b, 1, n, L), D=rnd(d), delta_bias=rnd(d, scale=0.1),
        z=xz[..., d:].transpose(1, 2), dgated=rnd(b, L, d).to(dtype).transpose(1, 2),
        dxz=torch.empty_like(xz), gated=torch.empty(b, L, d, device=device, dtype=dtype),
        du=torch.empty(b, L, d, device=device, dtype=dtype))


def backward(x: dict, path: str, ckpt: torch.Tensor, dy: torch.Tensor, segments: int | None):
    d = x["u"].shape[1]
    return triton_impl.scan_backward(
        x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], None, None, ckpt, dy, None,
        True, False, path, dz_out=x["dxz"][..., d:].transpose(1, 2), gated_out=x["gated"].transpose(1, 2),
        dgated=x["dgated"], segments=segments, du_out=x["du"].transpose(1, 2))


def max_rel_diff(out, ref) -> float:
    return max(((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
               for o, r in zip(out, ref) if o.numel())


def time_ms(fn, reps: int) -> float:
    """Median over 3 rounds of ``reps`` back-to-back calls, CUDA events."""
    fn()
    rounds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / reps)
    return statistics.median(rounds)


def measure(b: int, d: int, L: int, counts: list[int], n: int = 16, reps: int = 10) -> dict:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else None
    x = layer_inputs(b, d, L, n, device, dtype)
    path = launch.default_request(b, d, n, False, sms)
    _, _, ckpt = triton_impl.scan_forward(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], None,
                                          x["delta_bias"], None, None, True, False, b, True, path,
                                          checkpoint_dtype=triton_impl.default_checkpoint_dtype(x["u"], 1))
    dy = _gate_into(x["dgated"], x["z"], x["u"].new_empty(x["u"].shape))
    ref = [t.clone() for t in backward(x, path, ckpt, dy, 1)]
    nchunks = -(-L // launch.chunk_tokens(L, interp=not cuda))
    row = {"shape": f"b{b} d{d} L{L} n{n}", "chosen": -(-nchunks // launch.backward_segment_chunks(
        b, d, nchunks, 1, sms)), "ms": {}, "max_rel_diff": {}}
    for s in [*counts, None]:
        key = "chosen" if s is None else str(s)
        out = backward(x, path, ckpt, dy, s)
        row["max_rel_diff"][key] = max_rel_diff(out, ref)
        row["ms"][key] = time_ms(lambda: backward(x, path, ckpt, dy, s), reps) if cuda else None
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES), metavar="BxDxL")
    ap.add_argument("--counts", nargs="*", type=int, default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--json", metavar="FILE", help="also write the rows there")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if not torch.cuda.is_available():  # the interpreter: one tiny shape, correctness only
        from mamba_parallel.ops.backend import interpret_mode

        if not interpret_mode():
            raise SystemExit("scan_segments: no CUDA device; TRITON_INTERPRET=1 runs one tiny shape (no timings)")
        shapes, counts, n = [(2, 32, 32)], [c for c in args.counts if c <= 3] or [2], 4
    else:
        counts, n = args.counts, 16
    model = {k: getattr(launch, k) for k in ("BWD_WARPS_PER_SM", "BWD_CARRY_COST", "BWD_SEGMENT_COST",
                                             "BWD_MAX_SEGMENTS", "BWD_MIN_SEGMENT_CHUNKS")}
    print("wave model:", ", ".join(f"{k} {v}" for k, v in model.items()))
    keys = [str(c) for c in counts] + ["chosen"]
    print("| shape | " + " | ".join(keys) + " | count chosen | max rel diff |")
    print("|---" * (len(keys) + 3) + "|")
    rows = []
    for b, d, L in shapes:
        row = measure(b, d, L, counts, n)
        rows.append(row)
        cells = [f"{row['ms'][k]:.3f}" if row["ms"][k] is not None else "-" for k in keys]
        print(f"| {row['shape']} | " + " | ".join(cells) + f" | {row['chosen']} | "
              f"{max(row['max_rel_diff'].values()):.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
