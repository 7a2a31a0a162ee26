"""Triton selective scan (Mamba-1): forward and backward as ``torch.library`` custom ops with autograd.

Arguments are already validated by ``mamba_parallel.ops.selective_scan.selective_scan``. Varlen input is turned into
a per-token sequence id (b, L) int32 here: ``seq_idx`` as given, or derived from ``cu_seqlens`` (then
``varlen=True``: initial / last states are per packed sequence). The backward recomputes the states from
checkpoints taken every chunk of S tokens (or every K chunks, ``checkpoint_every``: the backward then rebuilds the
states entering the chunks in between first), so the (b, d, n, L) states are never stored. Carries, checkpoints, A and
dA are state-major ((., n, d)): a warp's accesses to one state are one coalesced access.

``path`` (launch.py) is the kernel path: the caller picks it once (``scan_path``, or the default request of
``selective_scan``), it travels with the forward's custom op into its autograd context, and the backward plans
its launch from it, so both directions always agree (on the chunk, and so on the checkpoints).

The backward kernel leaves partial sums (dB / dC per channel block or warp, dA / dD / d delta_bias per sequence);
``triton_finish.finish_bwd`` reduces them all in one launch (a small model's step is bound by host launch cost),
casting into the outputs.

Layer-facing API (stable; the fused training path in layers/mamba1.py runs the scan inside its own autograd node):
``scan_path(u, delta, z, A, B, varlen=False)`` -> path; ``scan_forward(...)`` (the forward op's body) and
``scan_backward(...)`` (the backward's, which can write dB / dC straight into a caller's buffer, e.g. slices of the
x_proj output's gradient, and return dA times a scale: A for d A_log).
"""

from __future__ import annotations

import functools

import torch
import triton

from mamba_parallel.ops.backend import gpu_compiled
from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.selective_scan import launch
from mamba_parallel.ops.selective_scan.triton_bwd import selective_scan_bwd_kernel
from mamba_parallel.ops.selective_scan.triton_bwd_carry import adjoint_carry_kernel
from mamba_parallel.ops.selective_scan.triton_finish import finish_bwd
from mamba_parallel.ops.selective_scan.triton_fwd import selective_scan_fwd_kernel


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """B / C (b, n, L) -> (b, 1, n, L) view; grouped (b, g, n, L) unchanged."""
    return t.unsqueeze(1) if t.dim() == 3 else t


def _bc32(t: torch.Tensor) -> torch.Tensor:
    """B / C as (b, g, n, L) fp32: they are small (no d axis) and read n times per token, so converting them once
    here saves the kernels a conversion per element and state. An fp32 (b, g, n, L) tensor (a caller that
    converted once for the forward and backward) comes back as is, without a copy."""
    return _as4d(t).float()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr function: ~1-2 us per host call, several per scan


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sms(u: torch.Tensor) -> int | None:
    """The GPU's SM count, or None in the interpreter."""
    return _sm_count(u.device) if gpu_compiled(u) else None


def _scan_shape(u, delta, z, A, B, varlen: bool) -> launch.ScanShape:
    """What the launch choice depends on. The row-per-thread layout needs token-major u / delta / z and, on a GPU,
    rows Triton vectorises: strides divisible by 16 elements and 16-byte-aligned pointers (L % 16 == 0)."""
    b, d, L = u.shape
    rows = [t for t in (u, delta, z) if t is not None]
    token_major = all(t.stride(2) == 1 for t in rows)
    aligned = L % 16 == 0 and all(t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0 and t.data_ptr() % 16 == 0
                                  for t in rows)
    return launch.ScanShape(batch=b, d=d, n=A.shape[1], groups=_as4d(B).shape[1], seqlen=L,
                            elem_size=u.element_size(), row_layout=token_major and (aligned or not gpu_compiled(u)),
                            varlen=varlen)


def _plan(u, delta, z, A, B, varlen: bool, path: str | None) -> launch.ScanPlan:
    return launch.plan(_scan_shape(u, delta, z, A, B, varlen), _sms(u), path)


def scan_path(u: torch.Tensor, delta: torch.Tensor, z: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
              varlen: bool = False, path: str | None = None) -> str:
    """The forward path the scan of these tensors runs (``path`` None: the default; launch.plan). Pass it to
    ``scan_forward`` and ``scan_backward`` of the same tensors."""
    return _plan(u, delta, z, A, B, varlen, path).fwd.path


def _strides(u, delta, z, B4, C4, sid) -> tuple[int, ...]:
    return (*u.stride(), *delta.stride(), *z.stride(), *B4.stride(), *C4.stride(),
            sid.stride(0) if sid is not None else 0)


def _tile_meta(run: launch.Launch) -> dict:
    """The constexprs and launch options both kernels share."""
    meta = dict(BD=run.block_d, P=run.vectors, V=run.vec, UNROLL=run.unroll, STAGES=run.stages, EMU=run.emulate,
                num_warps=run.num_warps)
    if run.maxnreg:
        meta["maxnreg"] = run.maxnreg
    return meta


def default_checkpoint_dtype(u: torch.Tensor, checkpoint_every: int) -> torch.dtype:
    """The checkpoints' dtype when the caller names none: bf16 for bf16 inputs with one checkpoint per chunk
    (half of one of the largest things a Mamba-1 layer keeps; the gradients move by less than the inputs' own
    bf16 rounding does, docs/memory.md), else fp32 (fp16 inputs: a state may outgrow fp16's range)."""
    return torch.bfloat16 if u.dtype == torch.bfloat16 and checkpoint_every == 1 else torch.float32


def _checkpoints_apart(save_ckpt: bool, ck: int, checkpoint_dtype: torch.dtype) -> bool:
    """Whether the checkpoints have their own narrower buffer (the kernels' CKPT_APART): one per chunk, not fp32."""
    return save_ckpt and ck == 1 and checkpoint_dtype != torch.float32


def scan_forward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                 initial_state: torch.Tensor | None, sid: torch.Tensor | None, delta_softplus: bool,
                 varlen: bool, nstates: int, save_ckpt: bool, path: str, checkpoint_every: int = 1,
                 checkpoint_dtype: torch.dtype = torch.float32,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u, delta, z (b, d, L); A (d, n); B, C (b, [g,] n, L); sid (b, L) int32 -> y (b, d, L),
    last_state (nstates, d, n) fp32, checkpoints (b, cdiv(nchunks, checkpoint_every), n, d) (state-major: the
    states entering chunks 0, K, 2K, ..; empty unless save_ckpt: with z, the backward also rebuilds y before the
    gate from them). path: launch.FORWARD_PATHS; checkpoint_every K: a power of two (pass the
    same to ``scan_backward``). checkpoint_dtype: fp32, or bf16 where K is 1 (the forward itself still carries
    its state in fp32; only the backward restarts each chunk from the rounded state)."""
    run = _plan(u, delta, z, A, B, varlen, path).fwd
    y, hlast, ckpt = _forward(run, u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus,
                              varlen, nstates, save_ckpt, checkpoint_every, checkpoint_dtype, None)
    return y, hlast, ckpt if ckpt is not None else u.new_empty((0,), dtype=torch.float32)


def gated_forward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None, z: torch.Tensor, delta_bias: torch.Tensor | None, sid: torch.Tensor | None,
                  path: str, gated_out: torch.Tensor, checkpoint_every: int = 1,
                  checkpoint_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fused layer's training forward (softplus on delta, no initial state, checkpoints kept): gated_out
    (b, d, L, any strides, u's dtype) <- y * silu(z), e.g. out_proj's (b, L, d) input transposed, so that y itself
    is never written. u, delta (b, d, L); z (b, d, L) any strides: read only after the state loop, where a
    channel-contiguous view (in_proj's output) costs the kernel nothing, so the launch is planned without it:
    path = scan_path(u, delta, None, A, B), which ``scan_backward`` with ``dgated`` plans from too.
    -> the checkpoints, as ``scan_forward`` returns them."""
    _check_like_u("selective_scan gated forward", u, ("gated_out",), z=z, gated_out=gated_out)
    run = _plan(u, delta, None, A, B, False, path).fwd
    return _forward(run, u, delta, A, B, C, D, z, delta_bias, None, sid, True, False, u.shape[0], True,
                    checkpoint_every, checkpoint_dtype, None, gated_out)[2]


def _check_like_u(op: str, u: torch.Tensor, typed: tuple[str, ...] = (), **tensors: torch.Tensor | None) -> None:
    """Each given tensor must have u's shape; those named in ``typed`` also u's dtype."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.shape != u.shape:
            raise ValueError(f"{op}: {name} {tuple(t.shape)} must have the shape {tuple(u.shape)} (u's)")
        if name in typed and t.dtype != u.dtype:
            raise ValueError(f"{op}: {name} is {t.dtype}, u is {u.dtype}: they must match")


def forward_launch(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> launch.Launch:
    """The forward launch ``scan_forward(..., path=scan_path(u, delta, None, A, B))`` runs for these tensors (no z,
    no cu_seqlens), planned once: for ``scan_into``."""
    shape, sms = _scan_shape(u, delta, None, A, B, False), _sms(u)
    return launch.plan(shape, sms, launch.plan(shape, sms).fwd.path).fwd  # both cached


def scan_into(run: launch.Launch, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None, delta_bias: torch.Tensor | None,
              initial_state: torch.Tensor | None, sid: torch.Tensor | None, last: torch.Tensor | None,
              z: torch.Tensor | None = None, y_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference forward (no cu_seqlens, no checkpoints, softplus on delta) with the launch ``run`` from
    ``forward_launch`` of the same tensors -> y (b, d, L), last_state. ``last`` (b, d, n), or None (a new fp32
    tensor): where the last state is written and what comes back as it, e.g. the inference cache's state, which
    may also be ``initial_state`` (the kernel reads the initial state from its own copy, made before it runs). An
    fp32 contiguous one is the kernel's own output; any other gets the fp32 state rounded into it by one copy.
    z (b, d, L, any strides; read after the state loop, as in ``gated_forward``): y is gated, y * silu(z);
    y_out (b, d, L, any strides, u's dtype): y is written there and returned."""
    _check_like_u("selective_scan_into", u, ("y_out",), z=z, y_out=y_out)
    direct = last if last is None or (last.dtype == torch.float32 and last.is_contiguous()) else None
    y, hlast, _ = _forward(run, u, delta, A, B, C, D, z, delta_bias, initial_state, sid, True, False,
                           u.shape[0], False, 1, torch.float32, direct, y_out)
    return y, (hlast if direct is last else last.copy_(hlast))


def _forward(run, u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates,
             save_ckpt, checkpoint_every, checkpoint_dtype, last, y=None):
    """``scan_forward``'s body for the launch ``run``; ``last``: the last state's buffer or None; ``y``: the
    output's buffer (any strides) or None. The checkpoints come back as None where not made."""
    b, d, L = u.shape
    n = A.shape[1]
    nchunks = _cdiv(L, run.chunk)
    ck = launch.checkpoint_group(checkpoint_every, nchunks) if save_ckpt else 1
    if save_ckpt and ck > 1 and checkpoint_dtype != torch.float32:
        raise ValueError(f"selective_scan: {checkpoint_dtype} checkpoints need one per chunk (checkpoint_every 1), "
                         f"got checkpoint_every {checkpoint_every}")
    apart = _checkpoints_apart(save_ckpt, ck, checkpoint_dtype)
    B4, C4 = _bc32(B), _bc32(C)
    dev, f32 = u.device, torch.float32
    if y is None:
        y = torch.empty((b, d, L), device=dev, dtype=u.dtype)
    if varlen:  # a sequence with no tokens keeps its initial state
        hlast = (initial_state.float().clone() if initial_state is not None
                 else torch.zeros((nstates, d, n), device=dev, dtype=f32))
    elif last is not None:
        hlast = last
    else:
        hlast = torch.empty((nstates, d, n), device=dev, dtype=f32)
    # the fp32 checkpoints, or a ping-pong carry (no checkpoints, or checkpoints apart); slot 0 is the state the
    # kernel starts from
    nslots = _cdiv(nchunks, ck) if save_ckpt and not apart else min(nchunks, 2)
    h0_fill = initial_state is not None and not varlen
    if save_ckpt or h0_fill:
        states = torch.empty((b, nslots, n, d), device=dev, dtype=f32)
        if h0_fill:
            states[:, 0] = initial_state.transpose(1, 2)
        else:
            states[:, 0] = 0.0
    else:  # at most two slots: zeroing both costs one call, not two
        states = torch.zeros((b, nslots, n, d), device=dev, dtype=f32)
    if apart:  # the kernels' carry_ptr: the checkpoints in their own dtype
        carry = torch.empty((b, nchunks, n, d), device=dev, dtype=checkpoint_dtype)
        carry[:, 0] = states[:, 0]
    else:
        carry = torch.empty((b, 2, n, d), device=dev, dtype=f32) if ck > 1 else states  # between the checkpoints
    h0 = initial_state.contiguous() if initial_state is not None else None
    zz = z if z is not None else u
    opt = lambda t: t if t is not None else y  # noqa: E731  (pointer placeholder for an absent tensor)
    meta = _tile_meta(run)
    if run.unrolled_states:
        meta.update(NS=run.unrolled_states, PREFETCH=run.prefetch)
    selective_scan_fwd_kernel[(d // run.block_d, b)](
        u, delta, zz, B4, C4, A.t().contiguous(), opt(D), opt(delta_bias), opt(h0), opt(sid), y, y, hlast,
        states, carry, L, d, n, d // B4.shape[1], nchunks, nslots, nchunks, *_strides(u, delta, zz, B4, C4, sid),
        *y.stride(), HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_H0=h0 is not None, HAS_SID=sid is not None, VARLEN=varlen,
        FAST_EXP=gpu_compiled(u), R=run.rows, LANES=run.row_layout, CKPT=save_ckpt, CK=ck, CKPT_APART=apart, **meta,
    )
    ckpt = (carry if apart else states) if save_ckpt else None
    return y, hlast, ckpt


selective_scan_fwd = torch.library.custom_op("mamba_parallel::selective_scan_fwd", mutates_args=())(scan_forward)


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates, save_ckpt, path,
      checkpoint_every=1, checkpoint_dtype=torch.float32):
    b, d, L = u.shape
    n = A.shape[1]
    nchunks = triton.cdiv(L, launch.chunk_tokens(L, interp=not gpu_compiled(u)))
    apart = _checkpoints_apart(save_ckpt, launch.checkpoint_group(checkpoint_every, nchunks), checkpoint_dtype)
    return (u.new_empty((b, d, L)), u.new_empty((nstates, d, n), dtype=torch.float32),
            u.new_empty((b, triton.cdiv(nchunks, checkpoint_every), n, d) if save_ckpt else (0,),
                        dtype=checkpoint_dtype if apart else torch.float32))


def scan_backward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                  initial_state: torch.Tensor | None, sid: torch.Tensor | None, ckpt: torch.Tensor,
                  dy: torch.Tensor, dlast: torch.Tensor | None, delta_softplus: bool, varlen: bool, path: str,
                  dB_out: torch.Tensor | None = None, dC_out: torch.Tensor | None = None,
                  dA_scale: torch.Tensor | None = None, checkpoint_every: int = 1, dz_out: torch.Tensor | None = None,
                  gated_out: torch.Tensor | None = None, dgated: torch.Tensor | None = None,
                  segments: int | None = None, du_out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Gradients [du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state] in the inputs' dtypes and
    shapes; an absent optional input gets an empty tensor. path: the forward's. B / C: (b, [g,] n, L) of any dtype
    (e.g. the layer's bf16 views, or fp32 (b, g, n, L) tensors a caller converted once for the forward: no copy
    then). dB_out / dC_out (B-shaped (b, [g,] n, L), any strides and dtype, e.g. slices of the caller's x_proj
    output gradient): dB / dC are written there and the list holds empty placeholders for them. dA_scale (d, n):
    the returned dA is dA * dA_scale (A = -exp(A_log) with dA_scale = A gives d A_log). checkpoint_every: the
    forward's; with K > 1 the states entering the chunks between checkpoints are rebuilt into a (b, K, n, d) fp32
    scratch (each program its own channels' slots) before each group of K chunks is walked in reverse. ckpt: the
    forward's checkpoints, fp32 or (K = 1) bf16. With z, dy is the gated output's gradient and y before the gate
    is rebuilt from the recomputed states, unless ``dgated`` (u-shaped, any strides) is given: then that is the
    gated output's gradient and dy is already y's (dgated * silu(z)), which keeps channel-contiguous views of z and
    dgated (a layer's (b, L, .) buffers) out of the kernel's state loop. dz_out (u-shaped, any strides, z's
    dtype, e.g. the z half of in_proj's output gradient): dz is written there (an empty placeholder in the list);
    gated_out (u-shaped, any strides): also receives y * silu(z), the forward's output (a fused layer's out_proj
    input). segments: how many parts of the sequence the backward walks at once (None: what fills the GPU).
    du_out (u-shaped, any strides, u's dtype): du is written there and returned as the list's first entry, e.g.
    channels-last for a causal conv's backward, which reads its input's gradient in rows of channels."""
    b, d, L = u.shape
    n = A.shape[1]
    # with dgated, z is read only after the state loop, where its layout costs the kernel nothing: the plan (its
    # row-per-thread layout, which needs token-major rows) is the forward's, which ran without z
    run = _plan(u, delta, None if dgated is not None else z, A, B, varlen, path).bwd
    nchunks = _cdiv(L, run.chunk)
    ck = launch.checkpoint_group(checkpoint_every, nchunks)
    ngroups = _cdiv(nchunks, ck)
    seg_chunks = launch.backward_segment_chunks(b, d, nchunks, ck, _sms(u), segments)
    nseg = _cdiv(nchunks, seg_chunks)
    if ckpt.shape != (b, ngroups, n, d) or (ck > 1 and ckpt.dtype != torch.float32):
        raise RuntimeError(f"selective_scan_bwd: checkpoints {tuple(ckpt.shape)} {ckpt.dtype} do not match chunks "
                           f"of {run.chunk} tokens, one kept per {checkpoint_every} (path {path!r}; fp32 unless one "
                           "per chunk): pass the forward's path, checkpoint_every and tensors")
    if (dz_out is not None or gated_out is not None or dgated is not None) and z is None:
        raise ValueError("selective_scan_bwd: dz_out / gated_out / dgated need z (the gate)")
    for name, out in (("dB_out", dB_out), ("dC_out", dC_out)):
        if out is not None and out.shape != B.shape:
            raise ValueError(f"selective_scan_bwd: {name} {tuple(out.shape)} must have the shape {tuple(B.shape)} "
                             "(B / C's)")
    _check_like_u("selective_scan_bwd", u, ("du_out",), dz_out=dz_out, du_out=du_out, gated_out=gated_out,
                  dgated=dgated)
    B4, C4 = _bc32(B), _bc32(C)
    G = B4.shape[1]
    bd = run.block_d
    nblk = d // 32 if run.row_layout else d // bd  # dB / dC partials: per warp or per program
    dev, f32 = u.device, torch.float32
    dy = dy.contiguous()
    dout = dgated if dgated is not None else dy  # the gated output's gradient, for dz
    du = du_out if du_out is not None else torch.empty((b, d, L), device=dev, dtype=u.dtype)
    ddt = torch.empty((b, d, L), device=dev, dtype=delta.dtype)
    dz = dz_out if dz_out is not None or z is None else torch.empty((b, d, L), device=dev, dtype=z.dtype)
    dBp = torch.empty((b, nblk, n, L), device=dev, dtype=f32)
    dCp = torch.empty((b, nblk, n, L), device=dev, dtype=f32)
    # sums over tokens, per segment and sequence
    dA = torch.zeros((nseg * b, n, d), device=dev, dtype=f32)
    dD = torch.empty((nseg * b, d), device=dev, dtype=f32) if D is not None else None
    ddtb = torch.empty((nseg * b, d), device=dev, dtype=f32) if delta_bias is not None else None
    adj = torch.empty((nseg, b, 2, n, d), device=dev, dtype=f32)  # ping-pong adjoint carries
    # the states entering a group's chunks, rebuilt from its checkpoint: each program reads back only its own
    # channels' slots, so (b, ck, n, d) of them per segment stay in L2 while the group is walked
    scratch = torch.empty((nseg, b, ck, n, d), device=dev, dtype=f32) if ck > 1 else adj
    h0 = initial_state.contiguous() if initial_state is not None else None
    dl = dlast.contiguous() if dlast is not None else None
    if dl is not None and not varlen:  # read per chunk and state: state-major
        dl = dl.transpose(1, 2).contiguous()
    if h0 is None:
        dh0 = None
    elif varlen:  # a sequence with no tokens passes d(last_state) straight to its initial state
        dh0 = dl.float().clone() if dl is not None else torch.zeros(h0.shape, device=dev, dtype=f32)
    else:
        dh0 = torch.empty(h0.shape, device=dev, dtype=f32)
    zz = z if z is not None else u
    opt = lambda t: t if t is not None else du  # noqa: E731  (pointer placeholder for an absent tensor)
    At = A.t().contiguous()
    gl, ds, rs = (adj, adj, adj) if nseg == 1 else _segment_carries(
        delta, delta_bias, z if dgated is None else None, dy, C4, At, dl, sid, delta_softplus, varlen, nseg,
        seg_chunks * run.chunk, run)
    meta = _tile_meta(run)
    if run.row_layout:
        meta.update(LP=run.vectors.bit_length() - 1, LV=run.vec.bit_length() - 1)
    selective_scan_bwd_kernel[(d // bd, b, nseg)](
        u, delta, zz, B4, C4, At, opt(D), opt(delta_bias), opt(h0), opt(sid), ckpt,
        opt(gated_out), dy, opt(dl), dout,
        du, ddt, opt(dz), dBp, dCp, dA, opt(dD), opt(ddtb), opt(dh0), adj, scratch, gl, ds, rs,
        L, d, n, d // G, nchunks, nblk, ngroups if ck > 1 else nchunks, seg_chunks, nseg,
        *_strides(u, delta, zz, B4, C4, sid),
        *dout.stride(), *opt(dz).stride(), *opt(gated_out).stride(), *du.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_H0=h0 is not None, HAS_SID=sid is not None, VARLEN=varlen, HAS_DLAST=dl is not None,
        FAST_EXP=gpu_compiled(u), LANE_SUM=run.row_layout, CK=ck, GATED=gated_out is not None,
        DY_GATED=dgated is not None, **meta,
    )
    empty = lambda: u.new_empty((0,))  # noqa: E731  (distinct tensors: custom-op outputs may not alias)
    dB = torch.empty(B.shape, device=dev, dtype=B.dtype) if dB_out is None else dB_out
    dC = torch.empty(C.shape, device=dev, dtype=C.dtype) if dC_out is None else dC_out
    dA_out = torch.empty((d, n), device=dev, dtype=A.dtype)
    dD_out = torch.empty((d,), device=dev, dtype=D.dtype) if D is not None else None
    ddtb_out = torch.empty((d,), device=dev, dtype=delta_bias.dtype) if delta_bias is not None else None
    # one launch for the sums over channel blocks (blocks never straddle a group) and over sequences
    finish_bwd(dBp, dCp, dA, dD, ddtb, G, _as4d(dB), _as4d(dC), dA_out, dD_out, ddtb_out, dA_scale=dA_scale)
    return [du, ddt, dA_out, dB if dB_out is None else empty(), dC if dC_out is None else empty(),
            dD_out if dD_out is not None else empty(),
            dz if dz is not None and dz_out is None else empty(),
            ddtb_out if ddtb_out is not None else empty(),
            dh0.to(initial_state.dtype) if dh0 is not None else empty()]


def _segment_carries(delta, delta_bias, gate_z, dy, C4, At, dl, sid, delta_softplus: bool, varlen: bool,
                     nseg: int, seg_len: int, run: launch.Launch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The carries the later segments feed each segment's walk (triton_bwd_carry.py), in the backward launch
    ``run``'s tiles -> gl (b, nseg, n, d), ds (b, nseg, d) fp32 and rs (b, nseg) int32 (with sid; else ds again,
    unread). gate_z: z when dy is the gated output's gradient (times silu(z) here too), else None."""
    b, d, L = delta.shape
    n = At.shape[0]
    dev, f32 = delta.device, torch.float32
    gl = torch.empty((b, nseg, n, d), device=dev, dtype=f32)
    ds = torch.empty((b, nseg, d), device=dev, dtype=f32)
    rs = torch.empty((b, nseg), device=dev, dtype=torch.int32) if sid is not None else ds
    ns = min(n, launch.CARRY_STATES, run.chunk)  # states per program, in token slots of a tile
    ngrp = _cdiv(n, ns)
    zz = gate_z if gate_z is not None else delta
    opt = lambda t: t if t is not None else ds  # noqa: E731  (pointer placeholder for an absent tensor)
    adjoint_carry_kernel[(d // run.block_d, b, (nseg - 1) * ngrp)](
        delta, opt(delta_bias), zz, dy, C4, At, opt(dl), opt(sid), gl, ds, rs,
        L, d, n, d // C4.shape[1], seg_len, nseg, ngrp, *delta.stride(), *zz.stride(), *C4.stride(),
        sid.stride(0) if sid is not None else 0,
        HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus, GATE_DY=gate_z is not None,
        HAS_DLAST=dl is not None, HAS_SID=sid is not None, VARLEN=varlen, FAST_EXP=gpu_compiled(delta),
        BD=run.block_d, P=run.vectors, V=run.vec, NS=ns, LANES=run.row_layout, num_warps=run.num_warps)
    return gl, ds, rs


def _scan_bwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
              initial_state: torch.Tensor | None, sid: torch.Tensor | None, ckpt: torch.Tensor,
              dy: torch.Tensor, dlast: torch.Tensor | None, delta_softplus: bool, varlen: bool, path: str,
              checkpoint_every: int = 1) -> list[torch.Tensor]:
    """The custom op's body: ``scan_backward`` with fresh outputs for every gradient."""
    return scan_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, dy, dlast,
                         delta_softplus, varlen, path, checkpoint_every=checkpoint_every)


selective_scan_bwd = torch.library.custom_op("mamba_parallel::selective_scan_bwd", mutates_args=())(_scan_bwd)
fastpath(selective_scan_bwd, _scan_bwd)


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, dy, dlast, delta_softplus, varlen,
      path, checkpoint_every=1):
    like = lambda t: torch.empty_like(t) if t is not None else u.new_empty((0,))  # noqa: E731
    return [torch.empty_like(u), torch.empty_like(delta), torch.empty_like(A), torch.empty_like(B),
            torch.empty_like(C), like(D), like(z), like(delta_bias), like(initial_state)]


def _setup_context(ctx, inputs, output):
    (u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates, save_ckpt, path,
     checkpoint_every, _checkpoint_dtype) = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, output[2])
    ctx.delta_softplus, ctx.varlen, ctx.path, ctx.checkpoint_every = delta_softplus, varlen, path, checkpoint_every


def _backward(ctx, dy, dlast, _dckpt):
    u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt = ctx.saved_tensors
    if ckpt.numel() == 0:
        raise RuntimeError("selective_scan: backward through a forward that ran without grad enabled")
    if dy is None:  # only last_state reached the loss
        dy = torch.zeros_like(u)
    grads = eager(selective_scan_bwd)(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, dy,
                                      dlast, ctx.delta_softplus, ctx.varlen, ctx.path, ctx.checkpoint_every)
    du, ddt, dA, dB, dC, dD, dz, ddtb, dh0 = grads
    none_if_absent = lambda g, t: g if t is not None else None  # noqa: E731
    return (du, ddt, dA, dB, dC, none_if_absent(dD, D), none_if_absent(dz, z), none_if_absent(ddtb, delta_bias),
            none_if_absent(dh0, initial_state), None, None, None, None, None, None, None, None)


selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)
fastpath(selective_scan_fwd, scan_forward, setup_context=_setup_context, backward=_backward)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
                   return_last_state=False, seq_idx=None, cu_seqlens=None, path=None, checkpoint_every=1,
                   checkpoint_dtype=None):
    """Same contract as ``mamba_parallel.ops.selective_scan.selective_scan`` (u (b, d, L) -> y (b, d, L)
    [, last_state (b or nseq, d, n) fp32]). ``path`` (launch.FORWARD_PATHS; tests and benchmarks): the kernel path
    to run instead of the default, where the shape and layout allow it. ``checkpoint_every``,
    ``checkpoint_dtype``: as the public op's."""
    b, d, L = u.shape
    if L == 0:  # nothing to scan: the reference handles the empty edge case
        from mamba_parallel.ops.selective_scan import naive
        return naive.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                                    return_last_state, seq_idx, cu_seqlens)
    if cu_seqlens is not None:
        positions = torch.arange(L, device=u.device, dtype=cu_seqlens.dtype)
        sid = torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).to(torch.int32)[None]
        varlen, nstates = True, cu_seqlens.numel() - 1
    else:
        sid = seq_idx.to(torch.int32) if seq_idx is not None else None
        varlen, nstates = False, b
    if path is None:  # by the shape alone (traceable); each op body then plans with the layout too
        path = launch.default_request(b, d, A.shape[1], varlen, _sms(u))
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    save_ckpt = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if checkpoint_dtype is None:
        checkpoint_dtype = default_checkpoint_dtype(u, checkpoint_every)
    y, last, _ = eager(selective_scan_fwd)(u, delta, A, B, C, D, z, delta_bias, initial_state, sid,
                                              delta_softplus, varlen, nstates, save_ckpt, path, checkpoint_every,
                                              checkpoint_dtype)
    return (y, last) if return_last_state else y
