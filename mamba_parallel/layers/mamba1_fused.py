"""The Mamba-1 layer's middle (conv -> x_proj -> dt_proj -> selective scan -> gate) as one autograd node.

Why: a small Mamba-1 model's eager training step is bound by the host (mamba-130m on an H200: ~1,800 launches and
~100 ms of CPU per step against ~93 ms of GPU work). The modular layer (layers/mamba1.py) builds about ten autograd
nodes per layer (conv, layout copy, two autocast weight casts and their backward casts, two matmuls, the split of
x_proj's output, A = -exp(A_log), the scan, the gate), each with its own Python and dispatch cost, and its backward
adds a few more launches (the matmuls' expanded-weight sums, the split's concatenation, the add of x's two
gradients, A's chain rule). Here one ``autograd.Function`` runs the same kernels with a hand-written backward:

- forward: the conv writes its output token-major directly (no layout copy), B and C become fp32 in one copy
  (kept for the backward, 2 n fp32 values per token: the scan would otherwise convert them again there), and
  A = -exp(A_log) is built state-major once (the kernels' layout, kept for the backward); delta (dt_proj's
  output, d_inner values per token) is not kept: the backward runs its small matmul again, as mamba_ssm's fused
  path does, and with ``recompute`` holding conv the conv output is rebuilt there too;
- backward: one buffer receives x_proj's output gradient (ddt_low from the dt matmul, dB / dC straight from the
  scan's finishing kernel), x's two gradients meet in one matmul (du + W^T dx_dbl, accumulated in place), the
  scan's finishing kernel returns d(A_log) directly, and the conv writes dx into the x half of in_proj's output
  gradient, whose z half the gate's backward fills.

Same numerics as the modular path: the same kernels in the same dtypes (weights cast to the activations' dtype, as
autocast does; the weight gradients of the two token-major matmuls are summed over the batch in fp32 instead of in
the activation dtype). ``Mamba.forward`` takes this path when ``use_fused_path`` is set, its ``seq_ops`` are the
local ones, ``fused_ok`` allows (the Triton path, training) and no ``gate`` recompute is asked for. The node reads
the sub-modules' weights directly: their forward hooks do not run (``use_fused_path=False`` runs them).
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn as nn
from torch._C import _len_torch_dispatch_stack
from torch.autograd.function import once_differentiable

from mamba_parallel.layers.mamba1_layout import _fast

# recompute items the fused node handles itself (dt always); with "gate" the modular layer runs
FUSED_RECOMPUTE = frozenset({"conv", "dt"})


def fused_ok(layer: nn.Module, xz: torch.Tensor) -> bool:
    """Whether ``layer`` (a Mamba whose ``seq_ops`` are local) may run its middle through ``mamba1_inner`` now:
    training with autograd on the Triton path, nothing compiling, no dispatch mode watching ops, a plain tensor."""
    if not (torch.is_grad_enabled() and xz.requires_grad):
        return False
    if torch.compiler.is_compiling() or _len_torch_dispatch_stack() > 0 or type(xz) is not torch.Tensor:
        return False
    return _fast(xz)


@functools.cache
def _kernels():
    """The Triton modules (imported on first use: only where Triton runs)."""
    return tuple(importlib.import_module(f"mamba_parallel.{m}") for m in (
        "ops.conv1d.triton_impl", "ops.selective_scan.triton_impl", "layers.mamba1_layout_kernels"))


def _expand(w: torch.Tensor, b: int) -> torch.Tensor:
    return w.unsqueeze(0).expand(b, -1, -1)


def _xz_views(xz: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj's output (b, L, 2d) -> x, z as channels-last (b, d, L) views."""
    return xz[..., :d].transpose(1, 2), xz[..., d:].transpose(1, 2)


def _delta(wdt: torch.Tensor, x_dbl: torch.Tensor, r: int) -> torch.Tensor:
    """dt_proj's output (b, d, L) from x_proj's (b, r + 2n, L); its bias is added in fp32 inside the scan."""
    return torch.bmm(_expand(wdt, x_dbl.shape[0]), x_dbl[:, :r])


def _conv_token_major(conv, x, w2, conv_b, seq_idx):
    """silu(conv(x)) written token-major (x_proj and the scan stream along L): no layout copy."""
    xc = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    conv._launch_fwd(x, w2, conv_b, None, seq_idx, None, xc, True)
    return xc


class _Mamba1Inner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xz, conv_w, conv_b, xproj_w, dt_w, dt_b, A_log, D, seq_idx, d_inner: int, r: int, n: int,
                recompute_conv: bool):
        conv, scan, layout = _kernels()
        b = xz.shape[0]
        d, cdt = d_inner, xz.dtype
        x, z = _xz_views(xz, d)
        xc = _conv_token_major(conv, x, conv_w[:, 0, :], conv_b, seq_idx)
        wx, wdt = xproj_w.to(cdt), dt_w.to(cdt)  # what autocast would cast (no-op without it)
        x_dbl = torch.bmm(_expand(wx, b), xc)  # (b, r + 2n, L)
        dt = _delta(wdt, x_dbl, r)
        bc = x_dbl[:, r:].float()  # (b, 2n, L) fp32 once, for both passes
        B4, C4 = bc[:, :n].unsqueeze(1), bc[:, n:].unsqueeze(1)
        # (d, n) view of a state-major (n, d) tensor: the kernels' layout, so the scan makes no transposed copy
        A = torch.exp(A_log.t(), out=A_log.new_empty(A_log.shape[::-1], dtype=torch.float32)).neg_().t()
        D32, dtb32 = D.float(), dt_b.float()
        sid = seq_idx.to(torch.int32) if seq_idx is not None else None
        impl = scan.scan_impl(b, d, n, xz.device, scan._interpreted(xc), False)
        y, _, ckpt, _ = scan._scan_fwd(xc, dt, A, B4, C4, D32, None, dtb32, None, sid, True, False, b, True, impl)
        out = layout._gate_fwd(y, z)  # (b, L, d) contiguous: out_proj's input
        # dt is rebuilt in the backward (one small matmul), xc too with recompute_conv (one conv)
        ctx.save_for_backward(xz, conv_w, conv_b, wx, wdt, None if recompute_conv else xc, x_dbl, B4, C4, A, D32,
                              dtb32, sid, ckpt, y, seq_idx)
        ctx.meta = (d, r, n, impl, D.dtype, dt_b.dtype, A_log.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        conv, scan, layout = _kernels()
        xz, conv_w, conv_b, wx, wdt, xc, x_dbl, B4, C4, A, D32, dtb32, sid, ckpt, y, seq_idx = ctx.saved_tensors
        d, r, n, impl, d_dtype, dtb_dtype, alog_dtype = ctx.meta
        b = xz.shape[0]
        x, z = _xz_views(xz, d)
        if xc is None:
            xc = _conv_token_major(conv, x, conv_w[:, 0, :], conv_b, seq_idx)
        dt = _delta(wdt, x_dbl, r)  # the forward's values (the same matmul)
        dxz = torch.empty_like(xz)  # in_proj's output gradient: the gate fills the z half, the conv the x half
        dy = layout._gate_bwd(dout, y, z, dxz[..., d:].transpose(1, 2))
        dx_dbl = torch.empty_like(x_dbl)  # x_proj's output gradient: [ddt_low | dB | dC]
        du, ddt, dA_log, _, _, dD, _, ddtb, _ = scan.scan_bwd_impl(
            xc, dt, A, B4, C4, D32, None, dtb32, None, sid, ckpt, xc.new_empty((0,)), dy, None, True, False, impl,
            dB_out=dx_dbl[:, r:r + n].unsqueeze(1), dC_out=dx_dbl[:, r + n:].unsqueeze(1), dA_scale=A)
        del dy, dt  # activation-sized: free before the next ones are made (peak memory of the largest models)
        torch.bmm(_expand(wdt.t(), b), ddt, out=dx_dbl[:, :r])
        dwdt = torch.bmm(ddt, x_dbl[:, :r].transpose(1, 2)).sum(0, dtype=torch.float32)  # (d, r)
        dwx = torch.bmm(dx_dbl, xc.transpose(1, 2)).sum(0, dtype=torch.float32)  # (r + 2n, d)
        del ddt
        dxc = du.baddbmm_(_expand(wx.t(), b), dx_dbl)  # x's two gradients: the scan's and x_proj's
        _, dw2, dcb, _ = conv._conv_bwd_impl(x, conv_w[:, 0, :], conv_b, None, seq_idx, dxc, None, True,
                                             dxz[..., :d].transpose(1, 2))
        need = ctx.needs_input_grad
        grads = (dxz, dw2.view_as(conv_w), dcb if conv_b is not None else None, dwx, dwdt, ddtb.to(dtb_dtype),
                 dA_log.to(alog_dtype), dD.to(d_dtype))
        return (*(g if need[i] else None for i, g in enumerate(grads)), None, None, None, None, None)


def mamba1_inner(layer: nn.Module, xz: torch.Tensor, seq_idx: torch.Tensor | None,
                 recompute_conv: bool = False) -> torch.Tensor:
    """xz (b, L, 2 d_inner) in_proj's output -> y * silu(z) (b, L, d_inner) contiguous (out_proj's input), the
    middle of ``layer`` (a Mamba) as one autograd node. ``recompute_conv``: rebuild the conv output in the backward
    instead of keeping it. Call only where ``fused_ok`` allows."""
    conv1d, dt_proj = layer.conv1d, layer.dt_proj
    return _Mamba1Inner.apply(xz, conv1d.weight, conv1d.bias, layer.x_proj.weight, dt_proj.weight, dt_proj.bias,
                              layer.A_log, layer.D, seq_idx, layer.d_inner, layer.dt_rank, layer.d_state,
                              recompute_conv)
