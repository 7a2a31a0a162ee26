"""A Mamba multi-GPU how-to's tensor-parallel snippets, run as written (on gloo / CPU instead of NCCL / .to(rank)), against the
unsharded computation; and the vocab-parallel cross-entropy against F.cross_entropy."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import spawn
from mamba_parallel.distributed import (
    ColumnParallelLinear,
    ParallelEmbeddings,
    RowParallelLinear,
    all_gather_raw,
    get_dim_for_local_rank,
    parallel_linear_func,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)

D_MODEL, VOCAB, N_LAYERS = 32, 64, 2


def _gather(t, dim=0):
    """Every rank's shard of a parameter, concatenated along ``dim`` (plain, no autograd)."""
    return all_gather_raw(t.detach().movedim(dim, 0).contiguous(), dist.group.WORLD)[0].movedim(0, dim)


def _errs(pairs):
    return {k: ((a - b).norm() / b.norm()).item() for k, (a, b) in pairs.items()}


def setup_parallel_training(rank, world_size):  # the how-to's function, process group already made by the harness
    col_parallel_layer = ColumnParallelLinear(in_features=512, out_features=1024, process_group=dist.group.WORLD)
    return col_parallel_layer


def sequence_parallel_forward(x, weight, process_group):  # the how-to's function, verbatim
    return parallel_linear_func(x, weight, process_group)


class MambaParallelModel(torch.nn.Module):
    """The how-to's 4-GPU hybrid example (embeddings, then Column -> GELU -> Row per layer)."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.embedding = ParallelEmbeddings(embed_dim=D_MODEL, vocab_size=VOCAB, process_group=dist.group.WORLD)
        self.col_layers = torch.nn.ModuleList([
            ColumnParallelLinear(in_features=D_MODEL, out_features=D_MODEL * 4, process_group=dist.group.WORLD)
            for _ in range(N_LAYERS)])
        self.row_layers = torch.nn.ModuleList([
            RowParallelLinear(in_features=D_MODEL * 4, out_features=D_MODEL, process_group=dist.group.WORLD)
            for _ in range(N_LAYERS)])

    def forward(self, x):
        x = self.embedding(x)
        for col_layer, row_layer in zip(self.col_layers, self.row_layers):
            x = col_layer(x)
            x = torch.nn.functional.gelu(x)
            x = row_layer(x)
        return x


def _worker(rank, world):
    out = {}
    torch.manual_seed(100 + rank)  # shards differ per rank, as on real GPUs
    # 1. ColumnParallelLinear(512, 1024, process_group=dist.group.WORLD), sequence parallel by default.
    layer = setup_parallel_training(rank, world)
    out["col_shape"] = tuple(layer.weight.shape)
    x = torch.randn(3, 512)
    y = layer(x)
    x_full, w_full, b_full = _gather(x), _gather(layer.weight), _gather(layer.bias)
    out["col"] = (y, F.linear(x_full, w_full, b_full)[:, rank * 512:(rank + 1) * 512])
    # 2. parallel_linear_func(x, weight, process_group) as the how-to calls it.
    y2 = sequence_parallel_forward(x, layer.weight, dist.group.WORLD)
    out["func"] = (y2, F.linear(x_full, w_full)[:, rank * 512:(rank + 1) * 512])
    # 3. Embeddings -> (Column -> GELU -> Row) x 2, forward and gradients.
    model = MambaParallelModel(rank)
    for row in model.row_layers:  # replicated parameters must start equal on every rank (tp_plan scatters them)
        dist.broadcast(row.bias.data, 0)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(7))  # same ids on every rank
    h = model(ids)
    h.square().sum().backward()  # the sum over ranks of these losses is the unsharded loss
    emb = _gather(model.embedding.word_embeddings.weight).requires_grad_()
    cols = [(_gather(c.weight).requires_grad_(), _gather(c.bias).requires_grad_()) for c in model.col_layers]
    rows = [(_gather(r.weight, 1).requires_grad_(), r.bias.detach().clone().requires_grad_())
            for r in model.row_layers]
    ref = F.embedding(ids, emb)
    for (cw, cb), (rw, rb) in zip(cols, rows):
        ref = F.linear(F.gelu(F.linear(ref, cw, cb)), rw, rb)
    ref.square().sum().backward()
    n = ids.shape[0] // world
    pairs = {"stack_out": (h, ref[rank * n:(rank + 1) * n]),
             "emb_grad": (model.embedding.word_embeddings.weight.grad, emb.grad.chunk(world)[rank])}
    for i, (c, r) in enumerate(zip(model.col_layers, model.row_layers)):
        pairs[f"col{i}_w"] = (c.weight.grad, cols[i][0].grad.chunk(world)[rank])
        pairs[f"col{i}_b"] = (c.bias.grad, cols[i][1].grad.chunk(world)[rank])
        pairs[f"row{i}_w"] = (r.weight.grad, rows[i][0].grad.chunk(world, 1)[rank])
        pairs[f"row{i}_b"] = (r.bias.grad, rows[i][1].grad)
    out["stack"] = _errs(pairs)
    # 4. get_dim_for_local_rank as the how-to calls it (a 4-way split of 1024 in multiples of 16).
    out["local_dim"] = get_dim_for_local_rank(dim=1024, world_size=4, local_rank=rank, multiple_of=16)
    # 5. Asynchronous gather of gradients, computing while it runs.
    gradients = torch.full((2, 3), float(rank))
    total_grad, handle = all_gather_raw(gradients, dist.group.WORLD, async_op=True)
    busy = torch.ones(64, 64) @ torch.ones(64, 64)
    handle.wait()
    out["async"] = (total_grad, busy[0, 0].item())
    # 6. Vocab-parallel cross-entropy (plain and chunked linear) vs F.cross_entropy on the gathered logits.
    g = torch.Generator().manual_seed(11)
    logits_full = torch.randn(10, 2 * 24, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 48, (10,), generator=g)
    labels[2] = -100
    local = logits_full[:, rank * 24:(rank + 1) * 24].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels)
    loss.backward()
    full = logits_full.clone().requires_grad_()
    ref_loss = F.cross_entropy(full, labels, ignore_index=-100)
    ref_loss.backward()
    out["ce"] = _errs({"loss": (loss, ref_loss), "grad": (local.grad, full.grad[:, rank * 24:(rank + 1) * 24])})
    hid = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    wfull = torch.randn(48, 8, generator=g, dtype=torch.float64)
    wl = wfull[rank * 24:(rank + 1) * 24].clone().requires_grad_()
    lin = vocab_parallel_linear_cross_entropy(hid, wl, labels, chunk_size=3)
    lin.backward()
    hid_ref, wref = hid.detach().clone().requires_grad_(), wfull.clone().requires_grad_()
    ref_lin = F.cross_entropy(hid_ref @ wref.T, labels)
    ref_lin.backward()
    # each rank's hidden gradient covers its vocab slice only; the sum over ranks is the full gradient
    hid_grad = all_gather_raw(hid.grad[None].contiguous(), dist.group.WORLD)[0].sum(0)
    out["lin_ce"] = _errs({"loss": (lin, ref_lin), "w_grad": (wl.grad, wref.grad[rank * 24:(rank + 1) * 24]),
                           "h_grad": (hid_grad, hid_ref.grad)})
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 2)


def test_column_parallel_linear_512_1024(results):
    for r in range(2):
        assert results[r]["col_shape"] == (512, 512)
        y, ref = results[r]["col"]
        assert y.shape == (6, 512)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_parallel_linear_func_three_argument_call(results):
    for r in range(2):
        y, ref = results[r]["func"]
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_column_gelu_row_stack_with_parallel_embeddings(results):
    for r in range(2):
        bad = {k: v for k, v in results[r]["stack"].items() if v > 1e-5}
        assert not bad, f"rank {r}: relative errors above 1e-5: {bad}"


def test_get_dim_for_local_rank_as_documented(results):
    assert [results[r]["local_dim"] for r in range(2)] == [256, 256]


def test_async_all_gather(results):
    total, busy = results[0]["async"]
    assert busy == 64.0
    torch.testing.assert_close(total, torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))


@pytest.mark.parametrize("key", ["ce", "lin_ce"])
def test_vocab_parallel_cross_entropy(results, key):
    for r in range(2):
        bad = {k: v for k, v in results[r][key].items() if v > 1e-10}
        assert not bad, f"rank {r}: {bad}"
