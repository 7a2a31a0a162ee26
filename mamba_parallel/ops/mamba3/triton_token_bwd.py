"""The last step of the Mamba-3 backward: the per-token chain rule from the kernels' gradients to the scan's inputs.

chunk_bwd leaves, per token, the gradients of the trapezoid weights w and gamma (dw, dg) and what the decay's log
reaches through that token alone (da); unrotate what the phase reaches through the token's own B and C (dphi).
Here, one program per (batch row, head, chunk):

- da and dphi summed from the end of the chunk (a token's log decay and phase step reach every later token of it):
  the kernels before leave these reverse cumulative sums here, where no head loop or register-bound tile waits on
  them;
- the phase's carry from the later chunks of the sequence, added to dphi. Turning all phases after chunk c together
  moves the loss only through the final phase, the final state and the state leaving chunk c (read as if turned
  back), so the carry is d fin_angle + <d fin_ssm, J fin_ssm> - <dH, J H> at the chunk's end (TURN, the dstates
  kernel's slots summed; at a sequence's last chunk only d fin_angle). Summing the later chunks' per-token phase
  gradients gives the same in exact arithmetic, but as a small difference of large terms: over 1000 tokens in
  fp16 that made the angles' gradient 3e-3 off, against 8e-4 this way;
- with w_j = gamma_j + beta_{j+1}, gamma = trap dt, beta = (1 - trap) dt and the log decay dt A:
  d beta_t = dw_{t-1} (zero at a sequence's first token), and
  ddt = da A + trap (dw + dg) + (1 - trap) d beta + <dphi, angles>, dA = da dt, dtrap = dt (dw + dg - d beta),
  dangles = dphi dt.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _from_chunk_end(v):
    """v (T, ...) per token -> sum_{i >= t} v_i along the tokens (a token's step reaches the later ones)."""
    return tl.sum(v, 0) - tl.cumsum(v, 0) + v


@triton.jit
def token_bwd_kernel(DW, DG, DA, DPHI, DT, AA, TRAP, ANG, TURN, CINIT, CFINAL, CSEQ, END_ANG, END_TURN,
                     DDT, DAA, DTRAP, DANG, L, NC, H, NA, NPB, NDA, s_da,
                     sdb, sdt, sdh, sab, sat, sah, saa, spb, spt, sph,
                     T: tl.constexpr, BA: tl.constexpr, HAS_ENDS: tl.constexpr):
    """DW, DG, DT, AA, TRAP and the outputs DDT, DAA, DTRAP: (rows, L, h) fp32, one set of strides (sd*); DA
    (NDA, rows, L, h) the same, its slots s_da apart (summed here).
    ANG (rows, L, h, a) (strides sa*; a zero head stride is fine); DPHI and the output DANG share strides sp*
    (a contiguous). TURN (rows, h, nc, NPB, a) fp32. CINIT / CFINAL (rows, nc) the layout's chunk codes, CSEQ
    (rows * nc,) int64 the sequence of every chunk; END_ANG / END_TURN (nseq, h, a) fp32: d fin_angle and
    <d fin_ssm, J fin_ssm> per sequence (HAS_ENDS; zeros otherwise)."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    t = c * T + tl.arange(0, T)
    valid = t < L
    offs_a = tl.arange(0, BA)
    am = offs_a < NA
    m2 = valid[:, None] & am[None, :]

    # the carry of the later chunks, the same for every token of this one
    last = tl.load(CFINAL + b * NC + c) != -2  # the sequence ends in this chunk
    slots = TURN + ((b * H + h) * NC + c) * NPB * NA + offs_a
    at_end = tl.zeros((BA,), dtype=tl.float32)
    for s in range(NPB):
        at_end += tl.load(slots + s * NA, mask=am, other=0.0)
    carry = tl.where(last, 0.0, -at_end)
    if HAS_ENDS:
        seq = tl.load(CSEQ + b * NC + c)
        carry += tl.load(END_ANG + (seq * H + h) * NA + offs_a, mask=am, other=0.0)
        carry += tl.where(last, 0.0, tl.load(END_TURN + (seq * H + h) * NA + offs_a, mask=am, other=0.0))

    sc = b * sdb + h * sdh
    dt = tl.load(DT + sc + t * sdt, mask=valid, other=0.0)
    a = tl.load(AA + sc + t * sdt, mask=valid, other=0.0)
    trap = tl.load(TRAP + sc + t * sdt, mask=valid, other=0.0)
    dw = tl.load(DW + sc + t * sdt, mask=valid, other=0.0)
    dg = tl.load(DG + sc + t * sdt, mask=valid, other=0.0)
    da = tl.zeros((T,), dtype=tl.float32)  # per token: chunk_bwd's slots summed, then from the end of the chunk
    for s in range(NDA):
        da += tl.load(DA + s * s_da + sc + t * sdt, mask=valid, other=0.0)
    da = _from_chunk_end(da)
    # the first token of a sequence has none before it (-1: no sequence starts at this chunk)
    first = tl.where(tl.load(CINIT + b * NC + c) != -2, c * T, -1)
    has_prev = valid & (t > 0) & (t != first)
    dbeta = tl.load(DW + sc + (t - 1) * sdt, mask=has_prev, other=0.0)

    p_off = b * spb + h * sph + t[:, None] * spt + offs_a[None, :]
    own = tl.load(DPHI + p_off, mask=m2, other=0.0)  # through each token's own B / C: summed from the chunk's end
    dphi = _from_chunk_end(own) + carry[None, :]
    ang = tl.load(ANG + b * sab + h * sah + t[:, None] * sat + offs_a[None, :] * saa, mask=m2,
                  other=0.0).to(tl.float32)
    dgt = dw + dg
    ddt = da * a + trap * dgt + (1.0 - trap) * dbeta + tl.sum(dphi * ang, 1)
    tl.store(DDT + sc + t * sdt, ddt, mask=valid)
    tl.store(DAA + sc + t * sdt, da * dt, mask=valid)
    tl.store(DTRAP + sc + t * sdt, dt * (dgt - dbeta), mask=valid)
    tl.store(DANG + p_off, (dphi * dt[:, None]).to(DANG.dtype.element_ty), mask=m2)
