"""Manifests (mamba_parallel/manifest.py): every fault of a written folder is caught, named, and nothing else."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel import manifest as mf
from mamba_parallel.config import get_preset
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.models.formats import CheckpointError


def _folder(tmp_path):
    d = tmp_path / "f"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(os.urandom(1000))
    (d / "sub" / "b.bin").write_bytes(os.urandom(10))
    (d / "empty").write_bytes(b"")
    return d


def test_roundtrip_chunks_and_parts(tmp_path):
    d = _folder(tmp_path)
    m = mf.write_manifest(str(d), chunk_bytes=128)
    assert sorted(m["files"]) == ["a.bin", "empty", os.path.join("sub", "b.bin")]
    assert len(m["files"]["a.bin"]["sha256"]) == 8 and len(m["files"]["empty"]["sha256"]) == 1
    assert mf.verify_folder(str(d))["files"] == m["files"]
    sizes = {n: r["size"] for n, r in m["files"].items()}
    whole = mf.hash_pieces(str(d), sizes, 128)
    halves = {**mf.hash_pieces(str(d), sizes, 128, part=(0, 2)), **mf.hash_pieces(str(d), sizes, 128, part=(1, 2))}
    assert halves == whole  # ranks sharing the work give the same digests


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete", "grow"])
def test_each_fault_of_each_file_is_named(tmp_path, fault):
    d = _folder(tmp_path)
    mf.write_manifest(str(d), chunk_bytes=128)
    for name in mf.list_files(str(d)) + [mf.MANIFEST]:
        path = d / name
        original = path.read_bytes()
        if fault == "flip":
            if not original:
                continue  # an empty file has no byte to flip; truncate / grow / delete cover it
            data = bytearray(original)
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
        elif fault == "truncate":
            if not original:
                continue
            path.write_bytes(original[:-1])
        elif fault == "grow":
            path.write_bytes(original + b"\0")
        else:
            path.unlink()
        with pytest.raises(mf.ManifestError) as e:
            mf.verify_folder(str(d))
        assert (name if name != mf.MANIFEST else "manifest") in str(e.value), (fault, name, str(e.value))
        path.write_bytes(original)
        mf.verify_folder(str(d))  # restored: verifies again


def test_ownership_is_what_the_manifest_lists(tmp_path):
    d = _folder(tmp_path)
    (d / "notes.txt").write_text("mine")
    assert mf.foreign_names(str(d), ["a.bin", "notes.txt", "absent"]) == ["a.bin", "notes.txt"]
    mf.write_manifest(str(d), ["a.bin"], owned=["logs"])
    assert mf.foreign_names(str(d), ["a.bin", "notes.txt", "logs", "absent"]) == ["notes.txt"]


def _model(tmp_path, name="model"):
    torch.manual_seed(0)
    path = tmp_path / name
    MambaLMHeadModel(get_preset("tiny-mamba2")).save_pretrained(str(path))
    return path


def test_a_flipped_bit_in_saved_weights_is_an_error_naming_the_file(tmp_path, capsys):
    path = _model(tmp_path)
    assert (path / mf.MANIFEST).is_file()
    weights = path / "pytorch_model.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) - 4096] ^= 0x01  # inside a tensor's bytes: torch.load alone reads it without complaint
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="pytorch_model.bin: content differs from the manifest"):
        MambaLMHeadModel.from_pretrained(str(path))
    rc = cli.main(["generate", "--checkpoint", str(path), "--prompt", "x", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "pytorch_model.bin" in err and len(err.strip().splitlines()) == 1, err


def test_weights_from_elsewhere_load_unchecked_said_once(tmp_path):
    path = _model(tmp_path, "elsewhere")
    (path / mf.MANIFEST).unlink()  # as mamba_ssm / HF write it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        MambaLMHeadModel.from_pretrained(str(path))
        MambaLMHeadModel.from_pretrained(str(path))
    notes = [str(w.message) for w in seen if mf.MANIFEST in str(w.message)]
    assert len(notes) == 1 and "without an integrity check" in notes[0]


def test_verify_command(tmp_path, capsys):
    path = _model(tmp_path)
    assert cli.main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok ")
    cfg = json.loads((path / "config.json").read_text())
    cfg["n_layer"] += 1
    (path / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["verify", str(path)]) == 1
    assert "FAILED" in capsys.readouterr().out
    (path / mf.MANIFEST).unlink()
    assert cli.main(["verify", str(path)]) == 1
    assert "no " + mf.MANIFEST in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path / "nope")]) == 2
