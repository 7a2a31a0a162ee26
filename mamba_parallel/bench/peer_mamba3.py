"""The Mamba-3 side of the peer adapter: mamba_ssm's Mamba-3 kernels, module and language model behind one API.

Every function takes a Mamba-3 layer's RAW inputs, the same tensors for every side: x, z (b, L, h, p); B, C
(b, L, [R,] g, n) after the RMS norms; dt, A (b, L, h) fp32 as both layers compute them (softplus; -softplus clamped
at A_floor); trap (b, L, h) before its sigmoid; angles (b, L, a) before pi * tanh (shared by the heads); D (h,);
B_bias / C_bias (h, [R,] n); MIMO scales mimo_x / mimo_z / mimo_o (h, R, p). Each side prepares them its own way,
and that preparation is timed with it: ours takes sigmoid / tanh and an expanded view; mamba_ssm's layer makes
(b, h, L) transposes of dt, A dt and trap, and an expanded fp32 angles tensor. The decode step starts one step
earlier, from dt / A before their softplus (with dt_bias, A_floor): ours discretizes inside its step kernel,
mamba_ssm's layer in torch before its step.

mamba_ssm ships Mamba3 as a module only (its LM class builds Mamba1 / Mamba2 blocks): its Mamba-3 LM here is its
MambaLMHeadModel with every mixer replaced by its Mamba3, initialised by its own init, its config saying
ssm_cfg.layer = "Mamba3" (what our from_pretrained reads back).
"""

from __future__ import annotations

import copy
import math
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from mamba_parallel.bench.peer import MambaSsmPeer, Peer, PeerUnavailable, ReferencePeer


def ours_scan(x, z, B, C, dt, A, trap, angles, D, B_bias, C_bias, chunk_size, mimo_x=None, mimo_z=None,
              mimo_o=None, op=None):
    """Our scan from the raw inputs (module docstring) -> y (b, L, h, p). ``op``: the scan function (default
    ``ops.mamba3.mamba3_chunk_scan``; the stand-in peer passes the reference)."""
    from mamba_parallel.ops.mamba3 import mamba3_chunk_scan

    b, L, h, _ = x.shape
    ang = (math.pi * torch.tanh(angles.float()))[:, :, None].expand(b, L, h, angles.shape[-1])
    return (op or mamba3_chunk_scan)(x, dt, A, B, C, torch.sigmoid(trap.float()), ang, chunk_size, D=D, z=z, B_bias=B_bias,
                             C_bias=C_bias, mimo_x=mimo_x, mimo_z=mimo_z, mimo_o=mimo_o,
                             rope="halved" if B.dim() == 5 else "interleaved")


def ours_step(state, x, z, B, C, dt, dt_bias, A, A_floor, trap, angles, D, B_bias, C_bias, mimo_x=None, mimo_z=None,
              mimo_o=None, op=None):
    """Our decode step from one token's raw projections (x (b, h, p), dt / A (b, h) before their softplus,
    angles (b, a), ...) as our layer calls it: discretized inside the step. ``op``: a step without that option
    (the stand-in peer's reference), fed ``naive.discretize``'s output. State in place."""
    from mamba_parallel.ops.mamba3 import Mamba3Discretization, mamba3_state_update, naive

    b, h, _ = x.shape
    ang = angles[:, None].expand(b, h, angles.shape[-1])
    rope = "halved" if B.dim() == 4 else "interleaved"
    disc = Mamba3Discretization(dt_bias, A_floor)
    kw = dict(D=D, z=z, B_bias=B_bias, C_bias=C_bias, mimo_x=mimo_x, mimo_z=mimo_z, mimo_o=mimo_o, rope=rope)
    if op is not None:
        dt, A, trap, ang = naive.discretize(dt, A, trap, ang, disc)
        return op(state, x, dt, A, B, C, trap, ang, **kw)
    return mamba3_state_update(state, x, dt, A, B, C, trap, ang, discretize=disc, **kw)


def peer_scan_call(siso_fn, mimo_fn, x, z, B, C, dt, A, trap, angles, D, B_bias, C_bias, chunk_size, mimo_x=None,
                   mimo_z=None, mimo_o=None):
    """mamba_ssm's mamba3_siso_combined / mamba3_mimo called as its Mamba3 layer calls them."""
    b, L, h, _ = x.shape
    ang = angles.float()[:, :, None].expand(b, L, h, angles.shape[-1])
    common = dict(Q=C, K=B, V=x, ADT=(A * dt).transpose(1, 2), DT=dt.transpose(1, 2), Trap=trap.transpose(1, 2),
                  Q_bias=C_bias, K_bias=B_bias, Angles=ang, D=D, Z=z, chunk_size=chunk_size)
    if B.dim() == 4:
        return siso_fn(**common)
    if mimo_fn is None:
        raise PeerUnavailable("mamba_ssm's Mamba-3 MIMO kernels need TileLang, which does not import here")
    return mimo_fn(**common, MIMO_V=mimo_x, MIMO_Z=mimo_z, MIMO_Out=mimo_o,
                   rotary_dim_divisor=B.shape[-1] // angles.shape[-1], dtype=x.dtype)


def peer_step_call(step_fn, state, x, z, B, C, dt, dt_bias, A, A_floor, trap, angles, D, B_bias, C_bias, **_):
    """mamba_ssm's Triton mamba3_siso_step (its module's decode uses a CuTe kernel; this is its Triton one), fed as
    its layer's _preprocess feeds it: dt and A discretized in torch, trap and angles raw."""
    if B.dim() == 4:
        raise PeerUnavailable("mamba_ssm has no Triton MIMO decode step (its MIMO step is a CuTe kernel)")
    b, h, _ = x.shape
    A = torch.clamp(-F.softplus(A.float()), max=-A_floor)
    dt = F.softplus(dt + dt_bias)
    return step_fn(C, B, x, A * dt, dt, trap, C_bias, B_bias, angles.float()[:, None].expand(b, h, angles.shape[-1]),
                   D=D, Z=z, Input_States=state)[0]


def _import_mamba_ssm():
    try:
        from mamba_ssm.modules import mamba3 as module
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step
    except Exception as e:  # an older mamba_ssm, or its compiled parts do not load here
        raise PeerUnavailable(f"mamba_ssm's Mamba-3 does not import ({type(e).__name__}: {e})") from e
    return module, mamba3_siso_combined, mamba3_siso_step


def mamba3_side(peer: Peer) -> SimpleNamespace:
    """The peer's Mamba-3 scan / step (raw inputs, see the module docstring) and its layer class."""
    if isinstance(peer, ReferencePeer):
        from mamba_parallel.layers.mamba3 import Mamba3
        from mamba_parallel.ops.mamba3 import naive

        return SimpleNamespace(scan=partial(ours_scan, op=naive.mamba3_chunk_scan),
                               step=partial(ours_step, op=naive.mamba3_state_update), layer=Mamba3)
    if isinstance(peer, MambaSsmPeer):
        module, siso, step_fn = _import_mamba_ssm()
        return SimpleNamespace(scan=partial(peer_scan_call, siso, module.mamba3_mimo_combined),
                               step=partial(peer_step_call, step_fn), layer=module.Mamba3)
    raise PeerUnavailable(f"no Mamba-3 side for the peer {peer.name}")


def build_peer_lm(peer: MambaSsmPeer, config, device, dtype=None) -> torch.nn.Module:
    """mamba_ssm's language model with mamba_ssm Mamba3 mixers (module docstring), initialised by mamba_ssm."""
    module, _, _ = _import_mamba_ssm()
    from mamba_ssm.models.mixer_seq_simple import _init_weights

    peer_config = peer.config(config)
    scaffold = copy.deepcopy(peer_config)
    scaffold.ssm_cfg = {"layer": "Mamba2"}
    model = peer.model_class()(scaffold, device=device, dtype=dtype)
    for i, block in enumerate(model.backbone.layers):
        block.mixer = module.Mamba3(config.d_model, layer_idx=i, device=device, dtype=dtype, **config.mixer_cfg)
        block.mixer.apply(partial(_init_weights, n_layer=config.n_layer,
                                  n_residuals_per_layer=2 if config.d_intermediate > 0 else 1))
    model.config = peer_config  # its save_pretrained then writes ssm_cfg.layer = "Mamba3"
    return model
