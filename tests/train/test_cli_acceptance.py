"""A new user's usual mistakes with the command line: one clear error line (exit 2), no traceback, nothing lost."""

from __future__ import annotations

import os

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.config import get_preset
from mamba_parallel.models import MambaLMHeadModel


def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("argv", [
    ["generate", "--checkpoint", "{tmp}/no-such-run/final", "--prompt", "def ", "--device", "cpu"],
    ["convert", "{tmp}/no-such-run/final", "{tmp}/hf", "--format", "hf"],
])
def test_missing_model_folder_is_one_line(tmp_path, capsys, argv):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    _one_error_line(capsys, "no-such-run/final", "not a folder")
    assert not os.path.exists(tmp_path / "hf")


def test_prepare_data_errors_leave_nothing_and_never_replace_user_files(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["prepare-data", str(tmp_path / "empty"), "--out", str(tmp_path / "tok")]) == 2
    _one_error_line(capsys, "SOURCE folder", "holds no text")
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # no half-written folder left behind

    src = tmp_path / "a.txt"
    src.write_text("hello world\n" * 20)
    mine = tmp_path / "mine"  # a folder of the user's: the token files go beside their files, which stay
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    assert cli.main(["prepare-data", str(src), "--out", str(mine)]) == 0
    assert cli.main(["prepare-data", str(src), "--out", str(mine), "--val-fraction", "0.1"]) == 0  # ours: rebuilt
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "header.json").is_file()

    theirs = tmp_path / "theirs"  # a user's header.json (or train.bin ...) is never replaced
    theirs.mkdir()
    (theirs / "header.json").write_text('{"title": "my dataset"}')
    (theirs / "README.md").write_text("mine")
    assert cli.main(["prepare-data", str(src), "--out", str(theirs)]) == 2
    _one_error_line(capsys, f"--out {str(theirs)!r} holds header.json", "nothing was changed")
    assert sorted(os.listdir(theirs)) == ["README.md", "header.json"]
    assert (theirs / "header.json").read_text() == '{"title": "my dataset"}'

    tok = tmp_path / "tok"  # a token folder may be rebuilt in place
    assert cli.main(["prepare-data", str(src), "--out", str(tok)]) == 0
    assert cli.main(["prepare-data", str(src), "--out", str(tok), "--val-fraction", "0.1"]) == 0
    assert (tok / "header.json").is_file()


def test_tp_that_does_not_fit_names_the_flag(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("some text to train on " * 20)
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--data", str(src), "--out", str(tmp_path / "o"),
                   "--seq-len", "16", "--device", "cpu", "--tp", "3"])
    assert rc == 2
    _one_error_line(capsys, "--tp 3", "1 rank(s)")
    assert not os.path.exists(tmp_path / "o" / "checkpoints")


def test_convert_keeps_the_tokenizer_for_generate(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<|endoftext|>", "[UNK]", "def", "return", "x", "y", "+", ":"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    src = tmp_path / "ssm"
    torch.manual_seed(0)
    MambaLMHeadModel(get_preset("tiny-mamba2", vocab_size=len(words))).save_pretrained(str(src))
    tok.save(str(src / "tokenizer.json"))

    assert cli.main(["convert", str(src), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert "with tokenizer.json" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "hf"), "--prompt", "def x", "--max-new-tokens", "4",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def x") and out.err == ""


def test_resume_continues_with_the_runs_own_settings(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = str(tmp_path / "run")
    first = ["train", "--preset", "tiny-mamba2", "--data", str(src), "--out", out, "--steps", "2", "--seq-len", "16",
             "--batch-size", "2", "--device", "cpu", "--sample-tokens", "0", "--no-progress", "--log-every", "1"]
    assert cli.main(first) == 0
    capsys.readouterr()
    # The README's `train --out DIR --resume`: no preset / data / shape flags repeated; the layout of the saving
    # run (here as if saved by a tp=2 run) is not the layout of now.
    saved = tmp_path / "run" / "config.toml"
    assert "tp = 1\n" in saved.read_text()
    saved.write_text(saved.read_text().replace("tp = 1\n", "tp = 2\n"))
    assert cli.main(["train", "--out", out, "--resume", "--steps", "3", "--no-progress"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoints" / "step-3").is_dir()
    # A model that does not fit the checkpoint: one line naming --resume and the fields, nothing overwritten.
    assert cli.main(["train", "--out", out, "--resume", "--steps", "4", "--preset", "tiny-mamba"]) == 2
    _one_error_line(capsys, "--resume:", "step-3", "holds a different model", "ssm_cfg.layer: 'Mamba2' in the "
                    "checkpoint, 'Mamba1' now")
    assert not (tmp_path / "run" / "checkpoints" / "step-4").exists()


def test_bench_names_include_profile_train(capsys):
    assert cli.main(["bench", "nosuch"]) == 2
    _one_error_line(capsys, "'nosuch'", "profile_train", "train")
    assert cli.main(["bench", "_timing"]) == 2
    capsys.readouterr()


def test_generate_on_a_run_folder_points_at_final(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "config.toml").write_text('preset = "tiny-mamba2"\n')
    (run / "checkpoints" / "step-2" / ".metadata").write_bytes(b"")
    assert cli.main(["generate", "--checkpoint", str(run), "--prompt", "x"]) == 2
    _one_error_line(capsys, "training run folder", repr(str(run / "final")))
    assert cli.main(["convert", str(run / "checkpoints" / "step-2"), str(tmp_path / "hf"), "--format", "hf"]) == 2
    _one_error_line(capsys, "SRC", "training checkpoint (DCP")


def test_out_is_a_file_and_cuda_without_cuda(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("mine")
    assert cli.main(["train", "--preset", "tiny-mamba2", "--device", "cpu", "--out", str(f)]) == 2
    _one_error_line(capsys, "--out", "is a file")
    assert f.read_text() == "mine"
    if torch.cuda.is_available():
        return
    assert cli.main(["train", "--preset", "tiny-mamba2", "--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    _one_error_line(capsys, "--device cuda", "--device cpu")
    assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--device", "cuda"]) == 2
    _one_error_line(capsys, "--device cuda")


def test_train_never_replaces_a_raw_data_folder_named_out_data(tmp_path, capsys):
    corpus = tmp_path / "data"  # `train --data data/ --out .`: the tokens would go to ./data, the corpus itself
    corpus.mkdir()
    (corpus / "a.txt").write_text("text " * 200)
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--device", "cpu", "--data", str(corpus), "--out",
                   str(tmp_path), "--seq-len", "16"])
    assert rc == 2
    _one_error_line(capsys, "holds data, which this run would write but did not write")
    assert os.listdir(corpus) == ["a.txt"]


def test_misspelt_flag_names_the_nearest_one(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--seqlen", "64", "--stepz", "5"])
    assert e.value.code == 2
    _one_error_line(capsys, "unrecognized arguments: --seqlen 64 --stepz 5", "--seqlen -> --seq-len",
                    "--stepz -> --steps", "mamba-parallel train --help")
