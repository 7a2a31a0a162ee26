"""The Mamba-3 scan (SISO and MIMO), decode step and layer beside mamba_ssm's, same inputs, same process.

    mamba-parallel bench mamba3 [--peer | --no-peer] [--sections scan step layer] [--scan-shape B L H P N R]
                                [--json PATH]

Every side gets a Mamba-3 layer's raw inputs and prepares them its own way, timed with it (bench/peer_mamba3.py):
x, z (b, L, h, p), B / C (b, L, [R,] 1, n) RMS-normed, dt / A fp32, trap before its sigmoid, angles (b, L, n / 4)
before pi * tanh, D, B / C biases, MIMO scales; headdim 64, d_state 128, chunk 64 (MIMO: rank 4, chunk 16, as
mamba_ssm suggests). Scan rows: forward with gradients enabled, forward + backward (every input's gradient),
inference. Decode rows: one token's step from the layer's raw projections (dt / A before their softplus), each
side discretizing as its layer does (ours inside the step kernel, mamba_ssm in torch), inference, per call inside a
CUDA graph of 20 calls (eager on a CPU).
Layer rows: the whole mixer (in_proj .. out_proj, same weights on both sides) under bf16 autocast, forward with
gradients enabled and forward + backward (weights' gradients too). mamba_ssm's MIMO kernels need TileLang: without
it the MIMO rows time ours alone.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from mamba_parallel.bench import kernels, peer as peer_mod
from mamba_parallel.bench.peer import PeerUnavailable
from mamba_parallel.bench.peer_mamba3 import mamba3_side, ours_scan, ours_step
from mamba_parallel.bench.results import (error_text, make_row, publish, run_metadata, say, side_names,
                                          side_versions, write_result)
from mamba_parallel.bench.timing import DTYPES, median_ms, time_calls

# (b, L, h, p, n, R): h = 24 / 32 / 64 are the heads of the 180m / 440m / 1.5b presets' layers (d_inner / 64)
SCAN_SHAPES = [(8, 2048, 24, 64, 128, 1), (8, 4096, 32, 64, 128, 1), (4, 8192, 64, 64, 128, 1),
               (8, 2048, 24, 64, 128, 4), (8, 4096, 32, 64, 128, 4)]
STEP_SHAPES = [(1, 32, 64, 128), (64, 32, 64, 128), (1, 64, 64, 128), (64, 64, 64, 128)]  # (b, h, p, n)
LAYER_SHAPES = [(768, 8, 2048), (2048, 8, 2048)]  # (d_model, b, L)
CHUNK, MIMO_CHUNK = 64, 16
SECTIONS = ("scan", "step", "layer")


def scan_inputs(b, L, h, p, n, R, dtype, device, seed=0, chunk=None) -> dict:
    """Random raw inputs of a Mamba-3 layer's scan (one B / C group, n / 4 rotated pairs; R > 1: MIMO)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, device=device, dtype=dt, generator=gen)  # noqa: E731
    rank = (R,) if R > 1 else ()
    out = dict(x=r(b, L, h, p), z=r(b, L, h, p), B=(F.normalize(r(b, L, *rank, 1, n).float(), dim=-1)
                                                     * n ** 0.5).to(dtype),
               C=(F.normalize(r(b, L, *rank, 1, n).float(), dim=-1) * n ** 0.5).to(dtype),
               dt=F.softplus(r(b, L, h, dt=torch.float32) - 3), A=-F.softplus(r(b, L, h, dt=torch.float32)),
               trap=r(b, L, h), angles=r(b, L, n // 4), D=torch.ones(h, device=device),
               B_bias=torch.ones(h, *rank, n, device=device), C_bias=torch.ones(h, *rank, n, device=device),
               chunk_size=chunk or (CHUNK if R == 1 else MIMO_CHUNK))
    if R > 1:
        out.update(mimo_x=torch.full((h, R, p), 1.0 / R, device=device), mimo_z=torch.ones(h, R, p, device=device),
                   mimo_o=torch.full((h, R, p), 1.0 / R, device=device))
    return out


def step_inputs(b, h, p, n, dtype, device, seed=0) -> dict:
    """One decode token's raw projections (the layer's in_proj output, split): x, z (b, h, p), B / C (b, 1, n)
    RMS-normed, dt / A (b, h) before their softplus with dt_bias (h,) and A_floor, trap before its sigmoid,
    angles (b, n / 4) before pi * tanh; D and the B / C biases."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, device=device, dtype=dt, generator=gen)  # noqa: E731
    bc = lambda: (F.normalize(r(b, 1, n).float(), dim=-1) * n ** 0.5).to(dtype)  # noqa: E731
    return dict(x=r(b, h, p), z=r(b, h, p), B=bc(), C=bc(), dt=r(b, h), dt_bias=r(h, dt=torch.float32) - 3,
                A=r(b, h), A_floor=1e-4, trap=r(b, h), angles=r(b, n // 4), D=torch.ones(h, device=device),
                B_bias=torch.ones(h, n, device=device), C_bias=torch.ones(h, n, device=device))


def grad_names(inputs: dict) -> tuple[str, ...]:
    return tuple(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point())


def case_name(shape) -> str:
    b, L, h, p, n, R = shape
    return ("MIMO R{} ".format(R) if R > 1 else "") + f"b{b} L{L} h{h} p{p} n{n}"


def _collector(on_row):
    """-> (rows, keep): ``keep(new_rows)`` appends them and hands each to ``on_row`` (when given) at once."""
    rows = []

    def keep(new):
        for r in new:
            rows.append(r)
            if on_row is not None:
                on_row(r)
    return rows, keep


def run_scan(shapes, sides, dtype, device, warmup, reps, log=say, deadline=None, on_row=None) -> list[dict]:
    """Every shape x mode x side -> rows, each logged (and handed to ``on_row``) as soon as it is measured; a
    shape's start is logged before its first call compiles (a cut run shows where it was); rows not started
    before ``deadline`` passed are skipped."""
    rows, keep = _collector(on_row)

    for shape in shapes:
        case = case_name(shape)
        why = kernels.not_startable(deadline)
        if why:
            keep(kernels.skipped_rows(case, sides, why=why, section="scan"))
            log(f"mamba3 scan {case}: {why}")
            continue
        log(f"mamba3 scan {case}: timing {', '.join(sides)} (a new shape compiles and autotunes first)")
        inputs = scan_inputs(*shape, DTYPES[dtype], device)
        dy, names = torch.randn_like(inputs["x"]), grad_names(inputs)
        for mode in kernels.MODES:
            why = kernels.not_startable(deadline)
            if why:
                keep(kernels.skipped_rows(case, sides, modes=(mode,), why=why, section="scan"))
                log(f"mamba3 scan {case} {kernels.MODE_LABELS[mode]}: {why}")
                continue
            timed = kernels.time_sides(sides, inputs, names, device, dy, modes=(mode,), warmup=warmup, reps=reps)
            new = kernels.rows_for_case(case, timed, section="scan")
            for r in new:
                log(f"mamba3 scan {r['case']} {r['metric']}: " + ", ".join(f"{s} {r.get(s)}" for s in sides))
            keep(new)
        del inputs, dy
        if torch.device(device).type == "cuda" and not kernels.context_lost():
            torch.cuda.empty_cache()
    return rows


def per_call_ms(fn, device, warmup: int, reps: int, calls: int = 20) -> float:
    """Milliseconds per call of ``fn``: ``calls`` calls captured in one CUDA graph, replayed (generation's way)."""
    if torch.device(device).type != "cuda":
        return median_ms(fn, device, warmup, reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()  # compiles / autotunes outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return statistics.median(time_calls(graph.replay, device, 2, reps)) / calls


def run_step(shapes, sides, dtype, device, warmup, reps, log=say, deadline=None, on_row=None) -> list[dict]:
    from mamba_parallel.ops.mamba3 import Mamba3State

    rows, add = _collector(on_row)
    keep = lambda row: add([row])  # noqa: E731

    for b, h, p, n in shapes:
        why = kernels.not_startable(deadline)
        if why:
            keep(make_row(f"b{b} h{h} p{p} n{n}", "decode step", "us", "lower", {s: None for s in sides},
                          {s: why for s in sides}, section="step"))
            log(f"mamba3 step b{b} h{h} p{p} n{n}: {why}")
            continue
        log(f"mamba3 step b{b} h{h} p{p} n{n}: timing {', '.join(sides)}")
        tok = step_inputs(b, h, p, n, DTYPES[dtype], device)
        times, errors = {}, {}
        for name, step in sides.items():
            state = Mamba3State(torch.zeros(b, h, n // 4, device=device), torch.zeros(b, h, p, n, device=device),
                                torch.zeros(b, h, n, device=device), torch.zeros(b, h, p, device=device,
                                                                                 dtype=DTYPES[dtype]))
            try:
                with torch.no_grad():
                    times[name] = per_call_ms(lambda: step(state, **tok), device, warmup, reps) * 1e3
                errors[name] = None
            except Exception as e:  # recorded in the row; the table goes on
                times[name], errors[name] = None, error_text(e)
                kernels.after_failure(name, device)
        row = make_row(f"b{b} h{h} p{p} n{n}", "decode step", "us", "lower", times, errors, section="step")
        log(f"mamba3 step {row['case']}: " + ", ".join(f"{s} {row.get(s)}" for s in sides))
        keep(row)
    return rows


def run_layer(shapes, layers, dtype, device, warmup, reps, log=say, deadline=None, on_row=None) -> list[dict]:
    """Both sides' Mamba3 mixer with the same weights (ours' state dict loaded into the peer's); rows logged as
    they are measured, as in ``run_scan``."""
    from mamba_parallel.layers.mamba3 import Mamba3

    cuda = torch.device(device).type == "cuda"
    rows, keep = _collector(on_row)

    for d_model, b, L in shapes:
        case = f"layer d_model {d_model} b{b} L{L}"
        why = kernels.not_startable(deadline)
        if why:
            keep(kernels.skipped_rows(case, layers, ("fwd", "fwd+bwd"), why=why, section="layer"))
            log(f"mamba3 {case}: {why}")
            continue
        log(f"mamba3 {case}: timing {', '.join(layers)}")
        x = torch.randn(b, L, d_model, device=device)
        torch.manual_seed(0)
        ours = Mamba3(d_model, layer_idx=0, device=device)
        built = {"ours": ours}
        for name, cls in layers.items():
            if name != "ours":
                built[name] = cls(d_model, layer_idx=0, device=device)
                built[name].load_state_dict(ours.state_dict())
        calls = {}
        for name, layer in built.items():
            def fwd(layer=layer):
                with torch.autocast(torch.device(device).type, dtype=DTYPES[dtype], enabled=cuda):
                    return layer(x)

            def both(layer=layer):  # every parameter's gradient too, as a training step computes them
                fwd(layer).float().square().mean().backward()
                layer.zero_grad(set_to_none=True)
            calls[name] = {"fwd": fwd, "fwd+bwd": both}
        for mode in ("fwd", "fwd+bwd"):
            why = kernels.not_startable(deadline)
            if why:
                keep(kernels.skipped_rows(case, layers, (mode,), why=why, section="layer"))
                log(f"mamba3 {case} {kernels.MODE_LABELS[mode]}: {why}")
                continue
            timed = kernels.time_in_turns({name: {mode: c[mode]} for name, c in calls.items()}, device, warmup,
                                          reps)
            new = kernels.rows_for_case(case, timed, section="layer")
            for r in new:
                log(f"mamba3 {r['case']} {r['metric']}: " + ", ".join(f"{s} {r.get(s)}" for s in built))
            keep(new)
        del built, ours, x, calls
        if cuda and not kernels.context_lost():
            torch.cuda.empty_cache()
    return rows


def run(peer, device, dtype="bf16", sections=SECTIONS, scan_shapes=SCAN_SHAPES, step_shapes=STEP_SHAPES,
        layer_shapes=LAYER_SHAPES, warmup=3, reps=10, log=say, deadline=None, save=None) -> dict:
    """The chosen sections -> the result's settings and rows (see results.py); what is not started before
    ``deadline`` (timing.Deadline) passed is listed as skipped. ``save(result)``: called after every row with the
    result so far (``ResultFile`` writes it), so a run cut short leaves what it measured."""
    from mamba_parallel.layers.mamba3 import Mamba3

    theirs = None
    if peer is not None:
        try:
            theirs = mamba3_side(peer)
        except PeerUnavailable as e:
            log(f"peer: {e}; timing ours alone")
    with_peer = lambda ours, attr: {"ours": ours, **({"peer": getattr(theirs, attr)} if theirs else {})}  # noqa
    rows = []
    result = {"bench": "mamba3", "title": "Mamba-3 scan, decode step and layer",
              "settings": {"dtype": dtype, "chunk_size": CHUNK, "mimo_chunk_size": MIMO_CHUNK, "warmup": warmup,
                           "reps": reps, "sections": list(sections),
                           "inputs": "a Mamba-3 layer's raw scan inputs; each side's preparation timed with it",
                           "sides": ["ours"] + (["peer"] if theirs else [])},
              "rows": rows}

    def keep(row):
        rows.append(row)
        if save is not None:
            save(result)

    if "scan" in sections:
        run_scan(scan_shapes, with_peer(ours_scan, "scan"), dtype, device, warmup, reps, log, deadline, keep)
    if "step" in sections:
        run_step(step_shapes, with_peer(ours_step, "step"), dtype, device, warmup, reps, log, deadline, keep)
    if "layer" in sections:
        run_layer(layer_shapes, with_peer(Mamba3, "layer"), dtype, device, warmup, reps, log, deadline, keep)
    return result


class ResultFile:
    """``save`` for ``run``: writes the result so far as a run's JSON, always to the file the first write picked
    (``results.write_result``: ``path`` a .json file or a results folder), marked ``"partial": true``; ``publish``
    to ``.path`` then replaces it with the whole result. No ``path``: writes nothing."""

    def __init__(self, device, peer, path, git_commit: str | None = None):
        self.device, self.peer, self.target, self.git_commit = device, peer, path, git_commit
        self.path = None
        self._meta = None

    def __call__(self, result: dict) -> None:
        if not self.target:
            return
        if self._meta is None:  # once: the commit and versions do not change during a run
            self._meta = run_metadata(self.device, side_versions(self.peer), git_commit=self.git_commit)
        self.path = write_result({**result, "partial": True, "meta": self._meta,
                                  "side_names": side_names(self.peer)}, self.path or self.target)

    def final(self):
        """Where ``publish`` writes the whole result: the partial file when there is one."""
        return self.path or self.target


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench mamba3", description=__doc__.splitlines()[0])
    peer_mod.add_peer_flags(ap)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to time: the scan kernels, the decode step, the whole layer (default: all)")
    ap.add_argument("--scan-shape", type=int, nargs=6, action="append", metavar=("B", "L", "H", "P", "N", "R"),
                    help="a scan shape to time (repeatable; R = 1: SISO, R > 1: MIMO of rank R; default: the "
                         "standard ones)")
    kernels.add_device_flags(ap)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a, device, peer, deadline = kernels.parse_run_args(ap, argv)
    for shape in a.scan_shape or ():
        if min(shape) < 1 or shape[4] % 2:
            ap.error(f"--scan-shape {' '.join(map(str, shape))}: every size must be positive and N (d_state) even")
    partial = ResultFile(device, peer, a.json, git_commit=a.git_commit)
    result = run(peer, device, a.dtype, a.sections, scan_shapes=[tuple(s) for s in a.scan_shape or SCAN_SHAPES],
                 warmup=a.warmup, reps=a.reps, deadline=deadline, save=partial)
    publish(result, device, peer, None, partial.final(), git_commit=a.git_commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
