"""Reference causal conv1d against F.conv1d with left padding; the one-token update chained == the full op."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

from mamba_parallel.ops import causal_conv1d, causal_conv1d_update, use_backend

F64 = torch.float64


@pytest.fixture(autouse=True)
def _naive_backend():
    with use_backend("naive"):
        yield


def _torch_conv(x, weight, bias, activation, initial_state=None):
    """F.conv1d over [initial_state | x] (zeros when None), depthwise, no padding on the right."""
    d, w = weight.shape
    pre = initial_state if initial_state is not None else x.new_zeros(x.shape[0], d, w - 1)
    y = F.conv1d(torch.cat([pre, x], -1), weight.unsqueeze(1), bias, groups=d)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_matches_f_conv1d(w, activation, with_state):
    torch.manual_seed(w)
    b, d, L = 2, 3, 7
    x = torch.randn(b, L, d, dtype=F64).transpose(1, 2)  # non-contiguous (b, d, L)
    weight, bias = torch.randn(d, w, dtype=F64), torch.randn(d, dtype=F64)
    init = torch.randn(b, d, w - 1, dtype=F64) if with_state else None
    y, final = causal_conv1d(x, weight, bias, activation, init, return_final_state=True)
    assert_close(y, _torch_conv(x, weight, bias, activation, init), F64, name="y")
    full = torch.cat([init if with_state else x.new_zeros(b, d, w - 1), x], -1)
    assert torch.equal(final, full[..., full.shape[-1] - (w - 1):])


def test_final_state_shorter_than_window_keeps_initial_inputs():
    torch.manual_seed(5)
    x, init = torch.randn(1, 2, 2), torch.randn(1, 2, 4)
    _, final = causal_conv1d(x, torch.randn(2, 5), initial_state=init, return_final_state=True)
    assert torch.equal(final, torch.cat([init[..., 2:], x], -1))


def test_conv_half_dtype_keeps_dtype():
    torch.manual_seed(6)
    x, weight, bias = torch.randn(2, 4, 9), torch.randn(4, 4), torch.randn(4)
    y = causal_conv1d(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), "silu")
    assert y.dtype == torch.bfloat16
    ref = _torch_conv(x.bfloat16().double(), weight.bfloat16().double(), bias.bfloat16().double(), "silu")
    assert_close(y, ref, torch.bfloat16, name="bf16 conv")


def test_conv_seq_idx_equals_separate_sequences():
    torch.manual_seed(7)
    b, d, L, w = 2, 3, 9, 4
    x, weight, bias = torch.randn(b, d, L, dtype=F64), torch.randn(d, w, dtype=F64), torch.randn(d, dtype=F64)
    init = torch.randn(b, d, w - 1, dtype=F64)
    seq = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3, 4]], dtype=torch.int32)
    y, final = causal_conv1d(x, weight, bias, "silu", init, seq, return_final_state=True)
    for r in range(b):
        cuts = [0] + [t for t in range(1, L) if seq[r, t] != seq[r, t - 1]] + [L]
        for k, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            pre = init[r:r + 1] if k == 0 else None
            assert_close(y[r:r + 1, :, s:e], _torch_conv(x[r:r + 1, :, s:e], weight, bias, "silu", pre), F64,
                         name=f"row {r} segment {k}")
        last = x[r, :, cuts[-2]:]
        expect = torch.cat([x.new_zeros(d, w - 1), last], -1)[:, -(w - 1):]
        assert torch.equal(final[r], expect), f"final state of row {r} must hold only its last sequence"


@pytest.mark.parametrize("activation", [None, "silu"])
def test_update_chained_equals_full(activation):
    torch.manual_seed(8)
    b, d, L, w = 2, 3, 6, 4
    x, weight, bias = torch.randn(b, d, L, dtype=F64), torch.randn(d, w, dtype=F64), torch.randn(d, dtype=F64)
    init = torch.randn(b, d, w - 1, dtype=F64)
    y_full, final = causal_conv1d(x, weight, bias, activation, init, return_final_state=True)
    state = init.clone()
    ys = [causal_conv1d_update(x[:, :, t], state, weight, bias, activation) for t in range(L)]
    assert_close(torch.stack(ys, -1), y_full, F64, name="chained outputs")
    assert torch.equal(state, final)


def test_update_state_indices_touch_only_their_rows():
    torch.manual_seed(9)
    d, w = 3, 4
    pool = torch.randn(5, d, w - 1)
    before = pool.clone()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    x, weight = torch.randn(2, d), torch.randn(d, w)
    y = causal_conv1d_update(x, pool, weight, state_indices=idx)
    own = before[[3, 1]].clone()
    y_ref = causal_conv1d_update(x, own, weight)
    assert_close(y, y_ref, torch.float32, name="y")
    assert torch.equal(pool[[3, 1]], own)
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


def test_conv_gradcheck():
    torch.manual_seed(10)
    b, d, L, w = 1, 2, 5, 3
    x = torch.randn(b, d, L, dtype=F64, requires_grad=True)
    weight = torch.randn(d, w, dtype=F64, requires_grad=True)
    bias = torch.randn(d, dtype=F64, requires_grad=True)
    init = torch.randn(b, d, w - 1, dtype=F64, requires_grad=True)
    seq = torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32)

    def full(a, wt, bs, s0):
        return causal_conv1d(a, wt, bs, "silu", s0, seq, return_final_state=True)
    assert torch.autograd.gradcheck(full, (x, weight, bias, init))

    def step(tok, s0, wt, bs):
        s = s0.clone()
        y = causal_conv1d_update(tok, s, wt, bs, "silu")
        return y, s
    assert torch.autograd.gradcheck(step, (x[:, :, 0].detach().requires_grad_(), init, weight, bias))


def test_conv_bad_inputs_name_the_argument():
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, torch.randn(3, 4), activation="relu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, torch.randn(3, 4), initial_state=torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="seq_idx"):
        causal_conv1d(x, torch.randn(3, 4), seq_idx=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:, :, 0], torch.randn(2, 3, 2), torch.randn(3, 4))


@pytest.mark.parametrize("L", [1, 2, 3, 7])
@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("x_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_final_state_into_a_cache_is_the_returned_one(L, resume, packed, x_dtype, cache_dtype):
    """``naive.final_state(..., out=cache)`` (what a Mamba-2 prefill writes into its cache, on either backend)
    leaves in the cache what this op's returned final state copied into it left, bit for bit: prompts shorter and
    longer than w - 1 = 3, first or resumed (the cache is also the initial state), with and without seq_idx."""
    from mamba_parallel.ops.conv1d.naive import final_state

    g = torch.Generator().manual_seed(L)
    b, d, w = 2, 8, 4
    x = torch.randn(b, L, d, generator=g).to(x_dtype).transpose(1, 2)  # channels-last, as in_proj's output
    weight = torch.randn(d, w, generator=g)
    init = torch.randn(b, d, w - 1, generator=g).to(cache_dtype) if resume else None
    sid = torch.tensor([[0] * (L // 2) + [1] * (L - L // 2)] * b, dtype=torch.int32) if packed else None
    _, returned = causal_conv1d(x, weight, None, "silu", init, sid, return_final_state=True)
    expected = (init.clone() if resume else torch.zeros(b, d, w - 1, dtype=cache_dtype)).copy_(returned)
    cache = init.clone() if resume else torch.full((b, d, w - 1), float("nan"), dtype=cache_dtype)
    assert final_state(x, cache if resume else None, sid, w, out=cache) is cache
    assert torch.equal(cache, expected)
