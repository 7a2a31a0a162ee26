"""`generate --tp 2` (two gloo ranks) reads each rank's slices of the checkpoint, never the whole model: for Mamba-1,
Mamba-2, a hybrid and Mamba-3 saved in mamba_ssm's layout (.bin, safetensors, sharded), transformers' layout and
Mistral's, rank 0 prints what one process prints; every rank's shards hold exactly the single-device values; the
bytes a rank reads off the file are its own shards' (plus the replicated tensors), about half the model; a bad
checkpoint is an error naming the file, the tensor and the shapes."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch

from dist_harness import spawn
from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.cli import main
from mamba_parallel.config import MambaConfig
from mamba_parallel.manifest import MANIFEST

# Mamba-2 at mamba_ssm's defaults: what Mistral's layout can hold (it stores a tied head as a tensor of its own).
_MISTRAL = dict(d_model=64, n_layer=2, vocab_size=256, ssm_cfg={"layer": "Mamba2"}, rms_norm=True,
                residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8, tie_embeddings=True)
_SHARDS = dict(max_shard_size=60_000)  # several weight files and an index
CASES = {  # name -> (preset or config, save_pretrained options)
    "mamba1-bin": ("tiny-mamba", {}),  # mamba_ssm's layout: pytorch_model.bin, the tied head sharing storage
    "mamba1-hf": ("tiny-mamba", {"format": "hf"}),
    "mamba2-safetensors": ("tiny-mamba2", {"safe_serialization": True}),  # the tied head not stored
    "mamba2-hf-sharded": ("tiny-mamba2", {"format": "hf", **_SHARDS}),
    "hybrid-bin": ("tiny-hybrid", {}),
    "hybrid-safetensors-sharded": ("tiny-hybrid", {"safe_serialization": True, **_SHARDS}),
    "hybrid-hf": ("tiny-nemotron-h", {"format": "hf"}),  # q / k / v stored apart, an untied head
    "mamba3-bin": ("tiny-mamba3", {}),
    "mamba3-bin-sharded": ("tiny-mamba3", _SHARDS),
    "mamba3-mimo-safetensors": ("tiny-mamba3-mimo", {"safe_serialization": True}),
    "mamba2-mistral": (_MISTRAL, {"format": "mistral"}),
}
BAD = ("missing", "shape", "legacy")
CAST_CASE = "mamba2-safetensors"


def _argv(folder: str, extra: list[str]) -> list[str]:
    return ["generate", "--checkpoint", folder, "--prompt", "ab", "--no-stream", "--device", "cpu",
            "--max-new-tokens", "8", *extra]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _tp_model(folder: str, dtype="auto"):
    from mamba_parallel.inference import cli_generate

    args = type("Args", (), {"tp": 2, "cuda_graph": False, "checkpoint": folder})()
    return cli_generate._load_tensor_parallel(args, torch.device("cpu"), dtype)[0]


@contextlib.contextmanager
def _recording(reads: list, loads: list):
    """Every tensor (or box of one) read off a weights file, in the file's bytes; every torch.load's mmap flag; the
    whole-model loader refused."""
    from unittest import mock

    import mamba_parallel.models.formats as formats
    from mamba_parallel.models.weights_io import WeightReader

    real_read, real_load = WeightReader.read, torch.load

    def read(self, name, device, dtype, index=None):
        out = real_read(self, name, device, dtype, index)
        reads.append(out.numel() * self.dtypes[name].itemsize)
        return out

    def load(*args, **kwargs):
        loads.append(kwargs.get("mmap", False))
        return real_load(*args, **kwargs)

    def whole(*args, **kwargs):
        raise AssertionError("generate --tp loaded the whole model")

    with mock.patch.object(WeightReader, "read", read), mock.patch.object(torch, "load", load), \
            mock.patch.object(formats, "load_pretrained", whole):
        yield


def _same(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        _local(pa[k]).dtype == _local(pb[k]).dtype and torch.equal(_local(pa[k]), _local(pb[k])) for k in pa)


@torch.no_grad()
def _reference(folder: str, dtype="auto"):
    """The tensor-parallel model filled from the whole single-device model (what generate --tp did before)."""
    from mamba_parallel.distributed.materialize import load_single_device_model

    model = _tp_model(folder, dtype)
    for p in model.parameters():
        _local(p).fill_(float("nan"))  # any value the whole-model load would not set fails the comparison
    load_single_device_model(model, MambaLMHeadModel.from_pretrained(folder, dtype=dtype))
    return model


def _ranks_fn(rank: int, world: int, folders: dict, bad: dict) -> dict:
    import torch.distributed as dist

    got = {}
    for case, folder in folders.items():
        reads, loads = [], []
        with _recording(reads, loads):
            got[case, "run"] = _run(_argv(folder, ["--tp", "2"]))
            reads.clear()
            model = _tp_model(folder)
        got[case, "read"], got[case, "mmap"] = sum(reads), loads
        got[case, "local"] = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
        got[case, "replicated"] = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters()
                                      if all(pl.is_replicate() for pl in getattr(p, "placements", ())))
        got[case, "same"] = _same(model, _reference(folder))
        if case == CAST_CASE:
            half = _tp_model(folder, torch.float16)
            got[case, "fp16"] = ({_local(p).dtype for p in half.parameters()},
                                 _same(half, _reference(folder, torch.float16)))
        dist.barrier()
    for kind, folder in bad.items():
        got[kind] = _run(_argv(folder, ["--tp", "2"]))
        dist.barrier()
    return got


def _config(spec) -> MambaConfig:
    return get_preset(spec) if isinstance(spec, str) else MambaConfig(**spec)


def _strip_manifest(folder: Path) -> None:
    """A folder edited by hand: without its manifest the loader reads it (the manifest would catch the edit)."""
    (folder / MANIFEST).unlink()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for case, (spec, options) in CASES.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(case)
        MambaLMHeadModel(_config(spec)).save_pretrained(path, **options)
        out[case] = str(path)
    return out


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    out = {}
    for kind in BAD:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(kind)
        MambaLMHeadModel(get_preset("tiny-mamba2")).save_pretrained(path, safe_serialization=kind != "legacy")
        _strip_manifest(path)
        if kind == "legacy":
            state = torch.load(path / "pytorch_model.bin", weights_only=True)
            torch.save(state, path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
        else:
            state = load_file(path / "model.safetensors")
            if kind == "missing":
                del state["backbone.layers.1.mixer.in_proj.weight"]
            else:
                state["backbone.layers.0.mixer.conv1d.weight"] = state["backbone.layers.0.mixer.conv1d.weight"][:-8]
            save_file(state, path / "model.safetensors")
        out[kind] = str(path)
    return out


@pytest.fixture(scope="module")
def ranks(folders, bad):
    return spawn(_ranks_fn, 2, folders, bad)


@pytest.mark.parametrize("case", list(CASES))
def test_rank0_prints_what_one_process_prints(ranks, folders, case):
    rc, want, _ = _run(_argv(folders[case], []))
    assert rc == 0 and len(want) > len("ab\n")
    assert ranks[0][case, "run"][:2] == (0, want)
    assert ranks[1][case, "run"][:2] == (0, "")  # only rank 0 prints


@pytest.mark.parametrize("case", list(CASES))
def test_shards_hold_the_single_device_values(ranks, case):
    for r in ranks:
        assert r[case, "same"]


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_reads_only_its_slices(ranks, folders, case):
    whole = MambaLMHeadModel.from_pretrained(folders[case])
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())  # a tied head counted once
    head = whole.backbone.embedding.weight
    for r in ranks:
        assert all(r[case, "mmap"])  # .bin files memory-mapped (safetensors: no torch.load at all)
        assert bool(r[case, "mmap"]) == ("bin" in case)
        want = r[case, "local"]
        if case.endswith("mistral"):  # its tied head is a tensor of its own: the rank's rows are read to compare
            want += head.numel() * head.element_size() // 2
        assert r[case, "read"] == want  # what it holds, nothing more
        # and what it holds is half of every sharded tensor plus the replicated ones (norms, Mamba-2's B / C)
        sharded = whole_bytes - r[case, "replicated"]
        assert r[case, "local"] == sharded // 2 + r[case, "replicated"]
        assert r[case, "replicated"] < 0.4 * whole_bytes and r[case, "read"] < 0.8 * whole_bytes


def test_dtype_is_cast_per_slice(ranks):
    for r in ranks:
        dtypes, same = r[CAST_CASE, "fp16"]
        assert dtypes == {torch.float16} and same


def test_missing_tensor_is_named(ranks, bad):
    rc, out, err = ranks[0]["missing"]
    assert rc == 2 and out == ""
    assert os.path.join(bad["missing"], "model.safetensors") in err
    assert "missing (1): backbone.layers.1.mixer.in_proj.weight" in err
    assert ranks[1]["missing"][0] == 2


def test_wrong_shape_names_both_shapes(ranks, bad):
    rc, _, err = ranks[0]["shape"]
    assert rc == 2 and os.path.join(bad["shape"], "model.safetensors") in err
    want = MambaLMHeadModel(get_preset("tiny-mamba2"), device="meta").backbone.layers[0].mixer.conv1d.weight.shape
    found = (want[0] - 8, *want[1:])
    assert f"backbone.layers.0.mixer.conv1d.weight: expected {tuple(want)}, found {found}" in err
    assert ranks[1]["shape"][0] == 2


def test_legacy_torch_file_is_refused(ranks, bad):
    rc, _, err = ranks[0]["legacy"]
    assert rc == 2 and os.path.join(bad["legacy"], "pytorch_model.bin") in err
    assert "cannot be memory-mapped" in err
    assert ranks[1]["legacy"][0] == 2


def test_boxes_of_a_tensor_stored_in_pieces(folders):
    """One process: a box of our fused attention in_proj, stored as q / k / v, reads as that box of the whole."""
    from mamba_parallel.models.formats import open_checkpoint

    ckpt = open_checkpoint(folders["hybrid-hf"])
    twin = MambaLMHeadModel(ckpt.config, device="meta")
    ckpt.plan({n: tuple(t.shape) for n, t in twin.state_dict(keep_vars=True).items()})
    name = f"backbone.layers.{ckpt.config.attn_layer_idx[0]}.mixer.in_proj.weight"
    assert len(ckpt.sources[name]) == 3
    cpu = torch.device("cpu")
    whole = ckpt.read(name, cpu, None)
    rows, cols = whole.shape
    for box in [(slice(0, rows), slice(0, cols)), (slice(5, rows - 7), slice(3, 40)), (slice(rows // 2, rows),
                slice(0, cols // 2)), (slice(10, 10), slice(0, cols))]:
        assert torch.equal(ckpt.read(name, cpu, None, box), whole[box])
