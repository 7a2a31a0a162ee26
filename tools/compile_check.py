"""Compile every Triton kernel an op launches for sm_90 on a machine without a GPU: catches what the CPU interpreter
lets through (globals that are not constexpr, dot shapes, type mismatches) before a GPU run.

    python tools/compile_check.py [--ops mamba3 norm layout] [--arch 90] [--usage]

Step one runs each op's forward and backward (and its decode step) on realistic shapes in the CPU interpreter and
records every kernel launch: the kernel, its argument types and values, its constexprs. Step two, in a fresh process
without the interpreter, compiles each recorded launch with Triton's real compiler for the target GPU; an autotuned
kernel is compiled with every GPU candidate configuration instead of the interpreter's one. Triton's wheel bundles
ptxas, so this runs the whole pipeline to a cubin. ``--usage`` also prints each compiled launch's registers per
thread and spill bytes (ptxas -v), e.g. to keep the norm backward's register table (ops/norm/triton_impl.py) true.
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
def _workloads(ops):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    if "mamba3" in ops:
        from mamba3_cases import make_inputs

        from mamba_parallel.ops.mamba3 import triton_impl

        # d_state 64, the default 128 (the backward then takes its pairs in blocks), and a bare scan (no D, gate,
        # biases or initial states)
        cases = [(64, kw, dtype) for kw in (dict(), dict(R=2), dict(g=2, a=16))
                 for dtype in (torch.bfloat16, torch.float32)] + [(128, dict(), torch.bfloat16)] + \
            [(64, dict(D=False, z=False, bias=False, init=False), torch.bfloat16)]
        for n, kw, dtype in cases:
            args = make_inputs(1, 70, 2, 64, n, dtype=dtype, **kw)
            leaves = [v for v in args.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
            for t in leaves:
                t.requires_grad_(True)
            y, _ = triton_impl.mamba3_chunk_scan(**args, chunk_size=32, return_final_states=True)
            y.float().sum().backward()
            yield f"mamba3 chunk scan n{n} {kw} {dtype}"
        from mamba_parallel.ops.mamba3 import Mamba3State

        seqwise = ("x", "dt", "A", "B", "C", "trap", "angles", "z")
        for kw in (dict(), dict(R=2), dict(R=4, mimo_o=False)):
            for dtype in (torch.bfloat16, torch.float32):
                args = make_inputs(2, 1, 2, 64, 64, dtype=dtype, **kw)
                step = {k: (v[:, 0] if k in seqwise else v) for k, v in args.items() if k != "initial_states"}
                state = Mamba3State(*(s.float().clone() for s in args["initial_states"]))
                for rope in ("interleaved", "halved"):
                    triton_impl.mamba3_state_update(state, **step, rope=rope)
                yield f"mamba3 decode step {kw} {dtype}"


    if "norm" in ops:
        from mamba_parallel.ops.norm import triton_impl as norm

        # Mamba-2's gated norm + out_proj at mamba2-1.3b / 2.7b widths (d_inner 4096 / 5120; 4 groups), the gate on
        # either side, and the block's residual norm
        for d, e, gs in ((4096, 2048, None), (5120, 2560, None), (5120, 2560, 1280)):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for nbg in (False, True):
                    x, z = (torch.randn(6, d, dtype=dtype, requires_grad=True) for _ in range(2))
                    w, W = torch.ones(d, dtype=dtype, requires_grad=True), torch.randn(e, d, requires_grad=True)
                    norm.gated_rms_norm_linear(x, z, w, W.to(dtype), None, 1e-5, gs, nbg).float().sum().backward()
                    norm.gated_rms_norm(x, z, w, 1e-5, gs, nbg).float().sum().backward()
                    yield f"gated norm (+ linear) d{d} group {gs} nbg {nbg} {dtype}"
                x, r = torch.randn(6, e, dtype=dtype, requires_grad=True), torch.randn(6, e, requires_grad=True)
                y, res = norm.add_rms_norm(x, r, torch.ones(e, dtype=dtype, requires_grad=True), 1e-5, True)
                (y.float().sum() + res.sum()).backward()
                yield f"add_rms_norm d{e} {dtype}"
    if "layout" in ops:
        from mamba_parallel.ops.layout import triton_impl as layout

        for dtype in (torch.bfloat16, torch.float16, torch.float32):  # Mamba-1's gate at mamba-2.8b's d_inner
            y = torch.randn(1, 5120, 70, dtype=dtype)
            z = torch.randn(1, 70, 5120, dtype=dtype).transpose(1, 2)
            out = layout._gate_fwd(y, z)
            layout._gate_bwd(torch.randn_like(out), y, z, torch.empty_like(z))
            layout._gate_bwd(torch.randn_like(out), y, z, torch.empty_like(z), torch.empty_like(out))
            layout.token_major(z)
            yield f"silu gate, token-major copy {dtype}"


class Recorder:
    def __init__(self):
        self.launches, self.tuned = [], {}

    def install(self):
        from triton.runtime import interpreter

        from mamba_parallel.ops import tuning

        rec = self
        run = interpreter.InterpretedFunction.run

        def recording_run(fn_self, *args, grid, warmup, **kwargs):
            rec.launches.append(rec.describe(fn_self.fn, args, kwargs))
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        interpreter.InterpretedFunction.run = recording_run
        call = tuning.Tuner.__call__

        def recording_call(tuner, kernel, name):
            gpu, interp, _ = tuner.table[name]
            rec.tuned[f"{kernel.fn.__module__}.{kernel.fn.__name__}"] = {
                "gpu": [_config(c) for c in gpu], "interp": _config(interp)}
            return call(tuner, kernel, name)

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


def _config(c) -> dict:
    return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}


def record(ops, path):
    os.environ["TRITON_INTERPRET"] = "1"
    rec = Recorder()
    rec.install()
    done = [w for w in _workloads(ops)]
    with open(path, "w") as f:
        json.dump({"workloads": done, "launches": rec.launches, "tuned": rec.tuned}, f)


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
        args.update({k: {"value": v} for k, v in config["kwargs"].items()})
        options.update(num_warps=config["num_warps"], num_stages=config["num_stages"])
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


def _usage(compiled, launch) -> str:
    """One line: the kernel, its constexprs and warps, registers per thread and spill bytes (ptxas -v)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sass_report import ptxas_usage

    u = ptxas_usage(compiled.asm["ptx"])
    consts = {k: v["value"] for k, v in launch["args"].items() if k.isupper() and v.get("value") is not None}
    dtype = next((v["ptr"] for v in launch["args"].values() if "ptr" in v), "")  # the first pointer's
    return (f"{launch['kernel'].rsplit('.', 1)[1]} {dtype} {consts} warps {launch['options'].get('num_warps')}: "
            f"{u['regs']} registers, spills {u['spill_store']} / {u['spill_load']} bytes")


def compile_all(path, arch, usage: bool = False) -> int:
    data = json.load(open(path))
    seen, failures = set(), []
    for launch in data["launches"]:
        tuned = data["tuned"].get(launch["kernel"])
        configs = tuned["gpu"] if tuned else [None]
        for config in configs:
            if tuned:  # the interpreter's config kwargs give way to this GPU candidate's
                launch = dict(launch, options={k: v for k, v in launch["options"].items()
                                               if k not in ("num_warps", "num_stages")})
            key = json.dumps([launch, config], sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            try:
                compiled = compile_one(launch, config, arch)
                if usage:
                    print(_usage(compiled, launch))
            except Exception as e:
                failures.append(f"{launch['kernel']} {config}: {type(e).__name__}: {str(e)[:2000]}")
    print(f"compile_check: {len(seen)} kernel launches compiled for sm_{arch}, {len(failures)} failed")
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["mamba3"], choices=["mamba3", "norm", "layout"],
                    help="the ops whose launches to record and compile (those with a workload here)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--usage", action="store_true", help="print registers and spills of every compiled launch")
    ap.add_argument("--record-only", metavar="PATH", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.record_only:
        record(a.ops, a.record_only)
        return 0
    path = os.path.join(tempfile.mkdtemp(prefix="compile-check-"), "launches.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, __file__, "--record-only", path, "--ops", *a.ops], check=True, env=env)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, __file__, "--compile", path, "--arch", str(a.arch)]
                          + (["--usage"] if a.usage else []), env=env).returncode


if __name__ == "__main__" and "--compile" in sys.argv:
    i = sys.argv.index("--compile")
    raise SystemExit(compile_all(sys.argv[i + 1], int(sys.argv[sys.argv.index("--arch") + 1]),
                                 "--usage" in sys.argv))
elif __name__ == "__main__":
    raise SystemExit(main())
