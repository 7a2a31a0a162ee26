"""Activation memory the Mamba / Mamba2 layers keep for the backward on the Triton path (docs/memory.md).

Every tensor autograd saves is seen through ``saved_tensors_hooks`` (a ``RecomputeInBackward`` context inside
hands on what it does not rebuild); the bytes are those of the distinct storages kept, parameters excluded.
fp32 on CPU (the interpreter is exact there): bf16 sizes are half of the activations' except the fp32 ones, see
the doc's table.
"""

import pytest
import torch
from helpers import one_scan_segment, saved_bytes

from mamba_parallel import ops
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.recompute import SCAN_CHECKPOINT_EVERY, apply_recompute
from mamba_parallel.ops.selective_scan.launch import chunk_tokens

pytest.importorskip("triton")

F32 = 4


def _mamba2(recompute=""):
    torch.manual_seed(0)
    return Mamba2(32, d_state=16, headdim=16, ngroups=1, chunk_size=16, recompute=recompute)


MAMBA1_WIDTH = 8  # d_inner 16: small, and the interpreted kernels still run two channel blocks (of 8)


def _mamba1(fused=False):
    torch.manual_seed(0)
    # fused=False: the reference forward, op by op (where every recompute item applies)
    return Mamba(MAMBA1_WIDTH, d_state=4, use_fused_path=fused)


def _mamba2_expected(m, b, L, recompute: str):
    """The table of docs/memory.md for Mamba2 (fp32, no packing), in bytes."""
    di, gn, h, p, n, cs = m.d_inner, m.ngroups * m.d_state, m.nheads, m.headdim, m.d_state, m.chunk_size
    nc = -(-L // cs)
    tokens = b * L
    per_token = (m.d_model                # in_proj input
                 + 2 * di + 2 * gn + h    # in_proj output zxbcdt (the conv's input, z, dt are views of it)
                 + di                     # scan output y (the gated norm's input)
                 + m.ngroups)             # norm rstd
    if "conv" not in recompute:
        per_token += di + 2 * gn          # conv output (the scan's x, B, C)
    # the gated norm output (out_proj's input): never kept, the norm + out_proj node rebuilds it ("gate": no-op)
    per_chunk = 2 * h * cs + h * p * n    # dt after softplus, cumulative decay (fp32); states entering each chunk
    if "states" in recompute:
        per_chunk = 0
    fixed = 2 * h                         # -exp(A_log) and its exp (final states: not returned, not kept)
    return F32 * (tokens * per_token + b * nc * per_chunk + fixed)


@pytest.fixture
def triton_backend():
    with ops.use_backend("triton"):
        yield


@pytest.mark.parametrize("recompute", ["", "conv", "conv,gate", "states"])
def test_mamba2_saved_bytes_match_the_table(triton_backend, recompute):
    m = _mamba2(recompute)
    b, L = 2, 32
    h = torch.randn(b, L, m.d_model, requires_grad=True)
    _, saved = saved_bytes(m, lambda: m(h))  # counted at the end of the forward (the backward runs below)
    assert saved == _mamba2_expected(m, b, L, recompute)


def _scan_checkpoints(L, recompute: str) -> int:
    """The selective scan's kept state checkpoints: one per chunk (8 tokens in the interpreter), with "states"
    one per SCAN_CHECKPOINT_EVERY chunks."""
    nchunks = -(-L // chunk_tokens(L, interp=True))
    return -(-nchunks // SCAN_CHECKPOINT_EVERY) if "states" in recompute else nchunks


def _mamba1_fused_expected(m, b, L, recompute: str):
    """The fused training node's rows of docs/memory.md's Mamba table (fp32: B and C are views of x_dbl), bytes."""
    di, n, r = m.d_inner, m.d_state, m.dt_rank
    nchunks = _scan_checkpoints(L, recompute)
    per_token = (m.d_model                # in_proj input
                 + 2 * di                 # in_proj output xz (the conv input and z are views)
                 + (r + 2 * n))           # x_proj output x_dbl (dt_low, B, C: views)
    if "conv" not in recompute:
        per_token += di                   # conv output, token-major
    # no delta (rebuilt by its matmul), no scan output y and no gate output (the scan's backward rebuilds both)
    return F32 * (b * L * per_token
                  + b * nchunks * n * di  # scan state checkpoints, one per chunk ("states": per 8 chunks)
                  + di * n)               # A = -exp(A_log), state-major


@pytest.mark.parametrize("recompute,L", [("", 20), ("conv,dt,gate", 20), ("states", 20), ("states", 72),
                                         ("conv,states", 72)])
def test_mamba1_fused_saved_bytes_match_the_table(triton_backend, recompute, L):
    """L = 20: 3 chunks of 8 tokens, 3 checkpoints, 1 with "states"; L = 72: 9 chunks, 2 checkpoints with
    "states" (one per chunk without it is the L = 20 case's count)."""
    m = _mamba1(fused=True)
    apply_recompute(m, recompute)
    b = 2
    h = torch.randn(b, L, m.d_model, requires_grad=True)
    _, saved = saved_bytes(m, lambda: m(h))
    assert saved == _mamba1_fused_expected(m, b, L, recompute)


@pytest.mark.parametrize("fused", [True, False])
def test_mamba1_bf16_checkpoints_keep_half(triton_backend, fused):
    """``scan_checkpoint_dtype=torch.bfloat16`` (the default under bf16 inputs): the scan's per-chunk states take
    2 bytes instead of 4, in the fused node and op by op; nothing else changes. L = 20: 3 chunks, 3 checkpoints."""
    b, L = 2, 20
    h = torch.randn(b, L, MAMBA1_WIDTH, requires_grad=True)
    kept = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = _mamba1(fused=fused)
        m.scan_checkpoint_dtype = dtype
        kept[dtype] = saved_bytes(m, lambda: m(h))[1]
    halved = b * _scan_checkpoints(L, "") * m.d_state * m.d_inner * (F32 - 2)
    assert kept[torch.float32] - kept[torch.bfloat16] == halved
    if fused:
        assert kept[torch.float32] == _mamba1_fused_expected(m, b, L, "")


def _run_with_grads(m, h, **kw):
    m.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_(True)
    out, saved = saved_bytes(m, lambda: m(h, **kw))
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    grads = {name: p.grad.clone() for name, p in m.named_parameters()}
    return out.detach(), h.grad, grads, saved


@pytest.mark.parametrize("layer,packed,items", [("mamba2", False, "conv,gate,states"),
                                                ("mamba2", True, "conv,gate,states"),
                                                ("mamba1", False, "conv,dt,gate"),
                                                ("mamba1", False, "states"),
                                                ("mamba1_fused", True, "conv,states")])
def test_recompute_is_bit_exact_and_drops_what_it_rebuilds(triton_backend, layer, packed, items, monkeypatch):
    m = _mamba2() if layer == "mamba2" else _mamba1(fused=layer == "mamba1_fused")
    b, L = (1, 32) if packed else (2, 24)
    if "mamba1" in layer and "states" in items:
        b, L = 1, 72  # 9 chunks: two groups of 8
        one_scan_segment(monkeypatch)  # the groups of 8 would move the interpreter's segment boundary
    h = torch.randn(b, L, m.d_model)
    kw = {"cu_seqlens": torch.tensor([0, 11, L], dtype=torch.int32)} if packed else {}
    ref_out, ref_dh, ref_grads, ref_saved = _run_with_grads(m, h, **kw)
    apply_recompute(m, items)
    out, dh, grads, saved = _run_with_grads(m, h, **kw)
    assert torch.equal(out, ref_out) and torch.equal(dh, ref_dh)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    # per token: the conv output, out_proj's input (d_inner; Mamba2: never kept, "gate" is a no-op), and for Mamba
    # the scan's delta (d_inner); per chunk (Mamba2 "states"): dt / decay and the states entering it
    if layer == "mamba2":
        nc = 1 + 2 if packed else -(-L // m.chunk_size)  # packed: sequences of 11 and 21 tokens, 1 + 2 chunks
        per_chunk = 2 * m.nheads * m.chunk_size + m.nheads * m.headdim * m.d_state
        dropped = F32 * (b * L * (m.d_inner + 2 * m.ngroups * m.d_state) + (1 if packed else b) * nc * per_chunk)
    else:  # conv output, delta, gate output (each d_inner per token: the fused node keeps the conv output only);
        # "states": the scan checkpoints but one per 8 chunks (packed: the scan runs over the whole row)
        fused = layer == "mamba1_fused"
        per_token = sum(item in items for item in (("conv",) if fused else ("conv", "dt", "gate")))
        ckpts = _scan_checkpoints(L, "") - _scan_checkpoints(L, items)
        dropped = F32 * (b * L * per_token * m.d_inner + b * ckpts * m.d_state * m.d_inner)
    assert ref_saved - saved == dropped


@pytest.mark.parametrize("packed", [False, True])
def test_ssd_scan_keeps_final_states_only_when_returned(triton_backend, packed):
    """Unreturned final states (b x h x p x n fp32) are not kept; the gradients are the same bit for bit."""
    from mamba_parallel.ops import ssd_chunk_scan

    torch.manual_seed(0)
    b, L, h, p, n = (1, 40, 2, 8, 8) if packed else (2, 40, 2, 8, 8)
    inputs = dict(x=torch.randn(b, L, h, p), dt=torch.randn(b, L, h) - 1, A=-torch.rand(h) - 0.5,
                  B=torch.randn(b, L, 1, n), C=torch.randn(b, L, 1, n), D=torch.randn(h), dt_bias=torch.randn(h))
    kw = {"cu_seqlens": torch.tensor([0, 17, 40], dtype=torch.int32)} if packed else {}
    gy = torch.randn(b, L, h, p)
    results = []
    for ret in (True, False):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        holder = torch.nn.Module()  # parameters: none; every saved tensor counts
        out, saved = saved_bytes(holder, lambda: ssd_chunk_scan(**leaves, chunk_size=16, dt_softplus=True,
                                                                  return_final_states=ret, **kw))
        y = out[0] if ret else out
        y.backward(gy)  # no gradient into the final states
        results.append(({k: v.grad for k, v in leaves.items()}, saved))
    (grads_ret, saved_ret), (grads, saved) = results
    for k in grads:
        assert torch.equal(grads[k], grads_ret[k]), k
    nstates = 2 if packed else b
    assert saved_ret - saved == F32 * nstates * h * p * n


def test_recompute_inside_activation_checkpointing(triton_backend):
    """RecomputeInBackward hands what it does not rebuild to checkpoint's hooks: same gradients, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    m = _mamba2("conv,gate,states")
    h = torch.randn(2, 24, m.d_model)
    ref_out, ref_dh, ref_grads, _ = _run_with_grads(m, h)
    h_leaf = h.detach().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    out = checkpoint(m, h_leaf, use_reentrant=False)
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    assert torch.equal(out, ref_out) and torch.equal(h_leaf.grad, ref_dh)
    for name, p in m.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name
