"""Triton SSD chunked scan: forward and backward as two torch custom ops, so torch.compile sees one node each.

Forward stages (each a kernel file): dt processing + cumulative decay (triton_dt), chunk states chained
in one sweep over the chunks (triton_states; with fewer (row, head) pairs than SMs, computed per chunk in parallel
and chained after: triton_states_wide), chunk outputs with C.B recomputed in registers (triton_scan_fwd).
Backward: gate and dx / dD (triton_scan_bwd), state gradients (triton_states), dB / dC with the dA_cs gradient
(triton_dbc), dt / A / dt_bias (triton_dt). Launch configs: triton_tuning.
seq_idx and cu_seqlens are turned into a chunk-aligned packed layout (triton_varlen).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from torch import Tensor
from torch._C import _any_requires_grad

from mamba_parallel.ops.backend import interpret_mode
from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.grad_arena import grad_slot
from mamba_parallel.ops.ssd.triton_dt import dt_backward, dt_forward
from mamba_parallel.ops.ssd.triton_dbc import dbc_bwd
from mamba_parallel.ops.ssd.triton_scan_bwd import dx_bwd, gate_bwd
from mamba_parallel.ops.ssd.triton_scan_fwd import scan_fwd
from mamba_parallel.ops.ssd.triton_states import chunk_state_pass, state_grad_pass
from mamba_parallel.ops.ssd.triton_states_wide import chunk_states_then_chain
from mamba_parallel.ops.ssd.triton_varlen import make_packing


def _small(*ts):
    """A, D, dt_bias are read with unit strides by the kernels (tiny tensors: copying costs nothing)."""
    return tuple(t.contiguous() if t is not None else None for t in ts)


# The chunk the kernels run at. The scan's result does not depend on it (any chunk gives the same outputs, states
# and gradients up to rounding), only its cost does: the within-chunk products grow with the chunk, the state work
# they replace does not. On an H100 (b8 L4096 h64 p64 n128, bf16, one process) a fwd+bwd took 4.21 ms at 128 against
# 4.73 ms at 256, the forward 1.54 against 1.58; a larger chunk_size asked for runs at this one.
KERNEL_CHUNK_MAX = 128


def kernel_chunk(chunk_size: int) -> int:
    """The chunk the kernels run at for a requested ``chunk_size`` (a power of two >= 16)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"ssd_chunk_scan (triton): chunk_size must be a power of two >= 16, got {chunk_size}")
    return min(chunk_size, KERNEL_CHUNK_MAX)


def _prepare(x, dt, B, C, chunk_size, seq_idx, cu_seqlens):
    """-> (packing or None, B, C in x.dtype); chunk_size: the kernels' (``kernel_chunk``)."""
    pk = None
    if seq_idx is not None or cu_seqlens is not None:
        pk = make_packing(x.shape[0], x.shape[1], chunk_size, seq_idx, cu_seqlens, x.device)
    return pk, B.to(x.dtype), C.to(x.dtype)


def sweep_states(pairs: int, device: torch.device) -> bool:
    """Whether the forward chains its chunk states in one sweep per (row, head) (triton_states) rather than computing
    them in parallel first (triton_states_wide): the sweep saves their round trip through memory but walks the
    chunks in turn, which only pays when the (row, head) pairs fill the GPU (batch 1, 64 heads, 128 chunks on an
    H100: the forward took 1.25 ms with the sweep, 1.16 ms with the parallel states)."""
    if device.type != "cuda":
        return True
    return pairs >= torch.cuda.get_device_properties(device).multi_processor_count


def _chunk_states(xs, dts, Bs, A, dt_bias, dt_softplus, dt_min, dt_max, valid, seg, init, nstates, hpg,
                  chunk_size, state_dtype, final_out=None):
    """The forward's state pass on the (packed) layout -> dt_proc, dA_cs (b, h, nc, chunk) fp32, states entering
    each chunk (b, nc, h, p, n) state_dtype, final states (nstates, h, p, n) fp32 (or ``final_out``, written in
    place: triton_states.final_states_buffer). The backward runs it again when the forward did not keep them
    (keep_states=False)."""
    dtp, acs = dt_forward(dts, A, dt_bias, dt_softplus, dt_min, dt_max, valid, chunk_size)
    states = chunk_state_pass if sweep_states(xs.shape[0] * xs.shape[2], xs.device) else chunk_states_then_chain
    hin, final = states(xs, Bs, dtp, acs, init, seg, nstates, state_dtype, hpg, final_out)
    return dtp, acs, hin, final


def _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states, seq_idx,
             cu_seqlens, final_out=None):
    """The forward's kernels -> y, final states (fp32, or ``final_out`` (nstates, h, p, n) contiguous written in
    place, which may be ``initial_states`` itself), y before the gate (empty without z), dt_proc, dA_cs, the
    states entering each chunk."""
    b, L, H, P = x.shape
    hpg = H // B.shape[2]
    A, D, dt_bias = _small(A, D, dt_bias)
    pk, B, C = _prepare(x, dt, B, C, chunk_size, seq_idx, cu_seqlens)
    nstates = cu_seqlens.numel() - 1 if cu_seqlens is not None else b
    valid = seg = None
    xs, dts, Bs, Cs, zs = x, dt, B, C, z
    if pk is not None:
        xs, dts, Bs, Cs, zs = (pk.pack(t) for t in (x, dt, B, C, z))
        valid, seg = pk.valid, pk.seg
    init = initial_states.contiguous() if initial_states is not None else None
    dtp, acs, hin, final = _chunk_states(xs, dts, Bs, A, dt_bias, dt_softplus, dt_min, dt_max, valid, seg, init,
                                         nstates, hpg, chunk_size, x.dtype, final_out)
    y, ypre = scan_fwd(xs, zs, Bs, Cs, hin, dtp, acs, D, hpg)
    if pk is not None:
        y, ypre = pk.unpack(y, x), pk.unpack(ypre, x)
        if pk.empty is not None and pk.empty.numel():  # an empty sequence hands its initial state through
            if init is not None:
                final[pk.empty] = init[pk.empty].to(final.dtype)  # (not yet overwritten where final is init)
            elif final_out is not None:
                final[pk.empty] = 0.0  # what a new final buffer holds there
    return y, final, (ypre if ypre is not None else x.new_empty(0)), dtp, acs, hin


def _backward(dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states,
              seq_idx, cu_seqlens, ypre, dtp, acs, hin, final, outs=(None,) * 5):
    """outs: where to write (dx, ddt, dB, dC, dz), each None (a fresh tensor) or a tensor of the input's shape and
    dtype with any strides (a gradient-arena slice, ops/grad_arena.py)."""
    hpg = x.shape[2] // B.shape[2]
    A, D, dt_bias = _small(A, D, dt_bias)
    pk, Bc, Cc = _prepare(x, dt, B, C, chunk_size, seq_idx, cu_seqlens)
    dx_out, ddt_out, dB_out, dC_out, dz_out = outs
    if B.dtype != x.dtype:  # the kernels produce dB / dC in x.dtype (B, C are cast): cast after, no slot
        dB_out = dC_out = None
    dz = None
    if z is not None:
        dy, dz = gate_bwd(dy, z, ypre, dz_out)
    valid = seg = None
    xs, dts, Bs, Cs, dys = x, dt, Bc, Cc, dy
    if pk is not None:
        xs, dts, Bs, Cs, dys = (pk.pack(t) for t in (x, dt, Bc, Cc, dy))
        valid, seg = pk.valid, pk.seg
    dfinal = dfinal.float().contiguous() if dfinal is not None else None
    if dtp.numel() == 0:  # the forward kept no states (keep_states=False): the same kernels give the same values
        init = initial_states.contiguous() if initial_states is not None else None
        nstates = cu_seqlens.numel() - 1 if cu_seqlens is not None else x.shape[0]
        dtp, acs, hin, _ = _chunk_states(xs, dts, Bs, A, dt_bias, dt_softplus, dt_min, dt_max, valid, seg, init,
                                         nstates, hpg, chunk_size, x.dtype)
    ds, dinit, dlast = state_grad_pass(dys, Cs, acs, hin, final, dfinal, seg, initial_states is not None, hpg)
    direct = pk is None  # packed: the kernels work in the packed layout; the unpacking gather fills the outs
    dB, dC, dac, cb = dbc_bwd(xs, dys, Bs, Cs, hin, ds, dtp, acs, hpg, dB_out if direct else None,
                              dC_out if direct else None)
    dx, ddir, dD = dx_bwd(xs, dys, Bs, cb, ds, dtp, acs, D, hpg, dx_out if direct else None)
    ddt, dA, dbias = dt_backward(dts, A, dt_bias, dt_softplus, dt_min, dt_max, valid, dtp, dac, ddir, dlast,
                                 ddt_out if direct else None)
    if pk is not None:
        dx, ddt = pk.unpack(dx, x, dx_out), pk.unpack(ddt, dt, ddt_out)
        dB, dC = pk.unpack(dB, B, dB_out), pk.unpack(dC, C, dC_out)
        if dinit is not None and dfinal is not None and pk.empty is not None and pk.empty.numel():
            dinit[pk.empty] += dfinal[pk.empty]
    def cast(g, like):  # custom-op outputs may not alias each other: a fresh empty tensor for each missing grad
        return g.to(like.dtype) if like is not None else x.new_empty(0)

    return (dx, ddt, cast(dA, A), cast(dB, B), cast(dC, C), cast(dD, D), cast(dz, z), cast(dbias, dt_bias),
            cast(dinit, initial_states))


def _ssd_fwd_impl(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Optional[Tensor],
                  z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float, dt_max: float,
                  initial_states: Optional[Tensor], seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor],
                  keep_final: bool = True, keep_states: bool = True
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y, final_states (fp32), y before the gate (empty without z), dt_proc, dA_cs, states entering chunks.

    keep_final=False: the caller drops final_states (no gradient reaches them), so the backward need not keep
    them: it only multiplies them by that zero gradient. keep_states=False: dt_proc, dA_cs and the chunk states
    are not kept for the backward, which recomputes them (recompute_states)."""
    return _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states,
                    seq_idx, cu_seqlens)


ssd_fwd_op = torch.library.custom_op("mamba_parallel::ssd_chunk_scan_fwd", mutates_args=())(_ssd_fwd_impl)


@ssd_fwd_op.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states, seq_idx, cu_seqlens,
      keep_final=True, keep_states=True):
    b, L, H, P = x.shape
    N = B.shape[-1]
    nstates = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else b
    if seq_idx is None and cu_seqlens is None:
        rows, nc = b, triton.cdiv(L, chunk_size)
    else:
        rows, nc = 1, torch.library.get_ctx().new_dynamic_size()
    f32 = torch.float32
    return (x.new_empty(b, L, H, P), x.new_empty(nstates, H, P, N, dtype=f32),
            x.new_empty(b, L, H, P) if z is not None else x.new_empty(0),
            x.new_empty(rows, H, nc, chunk_size, dtype=f32), x.new_empty(rows, H, nc, chunk_size, dtype=f32),
            x.new_empty(rows, nc, H, P, N))


def _ssd_bwd_impl(dy: Tensor, dfinal: Optional[Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                  chunk_size: int, D: Optional[Tensor], z: Optional[Tensor], dt_bias: Optional[Tensor],
                  dt_softplus: bool, dt_min: float, dt_max: float, initial_states: Optional[Tensor],
                  seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor], ypre: Tensor, dtp: Tensor, acs: Tensor,
                  hin: Tensor, final: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                       Tensor]:
    """ypre: y before the gate (empty without z). -> dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states
    (the last four empty when the input is None)."""
    return _backward(dy.contiguous(), dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                     initial_states, seq_idx, cu_seqlens, ypre, dtp, acs, hin, final)


ssd_bwd_op = torch.library.custom_op("mamba_parallel::ssd_chunk_scan_bwd", mutates_args=())(_ssd_bwd_impl)
fastpath(ssd_bwd_op, _ssd_bwd_impl)


@ssd_bwd_op.register_fake
def _(dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states, seq_idx,
      cu_seqlens, ypre, dtp, acs, hin, final):
    like = lambda t: torch.empty_like(t) if t is not None else x.new_empty(0)  # noqa: E731
    return (torch.empty_like(x), torch.empty_like(dt), torch.empty_like(A), torch.empty_like(B), torch.empty_like(C),
            like(D), like(z), like(dt_bias), like(initial_states))


_N_FWD_INPUTS = 17


def _setup_context(ctx, inputs, output):
    (x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states, seq_idx,
     cu_seqlens, *rest) = inputs
    keep_final, keep_states = (tuple(rest) + (True, True))[:2]
    y, final, ypre, dtp, acs, hin = output
    if not keep_states:  # the backward recomputes them from x, dt, B (kept anyway)
        dtp = acs = hin = x.new_empty(0)
    ctx.args = (chunk_size, dt_softplus, dt_min, dt_max)
    ctx.has = tuple(t is not None for t in (D, z, dt_bias, initial_states, seq_idx, cu_seqlens))
    # Unreturned final states: keep their shape only (nstates x h x p x n fp32 per layer), zeros stand in for them
    ctx.final_shape = None if keep_final else final.shape
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ypre, dtp, acs, hin,
                          final if keep_final else None)
    # Gradient-arena slots (ops/grad_arena.py): the backward writes these inputs' gradients into a split's buffer
    slots = (grad_slot(x), grad_slot(dt), grad_slot(B), grad_slot(C), grad_slot(z) if z is not None else None)
    ctx.slots = slots if any(s is not None for s in slots) else None


def _autograd_backward(ctx, dy, dfinal, *_unused):
    (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ypre, dtp, acs, hin,
     final) = ctx.saved_tensors
    chunk_size, dt_softplus, dt_min, dt_max = ctx.args
    has_D, has_z, has_bias, has_init, _, _ = ctx.has
    if ctx.final_shape is not None:  # keep_final=False: the wrapper dropped them (dfinal: zeros or None)
        dfinal = None
        final = torch.zeros(ctx.final_shape, dtype=torch.float32, device=x.device)  # only read times dfinal = 0
    if dy is None:
        dy = torch.zeros_like(x)
    if ctx.slots is not None:  # eager only (no slots while compiling): the custom op may not write into inputs
        outs = tuple(s.get() if s is not None else None for s in ctx.slots)
        dx, ddt, dA, dB, dC, dD, dz, dbias, dinit = _backward(
            dy.contiguous(), dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max,
            initial_states, seq_idx, cu_seqlens, ypre, dtp, acs, hin, final, outs)
    else:
        dx, ddt, dA, dB, dC, dD, dz, dbias, dinit = eager(ssd_bwd_op)(
            dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states,
            seq_idx, cu_seqlens, ypre, dtp, acs, hin, final)
    return (dx, ddt, dA, dB, dC, None, dD if has_D else None, dz if has_z else None, dbias if has_bias else None,
            None, None, None, dinit if has_init else None, None, None, None, None)


ssd_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)
fastpath(ssd_fwd_op, _ssd_fwd_impl, setup_context=_setup_context, backward=_autograd_backward)


def _ssd_fwd_into_impl(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Optional[Tensor],
                       z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float,
                       dt_max: float, initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
                       cu_seqlens: Optional[Tensor], final_out: Tensor) -> Tensor:
    """The forward without autograd or anything kept -> y; the final states are written into ``final_out``
    (nstates, h, p, n) contiguous, any float dtype (the kernels round them on store), which may be
    ``initial_states`` itself (an inference cache the prompt continues from)."""
    return _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states,
                    seq_idx, cu_seqlens, final_out)[0]


ssd_fwd_into_op = torch.library.custom_op("mamba_parallel::ssd_chunk_scan_fwd_into",
                                          mutates_args=("final_out",))(_ssd_fwd_into_impl)
fastpath(ssd_fwd_into_op, _ssd_fwd_into_impl)


@ssd_fwd_into_op.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_states, seq_idx, cu_seqlens,
      final_out):
    return x.new_empty(x.shape)


def _stores_directly(final_out: Tensor, x: Tensor) -> bool:
    """Whether the kernels write the final states into ``final_out`` themselves: fp32, or any dtype on a GPU (their
    store rounds to nearest even, as a copy does; the CPU interpreter's bf16 rounding is not exact, so there a
    narrower buffer gets the fp32 states by one copy)."""
    return final_out.dtype == torch.float32 or (x.is_cuda and not interpret_mode())


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, cu_seqlens=None,
                   return_final_states=False, recompute_states=False, final_states_out=None):
    """Triton path of ``mamba_parallel.ops.ssd_chunk_scan`` (arguments already checked there).

    x (b, L, h, p); dt (b, L, h); A (h,); B/C (b, L, g, n); D (h,) or (h, p); z (b, L, h, p); dt_bias (h,);
    initial_states (b, h, p, n) or (nseq, h, p, n) with cu_seqlens -> y (b, L, h, p) [, final (.., h, p, n) fp32].
    chunk_size must be a power of two >= 16; the kernels run at min(chunk_size, KERNEL_CHUNK_MAX).
    ``final_states_out`` (.., h, p, n) contiguous: the final states are written there (rounded to its dtype) and it
    is what comes back as the final states; without autograd the kernels write it themselves (no fp32 buffer, no
    copy), else it takes a copy of the differentiable ones.
    """
    args = (x, dt, A, B, C, kernel_chunk(int(chunk_size)), D, z, dt_bias, bool(dt_softplus), float(dt_limit[0]),
            float(dt_limit[1]), initial_states, seq_idx, cu_seqlens)
    into = final_states_out is not None
    if into and not (torch.is_grad_enabled() and _any_requires_grad(x, dt, A, B, C, D, z, dt_bias, initial_states)):
        direct = _stores_directly(final_states_out, x)
        out = final_states_out if direct else torch.empty(final_states_out.shape, device=x.device,
                                                          dtype=torch.float32)
        y = eager(ssd_fwd_into_op)(*args, out)
        if not direct:
            final_states_out.copy_(out)
        return (y, final_states_out) if return_final_states else y
    y, final, *_ = eager(ssd_fwd_op)(*args, bool(return_final_states or into), not recompute_states)
    if into:
        final = final_states_out.copy_(final)
    return (y, final) if return_final_states else y
