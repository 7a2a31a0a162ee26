"""MambaLMHeadModel: state-dict names, loss vs logits, meta-device build, packed sequences, dtypes."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

from mamba_parallel import get_preset
from mamba_parallel.models import MambaLMHeadModel


def _model(name, **overrides):
    torch.manual_seed(0)
    return MambaLMHeadModel(get_preset(name, **overrides))


def test_state_dict_names_are_mamba_ssm_names():
    cfg = get_preset("tiny-hybrid")  # layer 1 attention, the others Mamba2, gated MLP everywhere
    sd = MambaLMHeadModel(cfg).state_dict()
    d, di, n, h, V = 64, 128, 16, 8, 256
    expect = {"backbone.embedding.weight": (V, d), "backbone.norm_f.weight": (d,), "lm_head.weight": (V, d)}
    for i in range(4):
        p = f"backbone.layers.{i}."
        expect.update({p + "norm.weight": (d,), p + "norm2.weight": (d,), p + "mlp.fc1.weight": (2 * 128, d),
                       p + "mlp.fc2.weight": (d, 128)})
        if i == 1:
            qkv = 16 * (4 + 2 * 2)
            expect.update({p + "mixer.in_proj.weight": (qkv, d), p + "mixer.in_proj.bias": (qkv,),
                           p + "mixer.out_proj.weight": (d, 64), p + "mixer.out_proj.bias": (d,)})
        else:
            conv_dim = di + 2 * n
            expect.update({p + "mixer.in_proj.weight": (2 * di + 2 * n + h, d),
                           p + "mixer.conv1d.weight": (conv_dim, 1, 4), p + "mixer.conv1d.bias": (conv_dim,),
                           p + "mixer.dt_bias": (h,), p + "mixer.A_log": (h,), p + "mixer.D": (h,),
                           p + "mixer.norm.weight": (di,), p + "mixer.out_proj.weight": (d, di)})
    assert {k: tuple(v.shape) for k, v in sd.items()} == expect

    sd1 = MambaLMHeadModel(get_preset("tiny-mamba")).state_dict()
    r, n1 = 4, 8  # dt_rank = ceil(64 / 16)
    assert tuple(sd1["backbone.layers.0.mixer.x_proj.weight"].shape) == (r + 2 * n1, di)
    assert tuple(sd1["backbone.layers.0.mixer.dt_proj.weight"].shape) == (di, r)
    assert tuple(sd1["backbone.layers.0.mixer.dt_proj.bias"].shape) == (di,)
    assert tuple(sd1["backbone.layers.0.mixer.A_log"].shape) == (di, n1)
    assert tuple(sd1["backbone.layers.0.mixer.in_proj.weight"].shape) == (2 * di, d)


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-hybrid"])
def test_targets_loss_equals_cross_entropy_of_logits(name):
    model = _model(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 13), generator=g)
    targets = torch.randint(0, 256, (2, 13), generator=g)
    targets[0, :4] = -100
    targets[1, -1] = -100
    out = model(ids, targets=targets)
    assert out.logits is None, "only the loss was asked for: the logits must not be formed"
    logits = model(ids).logits
    ref = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    assert out.loss.dim() == 0
    assert_close(out.loss, ref, name="loss")
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="targets"):
        model(ids, targets=targets[:, :5])


def test_labels_are_shifted_inside_as_in_transformers():
    """labels=ids scores position t against ids[t + 1] (transformers' ForCausalLMLoss), -100 ignored."""
    model = _model("tiny-mamba2")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, 5] = -100
    out = model(ids, labels=labels, return_logits=True)
    ref = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
    assert_close(out.loss, ref, name="loss")
    assert_close(model(ids, targets=F.pad(labels[:, 1:], (0, 1), value=-100)).loss, out.loss, name="targets")
    with pytest.raises(ValueError, match="not both"):
        model(ids, labels=labels, targets=labels)
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=labels[:, :5])


def test_labels_of_packed_sequences_never_cross_a_boundary():
    model = _model("tiny-mamba2")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = model(ids, labels=ids, cu_seqlens=cu, return_logits=True)
    keep = torch.ones(11, dtype=torch.bool)
    keep[4] = False  # position 4 ends the first sequence: ids[5] starts the next, it is not its target
    ref = F.cross_entropy(out.logits[0, :-1][keep].float(), ids[0, 1:][keep])
    assert_close(out.loss, ref, name="packed loss")


def test_output_reads_like_mamba_ssm_and_transformers():
    model = _model("tiny-mamba")
    ids = torch.randint(0, 256, (1, 7))
    out = model(ids)
    assert out.loss is None and out[0] is out.logits and out["logits"] is out.logits and len(out) == 1
    both = model(ids, labels=ids, return_logits=True)
    assert both[0] is both.loss and both[1] is both.logits and both.to_tuple() == (both.loss, both.logits)
    assert both.keys() == ["loss", "logits"]
    with pytest.raises(KeyError, match="logits"):
        model(ids, labels=ids)["logits"]
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]))
    assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)).logits, out.logits)
    with pytest.raises(TypeError):
        model(ids, ids)  # keyword-only: mamba_ssm's and transformers' second positional arguments differ


def test_meta_build_to_empty_init_weights_is_a_real_tied_model():
    torch.manual_seed(1)
    direct = MambaLMHeadModel(get_preset("tiny-hybrid"))
    meta = MambaLMHeadModel(get_preset("tiny-hybrid"), device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.backbone.embedding.weight
    meta.to_empty(device="cpu")
    torch.manual_seed(1)
    meta.init_weights()
    assert meta.lm_head.weight is meta.backbone.embedding.weight, "init_weights must re-tie the embeddings"
    ref, got = direct.state_dict(), meta.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs: init_weights is not deterministic"
    marked = {n.rsplit(".", 1)[-1] for n, p in meta.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert marked == {"A_log", "D", "dt_bias"}
    ids = torch.randint(0, 256, (1, 9))
    assert_close(meta(ids).logits, direct(ids).logits, name="logits")
    untied = MambaLMHeadModel(get_preset("tiny-mamba", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.backbone.embedding.weight


def test_init_weights_on_fsdp2_shards_gives_single_device_values():
    """FSDP2's path: meta build -> fully_shard -> materialize (to_empty, then init block by block). Each rank's shard
    must hold the slice of the single-device model's values (same seed). Rank 1 of 2 is simulated in-process with
    a fake process group."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mamba_parallel.distributed.materialize import materialize

    cfg = get_preset("tiny-hybrid")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = MambaLMHeadModel(cfg, device="meta")
        for block in model.backbone.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        materialize(model, cfg, "cpu", seed=5)
        local = {k: v.to_local() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()
    torch.manual_seed(5)
    ref = MambaLMHeadModel(cfg).state_dict()
    assert local.keys() == ref.keys()
    for k, v in ref.items():
        expect = v.chunk(2, dim=0)[1] if v.shape[0] > 1 else v[:0]  # FSDP2 shards dim 0 like torch.chunk
        assert torch.equal(local[k], expect), f"{k}: rank 1's shard differs from the single-device slice"


def test_num_last_tokens_and_backbone():
    model = _model("tiny-mamba2")
    ids = torch.randint(0, 256, (3, 10))
    full = model(ids).logits
    assert full.shape == (3, 10, 256)
    assert_close(model(ids, num_last_tokens=2).logits, full[:, -2:], name="last logits")
    hidden = model.backbone(ids)
    assert hidden.shape == (3, 10, 64)
    assert_close(model.lm_head(hidden), full, name="lm_head(backbone)")


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-hybrid"])
def test_packed_sequences_match_separate_runs(name):
    """Three sequences packed in one row (seq_idx or cu_seqlens) give each sequence's own logits."""
    model = _model(name)
    lens = [5, 9, 4]
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (1, n), generator=g) for n in lens]
    packed = torch.cat(seqs, dim=1)
    separate = torch.cat([model(s).logits for s in seqs], dim=1)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])[None]
    assert_close(model(packed, seq_idx=seq_idx).logits, separate, name="packed via seq_idx")
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    assert_close(model(packed, cu_seqlens=cu).logits, separate, name="packed via cu_seqlens")
    # A mixer called directly with cu_seqlens only (no seq_idx) keeps the sequences apart as well.
    x = torch.randn(1, 18, 64)
    for mixer in (model.backbone.layers[0].mixer, model.backbone.layers[1].mixer):
        with torch.no_grad():
            sep = torch.cat([mixer(x[:, a:e]) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
            assert_close(mixer(x, cu_seqlens=cu), sep, name=f"{type(mixer).__name__} with cu_seqlens only")
    plain = model(packed).logits  # without the boundaries, later sequences see earlier ones: must differ
    assert (plain[:, 5:] - separate[:, 5:]).abs().max() > 1e-3


def test_low_precision_forward_keeps_dtype():
    model = _model("tiny-hybrid").to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 8))
    logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    ref = _model("tiny-hybrid")(ids).logits
    assert_close(logits, ref, dtype=torch.bfloat16, factor=3, name="bf16 logits")


def test_bad_inputs_are_clear_errors():
    model = _model("tiny-mamba2")
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(TypeError, match="MambaConfig"):
        MambaLMHeadModel({"d_model": 64})


@pytest.mark.gpu
@pytest.mark.parametrize("name,L", [("tiny-mamba", 40), ("tiny-mamba", 64), ("tiny-mamba2", 40), ("tiny-hybrid", 40)])
def test_gpu_triton_kernels_match_reference_ops(name, L, monkeypatch):
    """The same model on CUDA: Triton kernels vs the naive ops (fp32 params; kernels may use TF32 dots). L = 64:
    a multiple of 16, so the Mamba-1 scan takes its register-chain fast path (other lengths take its fallback)."""
    model = _model(name).cuda()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, L), generator=g).cuda()
    labels = torch.randint(0, 256, (2, L), generator=g).cuda()
    results = {}
    for backend in ("naive", "triton"):
        monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", backend)
        model.zero_grad()
        loss = model(ids, targets=labels).loss
        loss.backward()
        with torch.no_grad():
            results[backend] = (model(ids).logits, loss.detach(), model.backbone.embedding.weight.grad.clone())
    (lr, sr, gr), (lt, st, gt) = results["naive"], results["triton"]
    assert_close(lt, lr, dtype=torch.float16, name="logits")
    assert_close(st, sr, dtype=torch.float16, name="loss")
    assert_close(gt, gr, dtype=torch.float16, grad=True, factor=2, name="embedding grad")
