"""Offline code-quality report of the scan kernels: compile for sm_90 without a GPU and count what they run.

    python -m mamba_parallel.ops.selective_scan.sass_report [--variant v2 v3 v4] [--cfg T,BDf,Wf,BDb,Wb]
        [--ckpt-every K] [--dump DIR]

For each variant's forward and backward (bf16 inputs, the GPU tile config, D / z / delta_bias / softplus on, as the
benchmark runs them) it prints the registers and spill bytes ptxas reports, and SASS instruction counts of the
whole kernel and of its innermost loop (the per-state body that runs b * d * n * L / (tokens per thread) times):
all instructions, shuffles (SHFL), barriers (BAR), shared-memory ops (LDS / STS), MUFU and global memory ops.
Per-element figures divide the innermost loop by the elements one thread handles per iteration.

The argument specialisation mirrors Triton's JIT (ints equal to 1 become constants, multiples of 16 and pointers
get divisibility 16), so the code is what the benchmark would run; Triton's wheel bundles ptxas and cuobjdump.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

TOKEN_STRIDE = 1  # token-major (b, d, L) inputs, as the Mamba-1 layer and the benchmark pass them


def _nvidia_bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn, args: dict, constexprs: dict, num_warps: int):
    """args: name -> '*bf16'-style pointer type or an int value (specialised as the JIT does) -> CompiledKernel."""
    signature, attrs, consts = {}, {}, dict(constexprs)
    maxnreg = consts.pop("maxnreg", None)  # a launch option, not a constexpr
    names = fn.arg_names
    for i, name in enumerate(names):
        if name not in constexprs and name not in args:  # a defaulted constexpr left out
            consts[name] = fn.params[i].default
        if name in consts:
            signature[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):
            signature[name] = v
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        elif v == 1:
            signature[name] = "constexpr"
            consts[name] = 1
        else:
            signature[name] = "i32"
            if v % 16 == 0:
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": maxnreg})


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes of the kernel (ptxas -v on the PTX)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):  # the PTX version may need the newer of the two bundled
            run = subprocess.run([_nvidia_bin(exe), "-v", "--gpu-name=sm_90a", path, "-o",
                                  os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"ptxas failed: {run.stderr[-500:]}")
        out = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=int(regs.group(1)) if regs else -1,
                spill_store=int(spill.group(1)) if spill else -1, spill_load=int(spill.group(2)) if spill else -1)


def sass_lines(cubin: bytes) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([_nvidia_bin("cuobjdump"), "-sass", path], capture_output=True, text=True,
                             check=True).stdout
    return [ln for ln in out.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)]


def _addr(ln: str) -> int:
    return int(re.match(r"\s*/\*([0-9a-f]+)\*/", ln).group(1), 16)


def innermost_loop(lines: list[str]) -> list[str]:
    """The shortest backward-branch span that contains no other backward branch (the innermost loop body)."""
    spans = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\b[^;]*?`?\(?\.?L_x_\d+\)?|BRA\s+0x([0-9a-f]+)", ln)
        tgt = re.search(r"0x([0-9a-f]+)", ln.split("BRA", 1)[1]) if "BRA" in ln else None
        if m and tgt:
            t = int(tgt.group(1), 16)
            if t <= _addr(ln):
                spans.append((t, _addr(ln)))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    if not inner:
        return []
    lo, hi = max(inner, key=lambda s: s[1] - s[0])
    return [ln for ln in lines if lo <= _addr(ln) <= hi]


def counts(lines: list[str]) -> dict:
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", ln).split(" ")[0].split(".")[0] for ln in lines]
    c = dict(all=len(ops))
    for key, pats in (("shfl", ("SHFL",)), ("bar", ("BAR",)), ("smem", ("LDS", "STS")), ("mufu", ("MUFU",)),
                      ("gmem", ("LDG", "STG", "RED", "ATOM")), ("fp32", ("FADD", "FMUL", "FFMA", "FSEL", "FMNMX"))):
        c[key] = sum(op in pats for op in ops)
    return c


def report(name: str, kernel, elems_per_iter: int, dump: str | None) -> dict:
    ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
    use = ptxas_usage(ptx)
    lines = sass_lines(cubin)
    loop = innermost_loop(lines)
    tot, inner = counts(lines), counts(loop)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(kernel.asm[ext])
        with open(os.path.join(dump, f"{name}.sass"), "w") as f:
            f.write("\n".join(lines))
    per = {k: round(v / elems_per_iter, 2) for k, v in inner.items()}
    print(f"{name:>10}: regs {use['regs']:3d} spill st/ld {use['spill_store']}/{use['spill_load']} B | "
          f"kernel {tot['all']} instr | inner loop {inner} | per element {per}")
    return dict(name=name, **use, kernel=tot, inner=inner, per_element=per)


def variant_kernels(variant: str, cfg: str | None = None, ckpt_every: int = 1, b=8, d=4096, L=4096, n=16):
    """[(name, jit fn, args, constexprs, num_warps, elements per thread per inner iteration)] of the forward (with
    checkpoints every ``ckpt_every`` chunks, as under autograd) and backward of ``variant`` at the first benchmark
    shape, bf16, token-major."""
    from mamba_parallel.ops.selective_scan.triton_bwd import selective_scan_bwd_kernel
    from mamba_parallel.ops.selective_scan.triton_common import scan_config
    from mamba_parallel.ops.selective_scan.triton_fwd import selective_scan_fwd_kernel
    from mamba_parallel.ops.selective_scan.triton_impl import _rows_per_channel, _unroll, _unrolled_meta

    if cfg:
        os.environ["MAMBA_PARALLEL_SCAN_CFG"] = cfg
    c = scan_config(d, L, interpret=False, impl=variant)
    nchunks = triton.cdiv(L, c.chunk)
    ncks = triton.cdiv(nchunks, ckpt_every)
    strides = dict(su_b=d * L, su_d=L, su_l=TOKEN_STRIDE, sdt_b=d * L, sdt_d=L, sdt_l=TOKEN_STRIDE, sz_b=d * L,
                   sz_d=L, sz_l=TOKEN_STRIDE, sB_b=n * L, sB_g=n * L, sB_n=L, sB_l=1, sC_b=n * L, sC_g=n * L,
                   sC_n=L, sC_l=1, ssid_b=0)
    flags = dict(HAS_D=True, HAS_Z=True, HAS_DTB=True, SOFTPLUS=True, HAS_H0=False, HAS_SID=False, VARLEN=False,
                 FAST_EXP=True)
    bf, f32 = "*bf16", "*fp32"
    fwd_ptrs = dict(u_ptr=bf, dt_ptr=bf, z_ptr=bf, B_ptr=f32, C_ptr=f32, A_ptr=f32, D_ptr=f32, dtb_ptr=f32,
                    h0_ptr=bf, sid_ptr="*i32", y_ptr=bf, ypre_ptr=bf, hlast_ptr=f32, st_ptr=f32, ck_ptr=f32)
    bwd_ptrs = dict(fwd_ptrs, ckpt_ptr=f32, dy_ptr=bf, dlast_ptr=f32, du_ptr=bf, ddt_ptr=bf, dz_ptr=bf, dB_ptr=f32,
                    dC_ptr=f32, dA_ptr=f32, dD_ptr=f32, ddtb_ptr=f32, dh0_ptr=f32, adj_ptr=f32, scr_ptr=f32)
    v = min(c.chunk, 8)  # one 16-byte bf16 vector
    tile = dict(P=c.chunk // v, V=v)
    nblk = d // c.bwd_block_d
    fwd_tile, bwd_tile = dict(tile, KC=ckpt_every), dict(tile, KC=ckpt_every)
    if variant in ("v3", "v4"):  # the GPU path of token-major inputs, as triton_impl picks it
        r = _rows_per_channel(variant, n)
        nblk = d * r // 32
        bwd_tile.update(LANE_SUM=True, LP=tile["P"].bit_length() - 1, LV=tile["V"].bit_length() - 1, R=r,
                        UNROLL=_unroll(variant, n // r, True, r))
        fwd_tile.update(LANES=True, R=r, UNROLL=_unroll(variant, n // r, False, r),
                        **_unrolled_meta(variant, n, c.chunk, True, False, False))
    fwd = (dict(fwd_ptrs, L=L, dim=d, dstate=n, d_per_group=d, nchunks=nchunks,
                nslots=nchunks if ckpt_every == 1 else 2, ncks=ncks,
                **strides),
           dict(flags, SAVE_YPRE=True, BD=c.fwd_block_d, **fwd_tile), c.fwd_warps,
           c.chunk * (fwd_tile["NS"] // fwd_tile["R"] if fwd_tile.get("NS") else fwd_tile.get("UNROLL", 1)))
    bwd = (dict(bwd_ptrs, L=L, dim=d, dstate=n, d_per_group=d, nchunks=nchunks, nblk=nblk, ncks=ncks,
                **strides),
           dict(flags, HAS_DLAST=False, BD=c.bwd_block_d, **bwd_tile), c.bwd_warps,
           c.chunk * bwd_tile.get("UNROLL", 1))
    return [("fwd", selective_scan_fwd_kernel, *fwd), ("bwd", selective_scan_bwd_kernel, *bwd)]


def main(argv=None) -> None:
    from mamba_parallel.ops.selective_scan.triton_common import IMPLS, parse_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", nargs="*", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--cfg", help="tile config 'T,BDf,Wf,BDb,Wb' (MAMBA_PARALLEL_SCAN_CFG) instead of the default")
    ap.add_argument("--ckpt-every", type=int, default=1, metavar="K",
                    help="checkpoint every K-th chunk (MAMBA_PARALLEL_SCAN_CKPT_EVERY): the backward's recompute")
    ap.add_argument("--dump", metavar="DIR", help="also write TTGIR / PTX / SASS of each kernel there")
    args = ap.parse_args(argv)
    if args.cfg:
        try:
            parse_config(args.cfg)
        except ValueError as e:
            ap.error(f"--cfg: {e}")
    if args.ckpt_every < 1:
        ap.error(f"--ckpt-every {args.ckpt_every}: expected a positive int")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("sass_report compiles for sm_90: unset TRITON_INTERPRET")
    for v in args.variant:
        for name, fn, fargs, consts, warps, epi in variant_kernels(v, args.cfg, args.ckpt_every):
            report(f"{v}-{name}", compile_sm90(fn, fargs, consts, warps), epi, args.dump)


if __name__ == "__main__":
    main()
