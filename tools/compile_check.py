"""Compile every Triton kernel an op launches for sm_90 on a machine without a GPU: catches what the CPU interpreter
lets through (globals that are not constexpr, dot shapes, type mismatches, too much shared memory) before a GPU run.

    python tools/compile_check.py [--ops mamba3 norm layout selective_scan ssd decode_step]
                                  [--workloads variants tiles tiny]
                                  [--kernels NAME ...] [--arch 90] [--max-shared BYTES] [--ptx-hash] [--sass]
                                  [--compile-python EXE]

Step one runs each op's forward and backward (and its decode step) in the CPU interpreter and records every kernel
launch: the kernel, its argument types and values, its constexprs, and for an autotuned kernel the GPU candidates
it would choose from (they depend on the operand dtype). Step two, in a fresh process without the interpreter,
compiles each recorded launch with Triton's real compiler for the target GPU, an autotuned one with every GPU
candidate instead of the interpreter's config, and prints per compile the shared memory it needs, its registers
per thread and its stack bytes (spills). It fails when a compile fails or a candidate needs more shared memory
than the target has (232448 bytes on sm_90): the launch would raise OutOfResources there. Triton's wheel bundles
ptxas and cuobjdump, so this runs the whole pipeline to a cubin. The selective scan plans its launches for the GPU
it runs on (chunk, layout, unrolled states), so its launches are recorded as an H100 / H200 (132 SMs) would plan
them, without running them. ``--ptx-hash`` adds a hash of each launch's PTX (line info, comments and parameter
names left out): equal hashes before and after a change mean the change leaves that GPU code as it was. ``--sass``
adds each launch's SASS instruction counts (all, shuffles, barriers, shared- and global-memory ops, MUFU, fp32
arithmetic, warp tensor-core ops (mma: HMMA) and Hopper's warpgroup ones (wgmma: HGMMA), local-memory spill traffic;
tools/sass_report.py's): a change's cost in instructions and barriers, compared before and after without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- step one: record the launches in the interpreter ------------------------------------------------------------
WORKLOADS = ("variants", "tiles", "tiny")


def _workloads(ops, which=("variants", "tiles"), rec=None):
    """variants: every kernel variant (SISO / MIMO, groups, fewer rotated pairs, a bare scan, d_state 64 and 128,
    the decode step) on small tiles, bf16 and fp32; tiles: the tiles the layers run (d_state 128, headdim 64,
    64-row chunks: SISO chunk 64, MIMO rank 4 chunk 16) in fp32, fp16 and bf16, with and without gradients, the
    largest shared memory;
    tiny: one small fp32 scan (a quick check of this tool)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    if "norm" in ops:
        yield from _norm_workloads()
    if "layout" in ops:
        yield from _layout_workloads()
    if "selective_scan" in ops:
        yield from _selective_scan_workloads(rec, which)
    if "ssd" in ops:
        yield from _ssd_workloads()
    if "decode_step" in ops:
        yield from _decode_step_workloads()
    if "mamba3" not in ops:
        return
    from mamba3_cases import make_inputs

    from mamba_parallel.ops.mamba3 import Mamba3Discretization, Mamba3State, triton_impl

    def scan(n, kw, dtype, L=70, p=64, chunk=32, rope="interleaved", inference=False):
        args = make_inputs(1, L, 2, p, n, dtype=dtype, **kw)
        if inference:  # the forward without gradients keeps nothing for a backward (another variant)
            with torch.no_grad():
                triton_impl.mamba3_chunk_scan(**args, chunk_size=chunk, rope=rope, return_final_states=True)
        for t in args.values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.requires_grad_(True)
        y, _ = triton_impl.mamba3_chunk_scan(**args, chunk_size=chunk, rope=rope, return_final_states=True)
        y.float().sum().backward()
        return f"mamba3 chunk scan n{n} p{p} chunk {chunk} {kw} {dtype}"

    if "tiny" in which:
        yield scan(16, dict(), torch.float32, L=20, p=16, chunk=16)
    if "tiles" in which:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            yield scan(128, dict(expand_angles=True), dtype, chunk=64, inference=True)
            yield scan(128, dict(R=4, expand_angles=True), dtype, chunk=16, rope="halved", inference=True)
    if "variants" not in which:
        return
    # d_state 64, the default 128 (the backward then takes its pairs in blocks), and a bare scan (no D, gate,
    # biases or initial states)
    cases = [(64, kw, dtype) for kw in (dict(), dict(R=2), dict(g=2, a=16))
             for dtype in (torch.bfloat16, torch.float32)] + [(128, dict(), torch.bfloat16)] + \
        [(64, dict(D=False, z=False, bias=False, init=False), torch.bfloat16)]
    for n, kw, dtype in cases:
        yield scan(n, kw, dtype)
    seqwise = ("x", "dt", "A", "B", "C", "trap", "angles", "z")
    for kw in (dict(), dict(R=2), dict(R=4, mimo_o=False)):
        for dtype in (torch.bfloat16, torch.float32):
            args = make_inputs(2, 1, 2, 64, 64, dtype=dtype, **kw)
            step = {k: (v[:, 0] if k in seqwise else v) for k, v in args.items() if k != "initial_states"}
            state = Mamba3State(*(s.float().clone() for s in args["initial_states"]))
            raw = Mamba3Discretization(torch.zeros(2), 1e-4)  # a layer's raw projections, discretized inside
            for rope in ("interleaved", "halved"):
                triton_impl.mamba3_state_update(state, **step, rope=rope)
                triton_impl.mamba3_state_update(state, **step, rope=rope, discretize=raw)
            yield f"mamba3 decode step {kw} {dtype}"


def _norm_workloads():
    """Mamba-2's gated norm alone and with out_proj (its backward also writes the norm output, STORE_Y) at the
    mamba2-1.3b / 2.7b widths (d_inner 4096 / 5120, one group or four), the gate on either side, and the block's
    residual norm, in fp32, fp16 and bf16."""
    import torch

    from mamba_parallel.ops.norm import triton_impl as norm

    for d, e, gs in ((4096, 2048, None), (5120, 2560, None), (5120, 2560, 1280)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for nbg in (False, True):
                x, z = (torch.randn(6, d, dtype=dtype, requires_grad=True) for _ in range(2))
                w = torch.ones(d, dtype=dtype, requires_grad=True)
                W = torch.randn(e, d, dtype=dtype, requires_grad=True)
                norm.gated_rms_norm_linear(x, z, w, W, None, 1e-5, gs, nbg).float().sum().backward()
                norm.gated_rms_norm(x, z, w, 1e-5, gs, nbg).float().sum().backward()
                yield f"gated norm (+ linear) d{d} group {gs} norm_before_gate {nbg} {dtype}"
            x, r = torch.randn(6, e, dtype=dtype, requires_grad=True), torch.randn(6, e, requires_grad=True)
            y, res = norm.add_rms_norm(x, r, torch.ones(e, dtype=dtype, requires_grad=True), 1e-5, True)
            (y.float().sum() + res.sum()).backward()
            yield f"add_rms_norm d{e} {dtype}"


def _ssd_workloads():
    """The Mamba-2 SSD forward and backward at a layer's tiles (headdim 64, d_state 128 and 64, chunk 256, two
    chunks) in bf16 and fp32, with initial states and a gate, and with restarts (seq_idx)."""
    import torch

    from mamba_parallel.ops.ssd import triton_impl as ssd

    for n in (128, 64):
        for dtype in (torch.bfloat16, torch.float32):
            for restarts in (False, True):
                g = torch.Generator().manual_seed(0)
                L, h = 300, 2
                args = dict(x=torch.randn(1, L, h, 64, generator=g).to(dtype), dt=torch.randn(1, L, h).to(dtype),
                            A=-torch.rand(h), B=torch.randn(1, L, 1, n).to(dtype),
                            C=torch.randn(1, L, 1, n).to(dtype), D=torch.randn(h),
                            z=torch.randn(1, L, h, 64).to(dtype), dt_bias=torch.randn(h),
                            initial_states=torch.randn(1, h, 64, n))
                for t in args.values():
                    t.requires_grad_(True)
                seq_idx = (torch.arange(L) >= 256).to(torch.int32)[None] if restarts else None
                y, final = ssd.ssd_chunk_scan(**args, chunk_size=256, dt_softplus=True, seq_idx=seq_idx,
                                              return_final_states=True)
                (y.float().sum() + final.sum()).backward()
                yield f"ssd n{n} {dtype} restarts {restarts}"
                # the forward's states for few (row, head) pairs: computed in parallel, then chained
                sweep, ssd.sweep_states = ssd.sweep_states, lambda pairs, device: False
                try:
                    with torch.no_grad():
                        ssd.ssd_chunk_scan(**args, chunk_size=256, dt_softplus=True, seq_idx=seq_idx)
                finally:
                    ssd.sweep_states = sweep
                yield f"ssd n{n} {dtype} restarts {restarts}, parallel states"


def _layout_workloads():
    """Mamba-1's gate (forward, backward, and the fused layer's backward gate: y's gradient dgated * silu(z) from
    channel-contiguous views into a token-major buffer) and the token-major copy at mamba-2.8b's d_inner."""
    import torch

    from mamba_parallel.ops.layout import triton_impl as layout

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        y = torch.randn(1, 5120, 70, dtype=dtype)
        z = torch.randn(1, 70, 5120, dtype=dtype).transpose(1, 2)
        out = layout._gate_fwd(y, z)
        layout._gate_bwd(torch.randn_like(out), y, z, torch.empty_like(z))
        layout._gate_into(torch.randn_like(out).transpose(1, 2), z, torch.empty_like(y))
        layout.token_major(z)
        yield f"silu gate, token-major copy {dtype}"


def _decode_step_workloads():
    """The fused decode step's stages at mamba2-2.7b's widths (d_model 2560, 80 heads of 64, one group, d_state
    128) and Mamba-1's at mamba-2.8b's, batch 1, bf16 weights and conv state, fp32 SSM state and residual."""
    import torch

    from mamba_parallel.ops.decode_step import triton_impl as step

    d_model, h, p, g, n, dc = 2560, 80, 64, 1, 128, 4
    di, bf = h * p, torch.bfloat16
    conv_dim, N = di + 2 * g * n, 2 * di + 2 * g * n + h
    res = torch.randn(1, d_model)
    out = step.norm_in_proj_conv(res, torch.ones(d_model, dtype=bf), 1e-5, torch.randn(N, d_model, dtype=bf) * 0.02,
                                 None, torch.randn(conv_dim, dc, dtype=bf), torch.randn(conv_dim, dtype=bf),
                                 torch.zeros(1, conv_dim, dc - 1, dtype=bf), di)
    z, xBC, dt = out.split([di, conv_dim, h], dim=-1)
    x, B, C = xBC.split([di, g * n, g * n], dim=-1)
    gw, ss = step.state_update_gate(torch.zeros(1, h, p, n), x.view(1, h, p), dt, -torch.rand(h), B.view(1, g, n),
                                    C.view(1, g, n), torch.ones(h), z.view(1, h, p), torch.zeros(h), (0.0, 1e9),
                                    torch.ones(di, dtype=bf), 1)
    step.gated_out_proj_residual(gw, ss, 1e-5, torch.randn(d_model, di, dtype=bf) * 0.02, None, res)
    yield "fused Mamba-2 decode step, mamba2-2.7b widths, bf16"
    # Mamba-1 at mamba-2.8b's widths (d_inner 5120, d_state 16, dt_rank 160): x_proj split over K, the state stage
    di, n, r = 5120, 16, 160
    x, z = torch.randn(1, di, dtype=bf), torch.randn(1, di, dtype=bf)
    y = step.mamba1_x_proj_state_update(torch.zeros(1, di, n), x, z, torch.randn(r + 2 * n, di, dtype=bf) * 0.02,
                                        torch.randn(di, r, dtype=bf) * 0.1, torch.zeros(di, dtype=bf),
                                        -torch.rand(di, n), torch.ones(di, dtype=bf))
    step.gated_out_proj_residual(y, None, 0.0, torch.randn(d_model, di, dtype=bf) * 0.02, None, res)
    yield "fused Mamba-1 decode stages, mamba-2.8b widths, bf16"


def _selective_scan_workloads(rec, which):
    """The Mamba-1 scan's forward and backward launches as a 132-SM GPU plans them (recorded, not run: their GPU
    code does not run in the interpreter): tiles: mamba-1.4b's d_inner 4096 and n 16 at batch 2 and 8 (the two
    default paths), bf16 with its default bf16 checkpoints and with one fp32 checkpoint per 8 chunks; variants:
    every path with fp32 and bf16 checkpoints, fp32 and fp16 inputs, packed sequences and restarts, n 32."""
    import torch

    from mamba_parallel.ops.selective_scan import launch
    from mamba_parallel.ops.selective_scan import triton_impl as scan

    class Recorded:
        def __init__(self, kernel):
            self.fn = kernel.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: rec.launches.append(dict(rec.describe(self.fn, args, kwargs), tuned=None))

    saved = {k: getattr(scan, k) for k in ("gpu_compiled", "_sms", "selective_scan_fwd_kernel",
                                           "selective_scan_bwd_kernel", "adjoint_carry_kernel", "finish_bwd")}
    scan.gpu_compiled, scan._sms = (lambda u: True), (lambda u: 132)
    scan.selective_scan_fwd_kernel = Recorded(saved["selective_scan_fwd_kernel"])
    scan.selective_scan_bwd_kernel = Recorded(saved["selective_scan_bwd_kernel"])
    scan.adjoint_carry_kernel = Recorded(saved["adjoint_carry_kernel"])
    scan.finish_bwd = lambda *args, **kwargs: None

    def run(b, dtype, path=None, n=16, every=1, ckpt_dtype=None, mode=None, d=4096, L=2048, layer=False):
        """layer: as the Mamba-1 training node runs the scan (its forward, on the paths that gate inside, reads z
        as a channel-contiguous view and writes the gated y channels-last; its backward takes z and the gated
        output's gradient as such views and writes dz, the gate's output and du through them)."""
        g = torch.Generator().manual_seed(0)
        u, dt, z = (torch.randn(b, d, L, generator=g).to(dtype) for _ in range(3))
        if layer:
            z = torch.randn(b, L, 2 * d, generator=g).to(dtype)[..., d:].transpose(1, 2)
        A, B, C = -torch.rand(d, n), torch.randn(b, 1, n, L), torch.randn(b, 1, n, L)
        sid, varlen, nstates = None, mode == "cu_seqlens", b
        if mode is not None:  # restarts / packed sequences: a per-token sequence id
            sid = (torch.arange(L) * 3 // L).to(torch.int32).expand(b, L).contiguous()
            nstates = 3 if varlen else b
        path = scan.scan_path(u, dt, None if layer else z, A, B, varlen, path)
        ckpt_dtype = ckpt_dtype or scan.default_checkpoint_dtype(u, every)
        gate = {}
        if layer:
            tm = lambda: torch.empty(b, L, d, dtype=dtype).transpose(1, 2)  # noqa: E731
            if launch.gates_in_forward(path):
                ck = scan.gated_forward(u, dt, A, B, C, torch.randn(d), z, torch.randn(d), sid, path, tm(),
                                        checkpoint_every=every, checkpoint_dtype=ckpt_dtype)
            else:  # y token-major, the layout op's gate after it
                ck = scan.scan_forward(u, dt, A, B, C, torch.randn(d), None, torch.randn(d), None, sid, True, False,
                                       b, True, path, checkpoint_every=every, checkpoint_dtype=ckpt_dtype)[2]
            gate = dict(dgated=tm(), dz_out=torch.empty(b, L, 2 * d, dtype=dtype)[..., d:].transpose(1, 2),
                        gated_out=tm(), du_out=tm())
        else:
            _, _, ck = scan.scan_forward(u, dt, A, B, C, torch.randn(d), z, torch.randn(d), None, sid, True, varlen,
                                         nstates, True, path, checkpoint_every=every, checkpoint_dtype=ckpt_dtype)
        scan.scan_backward(u, dt, A, B, C, torch.randn(d), z, torch.randn(d), None, sid, ck, torch.randn_like(u),
                           None, True, varlen, path, checkpoint_every=every, **gate)
        return f"selective scan b{b} n{n} {path} {dtype} K{every} {ckpt_dtype} {mode or ''}{' layer' * layer}".rstrip()

    try:
        if "tiles" in which:
            for b in (2, 8):
                yield run(b, torch.bfloat16)
                yield run(b, torch.bfloat16, every=8)
                yield run(b, torch.bfloat16, layer=True)
        if "variants" in which:
            for path in launch.FORWARD_PATHS:
                for ckpt_dtype in (torch.float32, torch.bfloat16):
                    yield run(2, torch.bfloat16, path, ckpt_dtype=ckpt_dtype)
            for dtype in (torch.float32, torch.float16):
                yield run(2, dtype)
            for mode in ("seq_idx", "cu_seqlens"):
                yield run(1 if mode == "cu_seqlens" else 2, torch.bfloat16, mode=mode)
            yield run(2, torch.bfloat16, n=32)
    finally:
        for k, v in saved.items():
            setattr(scan, k, v)


class Recorder:
    def __init__(self):
        self.launches, self.tag = [], None

    def install(self):
        from triton.runtime import interpreter

        from mamba_parallel.ops import tuning

        rec = self
        run = interpreter.InterpretedFunction.run

        def recording_run(fn_self, *args, grid, warmup, **kwargs):
            rec.launches.append(dict(rec.describe(fn_self.fn, args, kwargs), tuned=rec.tag))
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        interpreter.InterpretedFunction.run = recording_run
        call = tuning.Tuner.__call__

        def recording_call(tuner, kernel, name, dtype=None):
            # the GPU candidates of this launch (they depend on the tuner entry and the operand dtype)
            # and the interpreter config's block names: a GPU candidate without one of them takes the kernel's default
            tag = {"name": name, "gpu": [_config(c) for c in tuner.candidates(name, dtype)],
                   "interp": sorted(tuner.table[name][1].kwargs)}
            return _Tagged(call(tuner, kernel, name, dtype), rec, tag)

        tuning.Tuner.__call__ = recording_call

    @staticmethod
    def describe(fn, args, kwargs) -> dict:
        import inspect

        import torch

        names = list(inspect.signature(fn).parameters)
        values = dict(zip(names, args))
        values.update({k: v for k, v in kwargs.items() if k in names})
        out = {}
        for k, v in values.items():
            if isinstance(v, torch.Tensor):
                out[k] = {"ptr": str(v.dtype).replace("torch.", ""), "aligned": v.data_ptr() % 16 == 0}
            elif hasattr(v, "value") and type(v).__name__ == "constexpr":
                out[k] = {"value": v.value}
            elif isinstance(v, (bool, int, float, str)) or v is None:
                out[k] = {"value": v}
            elif hasattr(v, "primitive_bitwidth") or "dtype" in type(v).__name__:
                out[k] = {"tl_dtype": str(v)}
            else:
                out[k] = {"value": repr(v)}
        options = {k: v for k, v in kwargs.items() if k not in names}
        return {"kernel": f"{fn.__module__}.{fn.__name__}", "args": out, "options": options}


class _Tagged:
    """An autotuned kernel whose launches the recorder tags with their GPU candidates."""

    def __init__(self, fn, rec, tag):
        self.fn, self.rec, self.tag = fn, rec, tag

    def __getattr__(self, name):  # the autotuner's own attributes (e.g. its configs)
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.rec.tag = self.tag
            try:
                return self.fn[grid](*args, **kwargs)
            finally:
                self.rec.tag = None
        return launch


def _config(c) -> dict:
    return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
            "maxnreg": getattr(c, "maxnreg", None)}


# constexpr switches a launcher sets only for compiled GPU code (ops.backend.gpu_compiled: inline PTX such as the
# MUFU exp / cos / sin); the interpreter runs with them off, the GPU would compile them on
GPU_ONLY_FLAGS = ("FAST", "FAST_EXP")


def record(ops, path, which):
    os.environ["TRITON_INTERPRET"] = "1"
    rec = Recorder()
    rec.install()
    done = [w for w in _workloads(ops, which, rec)]
    for launch in rec.launches:
        for flag in GPU_ONLY_FLAGS:
            if flag in launch["args"]:
                launch["args"][flag]["value"] = True
    with open(path, "w") as f:
        json.dump({"workloads": done, "launches": rec.launches}, f)


# ---- step two: compile each one for the GPU ----------------------------------------------------------------------
TL_DTYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "float64": "*fp64", "int32": "*i32",
             "int64": "*i64", "int8": "*i8", "uint8": "*u8", "bool": "*i1"}


def _jit(name):
    import importlib

    from triton.runtime.jit import JITFunction

    module, attr = name.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), attr)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def compile_one(launch, config, arch):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    fn = _jit(launch["kernel"])
    args = dict(launch["args"])
    options = dict(launch["options"])
    if config is not None:
        for k in (launch.get("tuned") or {}).get("interp", ()):
            args.pop(k, None)
        args.update({k: {"value": v} for k, v in config["kwargs"].items()})
        options.update(num_warps=config["num_warps"], num_stages=config["num_stages"])
        if config.get("maxnreg"):
            options["maxnreg"] = config["maxnreg"]
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        a = args.get(p.name)
        if a is None:
            constexprs[p.name] = p.default
            signature[p.name] = "constexpr"
        elif p.is_constexpr or "tl_dtype" in a:
            v = a.get("value") if "tl_dtype" not in a else getattr(tl, a["tl_dtype"].replace("tl.", ""))
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif "ptr" in a:
            signature[p.name] = TL_DTYPES[a["ptr"]]
            if a["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            v = a["value"]
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
                signature[p.name], constexprs[p.name] = "constexpr", v
            elif isinstance(v, bool):
                signature[p.name] = "i1"
            elif isinstance(v, int):
                signature[p.name] = "i64" if abs(v) >= 2**31 else "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[p.name] = "fp32"
    opts = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "maxnreg")}
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


# shared memory one program may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), per compute capability
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (spills live there) of a cubin, from the bundled cuobjdump."""
    import re

    import sass_report  # imports triton: not at the top, the recording step sets the interpreter up first

    out = sass_report.cuobjdump(cubin, "--dump-resource-usage", check=False)
    found = {k: re.search(rf"\b{k}:(\d+)", out) for k in ("REG", "STACK")}
    return {k.lower(): int(m.group(1)) if m else -1 for k, m in found.items()}


SHOWN = ("T", "R", "BH", "BP", "HALVED", "OUTPUTS", "STATES", "KEEP_YPRE", "HAS_MO",  # constexprs named per line
         "HAS_Z", "NORM_BEFORE_GATE", "HAS_RES", "STORE_DX2", "STORE_Y", "STORE_OUT", "BLOCK_N",
         "LANES", "LANE_SUM", "NS", "VARLEN", "CK", "CKPT_APART")


def _label(launch, config) -> str:
    a = launch["args"]
    first = next((v["ptr"] for v in a.values() if "ptr" in v), "?")  # the kernel's first pointer: its operand
    shown = " ".join(f"{k}={a[k]['value']}" for k in SHOWN if k in a and "value" in a[k])
    cfg = "" if config is None else " ".join([*(f"{k}={v}" for k, v in config["kwargs"].items()),
                                               f"warps={config['num_warps']}", f"stages={config['num_stages']}",
                                               *([f"maxnreg={config['maxnreg']}"] if config.get("maxnreg") else [])])
    kernel = launch["kernel"].rsplit(".", 1)[1]
    tuner = f"[{launch['tuned']['name']}]" if launch.get("tuned") else ""
    return f"{kernel}{tuner} {first} {shown} | {cfg}".rstrip(" |")


def ptx_hash(ptx: str) -> str:
    """12 hex digits of a PTX text without what changes with no change to the code: line info, comments, labels,
    debug sections and the parameter lines (their names)."""
    import hashlib
    import re

    skip = re.compile(r"\s*(\.loc|\.file|//|\$L__|\.section|\.b8|\.b32|\.b64|\.debug)")
    kept = "\n".join(ln for ln in ptx.splitlines() if not skip.match(ln) and "param" not in ln)
    return hashlib.sha1(kept.encode()).hexdigest()[:12]


def compile_all(path, arch, max_shared=None, kernels=None, show_hash=False, show_sass=False) -> int:
    """Compile every recorded launch with each of its GPU candidates; one line per compile with its shared memory,
    registers and stack (and ``ptx_hash`` with ``show_hash``). Fails when a compile fails or a candidate needs more
    shared memory than ``max_shared`` (default: the arch's, MAX_SHARED): the autotuner would drop it there, and an
    untuned launch would skip it."""
    import sass_report  # imports triton: here, in the compiling process, not at the module's top

    limit = max_shared or MAX_SHARED.get(arch)
    data = json.load(open(path))
    seen, failures = set(), []
    for launch in data["launches"]:
        tuned = launch.get("tuned")
        name = launch["kernel"].rsplit(".", 1)[1] + (f"[{tuned['name']}]" if tuned else "")
        if kernels and not any(k in name for k in kernels):
            continue
        configs = tuned["gpu"] if tuned else [None]
        if tuned:  # the interpreter's config kwargs give way to each GPU candidate's
            launch = dict(launch, options={k: v for k, v in launch["options"].items()
                                           if k not in ("num_warps", "num_stages")})
        for config in configs:
            key = json.dumps([{k: v for k, v in launch.items() if k != "tuned"}, config], sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            label = _label(launch, config)
            try:
                kernel = compile_one(launch, config, arch)
            except Exception as e:
                failures.append(f"{label}: {type(e).__name__}: {str(e)[:2000]}")
                continue
            shared = int(kernel.metadata.shared)
            use = resource_usage(kernel.asm["cubin"])
            digest = f", ptx {ptx_hash(kernel.asm['ptx'])}" if show_hash else ""
            if show_sass:
                found = sass_report.counts(sass_report.sass_lines(kernel.asm["cubin"]))
                digest += ", sass " + " ".join(f"{k} {v}" for k, v in found.items())
            print(f"{label}: shared {shared} B, {use['reg']} registers, stack {use['stack']} B{digest}", flush=True)
            if limit is not None and shared > limit:
                failures.append(f"{label}: needs {shared} B of shared memory, sm_{arch} has {limit} B")
    print(f"compile_check: {len(seen)} kernel launches compiled for sm_{arch}, {len(failures)} failed"
          + (f" (shared memory limit {limit} B)" if limit else ""))
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["mamba3"],
                    choices=["mamba3", "norm", "layout", "selective_scan", "ssd", "decode_step"],
                    help="the ops whose launches to record and compile (those with a workload here)")
    ap.add_argument("--workloads", nargs="+", default=["variants", "tiles"], choices=WORKLOADS,
                    help="which launches to record (see _workloads; default: variants and tiles)")
    ap.add_argument("--kernels", nargs="+", metavar="NAME", default=None,
                    help="compile only the launches whose kernel[tuner entry] name contains one of these, e.g. "
                         "chunk_bwd or [states] (default: all)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--max-shared", type=int, default=None, metavar="BYTES",
                    help="fail a candidate needing more shared memory (default: the arch's, e.g. 232448 on sm_90)")
    ap.add_argument("--ptx-hash", action="store_true",
                    help="print a hash of each launch's PTX: the same hash before and after a change, the same code")
    ap.add_argument("--sass", action="store_true",
                    help="print each launch's SASS instruction counts (all, shuffles, barriers, memory ops, ...)")
    ap.add_argument("--compile-python", metavar="EXE", default=sys.executable,
                    help="the Python that compiles (step two), e.g. a venv's with another Triton pinned; the "
                         "launches are recorded with this one's interpreter (default: this Python)")
    ap.add_argument("--record-only", metavar="PATH", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.record_only:
        record(a.ops, a.record_only, a.workloads)
        return 0
    path = os.path.join(tempfile.mkdtemp(prefix="compile-check-"), "launches.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, __file__, "--record-only", path, "--ops", *a.ops, "--workloads", *a.workloads],
                   check=True, env=env)
    env.pop("TRITON_INTERPRET", None)
    cmd = [a.compile_python, __file__, "--compile", path, "--arch", str(a.arch)]
    cmd += ["--max-shared", str(a.max_shared)] if a.max_shared else []
    cmd += ["--kernels", *a.kernels] if a.kernels else []
    cmd += ["--ptx-hash"] if a.ptx_hash else []
    cmd += ["--sass"] if a.sass else []
    return subprocess.run(cmd, env=env).returncode


def _compile_main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", required=True)
    ap.add_argument("--arch", type=int, required=True)
    ap.add_argument("--max-shared", type=int, default=None)
    ap.add_argument("--kernels", nargs="+", default=None)
    ap.add_argument("--ptx-hash", action="store_true")
    ap.add_argument("--sass", action="store_true")
    a = ap.parse_args(argv)
    return compile_all(a.compile, a.arch, a.max_shared, a.kernels, a.ptx_hash, a.sass)


if __name__ == "__main__" and "--compile" in sys.argv:
    raise SystemExit(_compile_main(sys.argv[1:]))
elif __name__ == "__main__":
    raise SystemExit(main())
