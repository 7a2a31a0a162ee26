"""Chunked linear cross-entropy with a Triton loss kernel, as torch custom ops (docs/API.md signature).

"mean" / "sum": the forward walks token chunks once. Per chunk: fp32 logits = h @ W^T (torch matmul), the Triton
kernel writes the loss and d(logits) = softmax - onehot, then dh = dlogits @ W and dW += dlogits^T @ h right
away, so the backward only scales the stored gradients by 1 / n_valid (mean) times the incoming scalar. Extra memory: one chunk of
logits (+ its half-precision gradient), dh (N, d) and an fp32 dW (V, d) held from forward to backward.
"none": each row's gradient scale is known only in the backward, which recomputes the logits chunk by chunk.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from mamba_parallel.ops.cross_entropy import naive
from mamba_parallel.ops.cross_entropy.triton_ce_kernel import ce_chunk_kernel
from mamba_parallel.ops.eager_fastpath import eager, fastpath

# Default chunk: about this many fp32 logits (512 MiB). Larger chunks keep the matmuls efficient.
CHUNK_ELEMENTS = 1 << 27

# Whether this build of torch has mm / addmm with an fp32 output for half inputs (CUDA only); tried once.
_OUT_DTYPE_OK: dict[str, bool] = {}


def _default_chunk(n: int, v: int) -> int:
    rows = CHUNK_ELEMENTS // max(1, v)
    rows = rows // 128 * 128 if rows >= 128 else max(1, rows)
    return max(1, min(n, rows))


def _half_mm_fp32(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b as fp32 (acc += a @ b in place when acc is given), accumulating in fp32 even for half inputs."""
    if a.dtype == torch.float32:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    key = "mm" if acc is None else "addmm"
    if a.is_cuda and _OUT_DTYPE_OK.get(key, True):
        try:
            if acc is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError):  # this torch has no fp32-output overload for half inputs
            _OUT_DTYPE_OK[key] = False
    # Fallback: one rounding of each chunk's product to the half dtype, then an fp32 sum across chunks.
    out = torch.mm(a, b).float()
    return out if acc is None else acc.add_(out)


def _launch(logits, dlogits, labels, losses, scale, ignore_index, write_loss, write_grad):
    """Run the loss kernel over one chunk of logits (rows, V)."""
    rows, v = logits.shape
    block_v = min(4096, triton.next_power_of_2(v))
    ce_chunk_kernel[(rows,)](
        logits, dlogits, labels, losses, scale,
        v, logits.stride(0), dlogits.stride(0) if dlogits is not None else 0,
        scale.stride(0) if scale is not None and scale.numel() > 1 else 0, ignore_index,
        WRITE_LOSS=write_loss, WRITE_GRAD=write_grad, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )


def _chunk_loop(hidden, weight, labels, ignore_index, chunk, row_scale, need_loss, need_dh, need_dw, dh_post=None):
    """Walk the row chunks -> per-row losses (N,) fp32 (or None), dh (N, d) hidden.dtype, dW (V, d) fp32.

    ``row_scale`` (1,) or (N,) fp32, |.| <= 1, multiplies each row's d(logits). Global factors (1 / n_valid, the
    incoming gradient) are NOT applied here: half-precision d(logits) = softmax / n would underflow in fp16. With
    ``dh_post`` (a 0-d fp32 tensor) dh = (d(logits) @ W) * dh_post, formed in fp32; without it dh is left unscaled.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device) if need_loss else None
    dh = torch.empty_like(hidden) if need_dh else None
    dw = torch.zeros((v, d), dtype=torch.float32, device=hidden.device) if need_dw else None
    need_grad = need_dh or need_dw
    for s in range(0, n, chunk):
        h = hidden[s:s + chunk]
        logits = _half_mm_fp32(h, weight.t())
        # the gradient overwrites the fp32 logits, or goes to a buffer of the matmul dtype for the next matmuls
        dlogits = (logits if weight.dtype == torch.float32 else torch.empty_like(logits, dtype=weight.dtype)) \
            if need_grad else None
        _launch(logits, dlogits, labels[s:s + chunk], losses[s:s + chunk] if need_loss else None,
                (row_scale if row_scale.numel() == 1 else row_scale[s:s + chunk]) if need_grad else None,
                ignore_index, need_loss, need_grad)
        if need_dh:
            if dh_post is None:
                torch.mm(dlogits, weight, out=dh[s:s + chunk])
            else:
                dh[s:s + chunk] = (_half_mm_fp32(dlogits, weight) * dh_post).to(dh.dtype)
        if need_dw:
            _half_mm_fp32(dlogits.t(), h, acc=dw)
    return losses, dh, dw


# ---------------------------------------------------------------------- "mean" / "sum": gradients in the forward

def _ce_fused_impl(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk: int,
                   mean: bool, need_dh: bool, need_dw: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N, d), weight (V, d) same dtype, labels (N,) -> loss () fp32, and the gradient of the loss as
    dh_raw (N, d) hidden.dtype or (0,), dW_raw (V, d) fp32 or (0,), scale () fp32 with grad = raw * scale."""
    ones = hidden.new_ones(1, dtype=torch.float32)
    losses, dh, dw = _chunk_loop(hidden, weight, labels, ignore_index, chunk, ones, True, need_dh, need_dw)
    scale = 1.0 / (labels != ignore_index).sum().float() if mean else ones[0].clone()
    return (losses.sum() * scale, dh if need_dh else hidden.new_empty((0,)),
            dw if need_dw else hidden.new_empty((0,), dtype=torch.float32), scale)


_ce_fused = torch.library.custom_op("mamba_parallel::linear_cross_entropy_fused", mutates_args=())(_ce_fused_impl)


@_ce_fused.register_fake
def _(hidden, weight, labels, ignore_index, chunk, mean, need_dh, need_dw):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape if need_dh else (0,)),
            hidden.new_empty(weight.shape if need_dw else (0,), dtype=torch.float32),
            hidden.new_empty((), dtype=torch.float32))


def _fused_setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, chunk, mean, need_dh, need_dw = inputs
    _, dh, dw, scale = output
    ctx.save_for_backward(dh, dw, scale)
    ctx.need_dh, ctx.need_dw = need_dh, need_dw
    ctx.weight_dtype = weight.dtype


def _fused_backward(ctx, g, _gdh, _gdw, _gscale):
    dh, dw, scale = ctx.saved_tensors
    if (ctx.needs_input_grad[0] and not ctx.need_dh) or (ctx.needs_input_grad[1] and not ctx.need_dw):
        raise RuntimeError("linear_cross_entropy: a gradient was requested that the forward did not compute "
                           "(grad mode or requires_grad changed between forward and backward)")
    factor = scale * g.float()  # fp32, so a loss scale on g survives a tiny 1 / n_valid in fp16
    grad_h = (dh.float() * factor).to(dh.dtype) if ctx.need_dh else None
    grad_w = (dw * factor).to(ctx.weight_dtype) if ctx.need_dw else None
    return grad_h, grad_w, None, None, None, None, None, None


_ce_fused.register_autograd(_fused_backward, setup_context=_fused_setup)
fastpath(_ce_fused, _ce_fused_impl, setup_context=_fused_setup, backward=_fused_backward)


# ------------------------------------------------------------------ "none": per-row losses, backward recomputes

def _ce_rows_impl(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                  chunk: int) -> torch.Tensor:
    """-> losses (N,) fp32, 0 on ignored rows."""
    losses, _, _ = _chunk_loop(hidden, weight, labels, ignore_index, chunk, None, True, False, False)
    return losses


_ce_rows = torch.library.custom_op("mamba_parallel::linear_cross_entropy_rows", mutates_args=())(_ce_rows_impl)


@_ce_rows.register_fake
def _(hidden, weight, labels, ignore_index, chunk):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.float32)


def _ce_rows_bwd_impl(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grad_losses: torch.Tensor,
                      ignore_index: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_losses (N,) -> dh (N, d) hidden.dtype, dW (V, d) weight.dtype."""
    g = grad_losses.float()
    gmax = g.abs().max().clamp_min(torch.finfo(torch.float32).tiny)  # rows scaled into [-1, 1], gmax applied after
    _, dh, dw = _chunk_loop(hidden, weight, labels, ignore_index, chunk, (g / gmax).contiguous(), False, True, True,
                            dh_post=gmax)
    return dh, (dw * gmax).to(weight.dtype)


_ce_rows_bwd = torch.library.custom_op("mamba_parallel::linear_cross_entropy_rows_bwd",
                                       mutates_args=())(_ce_rows_bwd_impl)
fastpath(_ce_rows_bwd, _ce_rows_bwd_impl)


@_ce_rows_bwd.register_fake
def _(hidden, weight, labels, grad_losses, ignore_index, chunk):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _rows_setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, chunk = inputs
    ctx.save_for_backward(hidden, weight, labels)
    ctx.ignore_index, ctx.chunk = ignore_index, chunk


def _rows_backward(ctx, grad_losses):
    hidden, weight, labels = ctx.saved_tensors
    dh, dw = eager(_ce_rows_bwd)(hidden, weight, labels, grad_losses, ctx.ignore_index, ctx.chunk)
    return dh, dw, None, None, None


_ce_rows.register_autograd(_rows_backward, setup_context=_rows_setup)
fastpath(_ce_rows, _ce_rows_impl, setup_context=_rows_setup, backward=_rows_backward)


# ------------------------------------------------------------------------------------------- public-named entry

def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (as F.linear would), else the promotion."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk_size: Optional[int] = None) -> torch.Tensor:
    """hidden (N, d), weight (V, d), labels (N,) int -> fp32 loss: scalar ("mean", "sum") or (N,) ("none")."""
    if hidden.dtype == torch.float64 or weight.dtype == torch.float64:  # fp64 (gradcheck) keeps the reference
        return naive.linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk_size)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    mm_dtype = _matmul_dtype(hidden, weight)
    h = hidden.to(mm_dtype).contiguous()
    w = weight.to(mm_dtype).contiguous()
    lab = labels.contiguous()
    chunk = int(chunk_size) if chunk_size is not None else _default_chunk(h.shape[0], w.shape[0])
    if reduction == "none":
        return eager(_ce_rows)(h, w, lab, int(ignore_index), chunk)
    grad_on = torch.is_grad_enabled()
    loss, _, _, _ = eager(_ce_fused)(h, w, lab, int(ignore_index), chunk, reduction == "mean",
                                     grad_on and h.requires_grad, grad_on and w.requires_grad)
    return loss


__all__ = ["linear_cross_entropy"]
