"""Offline code-quality report of the Mamba-1 scan kernels: compile for sm_90 without a GPU and count what they run.

    python tools/sass_report.py [--path row_per_thread two_rows_per_channel ...] [--shape B D L N] [--dump DIR]

For each kernel path's forward and backward (bf16 token-major inputs, D / z / delta_bias / softplus on, as the
benchmark runs them; tiles and launch options from ops/selective_scan/launch.py for an H200) it prints the
registers and spill bytes ptxas reports, and SASS instruction counts of the whole kernel and of its innermost loop
(the per-state body that runs b * d * n * L / (tokens per thread) times): all instructions, shuffles (SHFL),
barriers (BAR), shared-memory ops (LDS / STS), MUFU, global memory ops and tensor-core ops (mma: HMMA; wgmma:
HGMMA). Per-element figures divide the innermost loop by the elements one thread handles per iteration.

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


def cuobjdump(cubin: bytes, *flags: str, check: bool = True) -> str:
    """Triton's bundled cuobjdump run with ``flags`` on a cubin -> its output."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_nvidia_bin("cuobjdump"), *flags, path], capture_output=True, text=True,
                              check=check).stdout


def sass_lines(cubin: bytes) -> list[str]:
    out = cuobjdump(cubin, "-sass")
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
                      ("gmem", ("LDG", "STG", "RED", "ATOM")), ("fp32", ("FADD", "FMUL", "FFMA", "FSEL", "FMNMX")),
                      ("mma", ("HMMA",)), ("wgmma", ("HGMMA",)), ("local", ("LDL", "STL"))):
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


def path_kernels(path: str, b=8, d=4096, L=4096, n=16, sm_count=132):
    """[(name, jit fn, args, constexprs, num_warps, elements per thread per inner iteration)] of the forward (with
    checkpoints, as under autograd) and backward of ``path`` at one shape, bf16, token-major."""
    from mamba_parallel.ops.selective_scan import launch
    from mamba_parallel.ops.selective_scan.triton_bwd import selective_scan_bwd_kernel
    from mamba_parallel.ops.selective_scan.triton_fwd import selective_scan_fwd_kernel

    plan = launch.plan(launch.ScanShape(batch=b, d=d, n=n, groups=1, seqlen=L, elem_size=2, row_layout=True,
                                        varlen=False), sm_count, path)
    fw, bw = plan.fwd, plan.bwd
    nchunks = triton.cdiv(L, fw.chunk)
    strides = dict(su_b=d * L, su_d=L, su_l=TOKEN_STRIDE, sdt_b=d * L, sdt_d=L, sdt_l=TOKEN_STRIDE, sz_b=d * L,
                   sz_d=L, sz_l=TOKEN_STRIDE, sB_b=n * L, sB_g=n * L, sB_n=L, sB_l=1, sC_b=n * L, sC_g=n * L,
                   sC_n=L, sC_l=1, ssid_b=0)
    flags = dict(HAS_D=True, HAS_Z=True, HAS_DTB=True, SOFTPLUS=True, HAS_H0=False, HAS_SID=False, VARLEN=False,
                 FAST_EXP=True)
    bf, f32 = "*bf16", "*fp32"
    fwd_ptrs = dict(u_ptr=bf, dt_ptr=bf, z_ptr=bf, B_ptr=f32, C_ptr=f32, A_ptr=f32, D_ptr=f32, dtb_ptr=f32,
                    h0_ptr=bf, sid_ptr="*i32", y_ptr=bf, _pad_ptr=bf, hlast_ptr=f32, st_ptr=f32, carry_ptr=f32)
    bwd_ptrs = dict(fwd_ptrs, ckpt_ptr=f32, gated_ptr=bf, dy_ptr=bf, dlast_ptr=f32, dout_ptr=bf, du_ptr=bf,
                    ddt_ptr=bf, dz_ptr=bf, dB_ptr=f32, dC_ptr=f32, dA_ptr=f32, dD_ptr=f32, ddtb_ptr=f32, dh0_ptr=f32,
                    adj_ptr=f32, scr_ptr=f32, gl_ptr=f32, ds_ptr=f32)
    # the backward as the Mamba-1 training node runs it: y's gradient token-major, the gated output's gradient,
    # dz and the gate's output as views of token-major (b, L, .) buffers (z and dz: halves of in_proj's output and
    # its gradient)
    gate_strides = dict(sdo_b=L * d, sdo_d=1, sdo_l=d, sdz_b=2 * L * d, sdz_d=1, sdz_l=2 * d, sg_b=L * d, sg_d=1,
                        sg_l=d)
    # du channels-last (b, L, d), as the conv's backward reads it; the forward, where it gates (one row per
    # channel), reads z from in_proj's output and writes the gated y as out_proj's (b, L, d) input, elsewhere y
    # token-major
    du_strides = dict(sdu_b=L * d, sdu_d=1, sdu_l=d)
    z_layer = dict(sz_b=2 * L * d, sz_d=1, sz_l=2 * d)

    def tile(run):
        meta = dict(BD=run.block_d, P=run.vectors, V=run.vec, UNROLL=run.unroll, STAGES=run.stages)
        if run.maxnreg:
            meta["maxnreg"] = run.maxnreg
        return meta

    fwd_meta = dict(tile(fw), R=fw.rows, LANES=fw.row_layout, CKPT=True, **flags)
    fwd_meta["HAS_Z"] = launch.gates_in_forward(fw.path)  # as the layer runs it: y token-major on two rows
    if fw.unrolled_states:
        fwd_meta.update(NS=fw.unrolled_states, PREFETCH=fw.prefetch)
    bwd_meta = dict(tile(bw), LANE_SUM=bw.row_layout, HAS_DLAST=False, GATED=True, DY_GATED=True, **flags)
    if bw.row_layout:
        bwd_meta.update(LP=bw.vectors.bit_length() - 1, LV=bw.vec.bit_length() - 1)
    nblk = d // 32 if bw.row_layout else d // bw.block_d
    per_iter = fw.unrolled_states // fw.rows if fw.unrolled_states else fw.unroll
    fwd = (dict(fwd_ptrs, L=L, dim=d, dstate=n, d_per_group=d, nchunks=nchunks, nslots=nchunks, _pad_n=nchunks,
                **dict(strides, **z_layer), **(dict(sy_b=L * d, sy_d=1, sy_l=d) if fwd_meta["HAS_Z"]
                                               else dict(sy_b=d * L, sy_d=L, sy_l=TOKEN_STRIDE))),
           fwd_meta, fw.num_warps, fw.chunk * per_iter)
    bwd = (dict(bwd_ptrs, L=L, dim=d, dstate=n, d_per_group=d, nchunks=nchunks, nblk=nblk, ngroups=nchunks,
                seg_chunks=nchunks, nseg=1,
                **dict(strides, **z_layer), **gate_strides, **du_strides),
           bwd_meta, bw.num_warps, bw.chunk * bw.unroll)
    return [(f"{fw.path}-fwd", selective_scan_fwd_kernel, *fwd), (f"{bw.path}-bwd", selective_scan_bwd_kernel, *bwd)]


def main(argv=None) -> None:
    from mamba_parallel.ops.selective_scan import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", nargs="*", default=[launch.ROW_PER_THREAD, launch.TWO_ROWS_PER_CHANNEL],
                    choices=launch.FORWARD_PATHS, help="forward paths (each with its backward)")
    ap.add_argument("--shape", nargs=4, type=int, default=[8, 4096, 4096, 16], metavar=("B", "D", "L", "N"))
    ap.add_argument("--dump", metavar="DIR", help="also write TTGIR / PTX / SASS of each kernel there")
    args = ap.parse_args(argv)
    from mamba_parallel.ops.backend import interpret_mode
    if interpret_mode():
        raise SystemExit("sass_report compiles for sm_90: unset TRITON_INTERPRET")
    b, d, L, n = args.shape
    for p in args.path:
        for name, fn, fargs, consts, warps, epi in path_kernels(p, b, d, L, n):
            report(name, compile_sm90(fn, fargs, consts, warps), epi, args.dump)


if __name__ == "__main__":
    main()
