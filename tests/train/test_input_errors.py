"""Every input error is one clear line naming its cause, exit 2, said once (rank 0 only under torchrun)."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.config import get_preset
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train import disk

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def _one_line(capsys, rc, *needles, code=2) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


def _train(tmp_path, *extra, data=None):
    if data is None:
        data = tmp_path / "a.txt"
        data.write_text(TEXT)
    return cli.main(["train", "--preset", "tiny-mamba2", "--data", str(data), "--out", str(tmp_path / "o"),
                     "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--device", "cpu", "--sample-tokens",
                     "0", "--no-progress", "--eval-every", "0", "--eval-batches", "1", *extra])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m"
    torch.manual_seed(0)
    MambaLMHeadModel(get_preset("tiny-mamba2")).save_pretrained(str(path))
    return path


def _generate(model_dir, *extra):
    return cli.main(["generate", "--checkpoint", str(model_dir), "--prompt", "def ", "--max-new-tokens", "2",
                     "--device", "cpu", *extra])


# ---- config values ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("toml,needle", [
    ('[model]\nssm_cfg.headdim = "x"\n', "[model] ssm_cfg.headdim: must be an integer, got 'x' (str)"),
    ("[model]\nn_layer = true\n", "[model] n_layer: must be an integer, got True (bool)"),
    ("[model]\nrms_norm = 1\n", "[model] rms_norm: must be true or false, got 1 (int)"),
    ('[model]\nssm_cfg.dt_limit = [0, "x"]\n', "[model] ssm_cfg.dt_limit: must be a list of 2 numbers"),
])
def test_wrongly_typed_nested_config_values(tmp_path, capsys, toml, needle):
    (tmp_path / "c.toml").write_text('preset = "tiny-mamba2"\n' + toml)
    _one_line(capsys, _train(tmp_path, "--config", str(tmp_path / "c.toml")), needle)
    assert not (tmp_path / "o").exists()


def test_a_nested_override_keeps_the_presets_other_mixer_settings(tmp_path):
    from mamba_parallel.train.config import resolve_config

    cfg = resolve_config(preset="tiny-mamba2", model={"ssm_cfg": {"d_state": 32}})
    assert cfg.model_config().ssm_cfg == {"layer": "Mamba2", "d_state": 32, "headdim": 16, "chunk_size": 16}


@pytest.mark.parametrize("flags,needle", [
    (["--beta1", "1.0"], "--beta1: must lie in [0, 1), got 1.0"),
    (["--beta1", "-0.1"], "--beta1: must lie in [0, 1), got -0.1"),
    (["--beta2", "1.5"], "--beta2: must lie in [0, 1)"),
    (["--weight-decay", "-1"], "--weight-decay: must be >= 0"),
    (["--dist-timeout", "0"], "--dist-timeout: must be >= 1 second"),
])
def test_optimizer_ranges(tmp_path, capsys, flags, needle):
    _one_line(capsys, _train(tmp_path, *flags), needle)


# ---- generate -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--top-p", "1.5"], "--top-p must lie in (0, 1]"),
    (["--top-p", "-0.2"], "--top-p must lie in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0"),
])
def test_sampling_settings(model_dir, capsys, flags, needle):
    _one_line(capsys, _generate(model_dir, *flags), needle)


def test_invalid_utf8_prompt(model_dir, capsys):
    bad = b"def \xff".decode("utf-8", errors="surrogateescape")  # what the command line hands Python
    rc = cli.main(["generate", "--checkpoint", str(model_dir), "--prompt", bad, "--device", "cpu"])
    _one_line(capsys, rc, "--prompt: not valid UTF-8 (byte 0xff at character 4)")


def _word_tokenizer(path, words):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_prompt_characters_the_tokenizer_cannot_encode_are_named(model_dir, tmp_path, capsys):
    tok = _word_tokenizer(tmp_path / "tokenizer.json", ["<|endoftext|>", "[UNK]", "def", "x"])
    with pytest.warns(UserWarning, match=r"cannot encode 2 character\(s\) of --prompt: '✓' 'é'"):
        rc = cli.main(["generate", "--checkpoint", str(model_dir), "--prompt", "def x ✓ é", "--max-new-tokens", "1",
                       "--device", "cpu", "--tokenizer", str(tok)])
    assert rc == 0


def test_a_tokenizer_larger_than_the_model_vocabulary(model_dir, tmp_path, capsys):
    tok = _word_tokenizer(tmp_path / "big.json", ["[UNK]"] + [f"w{i}" for i in range(300)])
    _one_line(capsys, _generate(model_dir, "--tokenizer", str(tok)),
              "the tokenizer has 301 tokens but the model's vocabulary is 256")


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": {', bytes(range(256))])
def test_a_corrupt_tokenizer_json(model_dir, tmp_path, capsys, content):
    (tmp_path / "tokenizer.json").write_bytes(content)
    _one_line(capsys, _generate(model_dir, "--tokenizer", str(tmp_path / "tokenizer.json")),
              "tokenizer.json: not a readable tokenizer.json")
    _one_line(capsys, _train(tmp_path, "--tokenizer", str(tmp_path / "tokenizer.json")),
              "tokenizer.json: not a readable tokenizer.json")


# ---- data ---------------------------------------------------------------------------------------------------------
def test_binary_garbage_as_text_is_refused_or_forced(tmp_path, capsys):
    src = tmp_path / "blob.txt"
    src.write_bytes(os.urandom(3000) + b"\0")
    rc = cli.main(["prepare-data", str(src), "--out", str(tmp_path / "tok")])
    _one_line(capsys, rc, f"{src}: ", "pass --allow-binary to tokenize it anyway")
    assert not (tmp_path / "tok").exists()
    (tmp_path / "latin1.txt").write_bytes("café ".encode("latin-1") * 100)
    rc = cli.main(["prepare-data", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "tok")])
    _one_line(capsys, rc, "latin1.txt: not UTF-8 text (byte 0xe9 at offset 3)")
    assert cli.main(["prepare-data", str(src), "--out", str(tmp_path / "tok"), "--allow-binary"]) == 0
    _one_line(capsys, _train(tmp_path, data=src), "blob.txt: binary data, not text", "--allow-binary")


def test_an_empty_or_short_data_file_is_named(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _one_line(capsys, _train(tmp_path, data=empty), f"--data: {str(empty)!r} holds no text")
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    _one_line(capsys, _train(tmp_path, data=short), f"the train split ({tmp_path / 'o' / 'data' / 'train.bin'})",
              "--seq-len 16 needs at least 17")


def test_truncated_token_files_are_named(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    assert cli.main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "tok")]) == 0
    capsys.readouterr()
    train_bin = tmp_path / "tok" / "train.bin"
    train_bin.write_bytes(train_bin.read_bytes()[:-7])
    _one_line(capsys, _train(tmp_path, data=tmp_path / "tok"), f"{train_bin}: ", "truncated or overwritten")
    (tmp_path / "tok" / "mamba-parallel-manifest.json").unlink()  # an older folder: the header's counts still tell
    _one_line(capsys, _train(tmp_path, data=tmp_path / "tok"), f"{train_bin}: ", "truncated or overwritten")


# ---- output folders -----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a read-only /sys")
def test_an_unwritable_output_folder_is_named(tmp_path, capsys):
    out = "/sys/kernel/mamba-parallel-test"
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--out", out, "--device", "cpu"])
    _one_line(capsys, rc, f"{out}: not writable")
    rc = cli.main(["prepare-data", "stdlib", "--out", out])
    _one_line(capsys, rc, f"{out}: not writable")
    (tmp_path / "afile").write_text("x")
    rc = cli.main(["prepare-data", "stdlib", "--out", str(tmp_path / "afile" / "sub")])
    _one_line(capsys, rc, "not writable (Not a directory")


def test_a_full_output_folder_says_how_many_bytes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    _one_line(capsys, _train(tmp_path), f"no space left on the device of {tmp_path / 'o'}", "1.0 KB free")
    (tmp_path / "a.txt").write_text(TEXT)
    rc = cli.main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "tok")])
    _one_line(capsys, rc, "no space left on the device of", "about 1.1 MB needed for the token files, 1.0 KB free")


def test_a_run_that_saves_nothing_needs_no_room_for_a_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text(TEXT)
    assert cli.main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "tok")]) == 0
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    assert _train(tmp_path, "--save-every", "0", "--no-save-final", data=tmp_path / "tok") == 0
    assert _train(tmp_path, "--save-every", "0", data=tmp_path / "tok") == 2  # the final model still needs room


def test_a_disk_that_fills_during_a_checkpoint_save(tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o" / "checkpoints"))

    monkeypatch.setattr(dcp, "save", full)
    _one_line(capsys, _train(tmp_path), "no space left on the device of", "needed in all for checkpoint step-1")
    assert not (tmp_path / "o" / "checkpoints" / "step-1").exists()


# ---- said once ----------------------------------------------------------------------------------------------------
def test_only_rank_0_prints_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert _train(tmp_path, "--beta1", "2") == 2
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        cli.main(["train", "--no-such-flag"])
    assert capsys.readouterr().err == ""
