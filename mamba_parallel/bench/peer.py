"""The peer side of the side-by-side benchmarks: mamba_ssm (with causal-conv1d) and fla, behind one small adapter.

``load_peer("mamba_ssm")`` wraps the installed mamba_ssm 2.x: its SSD (``mamba_chunk_scan_combined``), its
selective scan (``selective_scan_fn``) and its ``MambaLMHeadModel`` (forward returns ``.logits``; ``generate(
input_ids, max_length, top_k=1, cg=True)``; ``save_pretrained`` writes config.json + pytorch_model.bin).
``load_peer("reference")`` is the same adapter over this package's pure-PyTorch reference ops and model, shaped like
mamba_ssm's API: it lets every benchmark path (inputs, timing, weights hand-over, tables, reports) run on a CPU.
``fla_ssd`` turns fla's ``chunk_simple_gla`` into the SSD with the preparation a Mamba-2 layer needs for it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from mamba_parallel.config import MambaConfig

IMPLS = ("mamba_ssm", "reference")
# mamba_ssm's MambaConfig fields; it hard-codes norm_epsilon = 1e-5.
_PEER_CONFIG_FIELDS = ("d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx",
                       "attn_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
                       "tie_embeddings")
_PEER_MLP = {"activation": "swiglu", "bias": False, "multiple_of": 128}  # mamba_ssm's GatedMLP


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why (e.g. mamba_ssm not importable)."""


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:
        return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (or the model itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def logits_of(out) -> torch.Tensor:
    """Logits from a model output: a tensor, or an object / tuple with ``.logits``."""
    return out if isinstance(out, torch.Tensor) else out.logits


class Peer:
    """What the benchmarks ask of the peer. Kernels take this package's argument names; models are the peer's."""

    name = "peer"

    def versions(self) -> dict:
        raise NotImplementedError

    # kernels ----------------------------------------------------------------------------------------------------
    def ssd(self, x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False):
        """y (b, L, h, p) of the SSD; shapes as ``mamba_parallel.ops.ssd_chunk_scan``."""
        raise NotImplementedError

    def selective_scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        """y (b, d, L) of the Mamba-1 scan; shapes as ``mamba_parallel.ops.selective_scan``."""
        raise NotImplementedError

    # models -----------------------------------------------------------------------------------------------------
    def config(self, config: MambaConfig):
        """The peer's config object for one of ours (same architecture)."""
        raise NotImplementedError

    def model_class(self):
        raise NotImplementedError

    def build_lm(self, config: MambaConfig, device, dtype=None) -> torch.nn.Module:
        """The peer's language model, initialised by the peer's own code (seed it first)."""
        return self.model_class()(self.config(config), device=device, dtype=dtype)

    def logits(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (b, L) -> logits (b, L, padded vocab), as the peer's users get them."""
        return logits_of(model(input_ids))

    def loss(self, model, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The peer's users' training loss: ``F.cross_entropy`` on its logits (targets[:, t]: token after t)."""
        logits = self.logits(model, input_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def save_pretrained(self, model, folder: str) -> None:
        """config.json + weights in mamba_ssm's format (what ``MambaLMHeadModel.from_pretrained`` of ours reads);
        ``model`` may be wrapped in DDP."""
        unwrap(model).save_pretrained(folder)

    def data_parallel(self, model: torch.nn.Module, device) -> torch.nn.Module:
        """The peer model in torch DDP over the default process group, as its users wrap it (torch's defaults).

        mamba_ssm's blocks use every parameter in each forward (the fused paths take the conv, dt, A, D, norm and
        out_proj weights as inputs of one autograd function), its forward returns a namedtuple, and it has no
        buffers: plain DDP fits, without ``find_unused_parameters`` or a static graph."""
        from torch.nn.parallel import DistributedDataParallel

        device = torch.device(device)
        if device.type != "cuda":
            return DistributedDataParallel(model)
        return DistributedDataParallel(model, device_ids=[torch.cuda.current_device() if device.index is None
                                                          else device.index])

    def generate(self, model, input_ids: torch.Tensor, new_tokens: int, cuda_graph: bool) -> torch.Tensor:
        """Greedy generation through the peer's public ``generate``: (b, L) -> (b, L + new_tokens)."""
        return model.generate(input_ids, max_length=input_ids.shape[1] + new_tokens, top_k=1, cg=cuda_graph)

    def release(self, model) -> None:
        """Drop what generation cached on the model (CUDA graphs, their memory pool)."""
        model = unwrap(model)
        if getattr(model, "_decoding_cache", None) is not None:
            model._decoding_cache = None


class MambaSsmPeer(Peer):
    """mamba_ssm 2.x (+ causal-conv1d) as installed; import errors become ``PeerUnavailable``."""

    name = "mamba_ssm"

    def __init__(self):
        try:
            from mamba_ssm.models.config_mamba import MambaConfig as PeerConfig
            from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except Exception as e:  # ImportError, or a CUDA extension that does not load
            raise PeerUnavailable(f"mamba_ssm does not import ({type(e).__name__}: {e})") from e
        self._config_cls, self._model_cls = PeerConfig, MambaLMHeadModel
        self._ssd, self._scan = mamba_chunk_scan_combined, selective_scan_fn

    def versions(self) -> dict:
        return {"mamba_ssm": _version("mamba_ssm"), "causal_conv1d": _version("causal_conv1d"),
                "fla": _version("fla")}

    def ssd(self, x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False):
        return self._ssd(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)

    def selective_scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        return self._scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)

    def config(self, config: MambaConfig):
        if config.norm_epsilon != 1e-5:
            raise PeerUnavailable(f"mamba_ssm fixes norm_epsilon at 1e-5; this model has {config.norm_epsilon}")
        mlp = getattr(config, "mlp_params", _PEER_MLP)
        if getattr(config, "mlp_layer_idx", None) or mlp != _PEER_MLP:
            raise PeerUnavailable(f"mamba_ssm's model has MLPs after mixers only, SwiGLU without bias, width a "
                                  f"multiple of 128; this one: mlp_layer_idx {config.mlp_layer_idx}, mlp_cfg {mlp}")
        d = config.to_dict()
        return self._config_cls(**{k: d[k] for k in _PEER_CONFIG_FIELDS})

    def model_class(self):
        return self._model_cls

    def build_lm(self, config: MambaConfig, device, dtype=None) -> torch.nn.Module:
        if config.layer == "Mamba3":  # mamba_ssm's LM has no Mamba-3 blocks: its mixers go in (peer_mamba3.py)
            from mamba_parallel.bench.peer_mamba3 import build_peer_lm

            return build_peer_lm(self, config, device, dtype)
        return super().build_lm(config, device, dtype)


class _ReferenceLM(torch.nn.Module):
    """This package's model behind mamba_ssm's model API (``.logits``, ``generate(max_length, top_k, cg)``)."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        from mamba_parallel.models.lm import MambaLMHeadModel

        self.model = MambaLMHeadModel(config, device=device, dtype=dtype)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        out = self.model(input_ids, inference_params=inference_params, num_last_tokens=num_last_tokens)
        return SimpleNamespace(logits=logits_of(out))

    def generate(self, input_ids, max_length, top_k=1, cg=False, **kwargs):
        new = max_length - input_ids.shape[1]
        return self.model.generate(input_ids, max_new_tokens=new, top_k=top_k, cuda_graph=cg and input_ids.is_cuda)

    def save_pretrained(self, folder):
        self.model.save_pretrained(folder, format="mamba_ssm")


class ReferencePeer(Peer):
    """The pure-PyTorch reference ops and this package's model in the peer's place (CPU runs, tests)."""

    name = "reference"

    def versions(self) -> dict:
        return {"reference": "mamba_parallel reference ops (stand-in peer)"}

    def ssd(self, x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False):
        from mamba_parallel.ops.ssd import naive

        return naive.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)

    def selective_scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        from mamba_parallel.ops.selective_scan import naive

        return naive.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                    delta_softplus=delta_softplus)

    def config(self, config: MambaConfig):
        return config

    def model_class(self):
        return _ReferenceLM


def load_peer(impl: str = "mamba_ssm") -> Peer:
    """The peer adapter ``impl`` ("mamba_ssm" or "reference"); ``PeerUnavailable`` when it cannot run here."""
    if impl == "mamba_ssm":
        return MambaSsmPeer()
    if impl == "reference":
        return ReferencePeer()
    raise ValueError(f"--peer-impl must be one of {IMPLS}, got {impl!r}")


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def resolve_peer(wanted: bool | None, impl: str = "mamba_ssm", log=_note) -> Peer | None:
    """``--peer`` (True: required), ``--no-peer`` (False) or neither (None: the peer when it imports)."""
    if wanted is False:
        return None
    try:
        return load_peer(impl)
    except PeerUnavailable as e:
        if wanted:
            raise SystemExit(f"--peer: {e}") from None
        log(f"peer: {e}; timing ours alone (no ratios)")
        return None


def add_peer_flags(parser) -> None:
    """``--peer / --no-peer`` and ``--peer-impl`` on a benchmark's argument parser."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--peer", dest="peer", action="store_true", default=None,
                   help="time mamba_ssm beside ours in this process (default: when mamba_ssm imports)")
    g.add_argument("--no-peer", dest="peer", action="store_false", help="time ours alone")
    parser.add_argument("--peer-impl", choices=IMPLS, default="mamba_ssm",
                        help="the peer: mamba_ssm, or 'reference' (this package's reference ops and model in the "
                             "peer's place: runs anywhere, for checking the benchmark itself; default: mamba_ssm)")


# ---- same weights on both sides ------------------------------------------------------------------------------------
def _scratch_dir(nbytes: int) -> str:
    """A fresh folder for one hand-over: in /dev/shm (memory) when it has room, else the temp folder."""
    import shutil
    import tempfile

    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.5 * nbytes:
            return tempfile.mkdtemp(prefix="mamba-parallel-weights-", dir=shm)
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="mamba-parallel-weights-")


def save_peer_weights(peer: Peer, peer_model: torch.nn.Module) -> str:
    """The peer model written by the peer's ``save_pretrained`` into a fresh scratch folder (delete it after)."""
    import shutil

    nbytes = sum(p.numel() * p.element_size() for p in peer_model.parameters())
    folder = _scratch_dir(nbytes)
    try:
        peer.save_pretrained(peer_model, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def load_ours(folder: str, device, dtype=None, remove: bool = True) -> torch.nn.Module:
    """Our ``MambaLMHeadModel.from_pretrained`` of a mamba_ssm folder (the folder removed after, by default)."""
    import shutil

    from mamba_parallel.models.lm import MambaLMHeadModel

    try:
        return MambaLMHeadModel.from_pretrained(folder, device=device, dtype=dtype)
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)


def ours_from_peer(peer: Peer, peer_model: torch.nn.Module, device, dtype=None) -> torch.nn.Module:
    """Our model with the peer model's weights, the way a user moves them: the peer's ``save_pretrained`` writes a
    mamba_ssm folder, our ``MambaLMHeadModel.from_pretrained`` reads it (then the folder is deleted)."""
    return load_ours(save_peer_weights(peer, peer_model), device, dtype)


# ---- fla -----------------------------------------------------------------------------------------------------------
def load_fla():
    """fla's ``chunk_simple_gla``, or None when fla does not import."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception:
        return None
    return chunk_simple_gla


def fla_ssd(chunk_simple_gla):
    """The SSD (same arguments as ``Peer.ssd``) through a simple-GLA kernel, as a Mamba-2 layer would call it.

    The preparation is counted: dt <- softplus(dt + dt_bias); g = dt * A (log decay per head); k = dt * B and
    q = C, both expanded from the groups to every head; v = x; scale 1; then y = o + D * x.
    """
    def ssd(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False):
        h, g = x.shape[2], B.shape[2]
        dt = dt.float() if dt_bias is None else dt.float() + dt_bias
        if dt_softplus:
            dt = F.softplus(dt)
        k = (B.repeat_interleave(h // g, dim=2) * dt[..., None]).to(x.dtype)
        q = C.repeat_interleave(h // g, dim=2)
        o, _ = chunk_simple_gla(q, k, x, g=dt * A, scale=1.0)
        if D is not None:
            o = o + x * (D[:, None] if D.dim() == 1 else D)
        return o.to(x.dtype)
    return ssd


def reference_simple_gla(q, k, v, g=None, scale=None, **_):
    """A simple-GLA recurrence in plain PyTorch (fla's ``chunk_simple_gla`` contract, fp32), for tests:
    S_t = exp(g_t) S_{t-1} + k_t^T v_t (per head, K x V); o_t = scale * q_t S_t."""
    b, L, h, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(b, h, K, v.shape[-1], dtype=torch.float32, device=q.device)
    out = []
    for t in range(L):
        S = S * torch.exp(g[:, t].float())[..., None, None] + k[:, t].float()[..., None] * v[:, t].float()[..., None, :]
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t].float(), S))
    return torch.stack(out, dim=1), S
