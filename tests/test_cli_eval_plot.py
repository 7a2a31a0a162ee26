"""`mamba-parallel eval` (loss, perplexity, bits per byte), `plot` (loss.png from metrics.jsonl), `--version`,
`train --help` sections."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.cli import build_parser, main
from mamba_parallel.evaluate import evaluate_tokens

TEXT = "the quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    MambaLMHeadModel(get_preset("tiny-mamba2")).save_pretrained(path)
    return path


def _reference(model_dir, tokens: list[int], seq_len: int) -> tuple[float, int]:
    """Mean CE over every token but the first, each scored once in its window of seq_len + 1 (stride seq_len)."""
    model = MambaLMHeadModel.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, seq_len):
            w = torch.tensor(tokens[s:s + seq_len + 1])
            logits = model(w[None, :-1]).logits[0].float()
            total += F.cross_entropy(logits, w[1:], reduction="sum").item()
            count += len(w) - 1
    return total / count, count


def test_eval_on_raw_text_and_on_a_token_folder(model_dir, tmp_path, capsys):
    (tmp_path / "held_out.txt").write_text(TEXT)
    assert main(["eval", "--checkpoint", str(model_dir), "--data", str(tmp_path / "held_out.txt"), "--seq-len", "32",
                 "--batch-size", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    tokens = list(TEXT.encode()) + [0]  # a document ends with the byte tokenizer's end-of-text
    want, count = _reference(model_dir, tokens, 32)
    assert res["tokens"] == count and abs(res["loss"] - want) <= 1e-5 * want
    assert abs(res["perplexity"] - math.exp(want)) <= 1e-4 * math.exp(want)
    # bits per byte: bits over the scored bytes (all but the first, which has no context; the end-of-text token
    # is scored but holds no byte)
    n_bytes = len(TEXT.encode()) - 1
    assert res["bytes"] == n_bytes
    assert abs(res["bits_per_byte"] - want * count / math.log(2) / n_bytes) <= 1e-5
    # the same text through prepare-data: its validation split scored the same way
    assert main(["prepare-data", str(tmp_path / "held_out.txt"), "--out", str(tmp_path / "tok"),
                 "--val-fraction", "0.5"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(model_dir), "--data", str(tmp_path / "tok"), "--seq-len", "16",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    val = (tmp_path / "tok" / "val.bin").read_bytes()
    want, count = _reference(model_dir, list(val), 16)
    assert res["tokens"] == count and abs(res["loss"] - want) <= 1e-5 * want
    assert main(["eval", "--checkpoint", str(model_dir), "--data", str(tmp_path / "tok"), "--seq-len", "16"]) == 0
    assert "bits/byte" in capsys.readouterr().out  # the table


def test_eval_errors_name_the_flag(model_dir, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(model_dir), "--data", str(tmp_path / "nope.txt")]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(model_dir), "--data", str(tmp_path), "--seq-len", "0"]) == 2
    assert "--seq-len must be >= 1" in capsys.readouterr().err


def test_evaluate_tokens_max_tokens_and_partial_windows(model_dir):
    model = MambaLMHeadModel.from_pretrained(model_dir).eval()
    tokens = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)).numpy()
    res = evaluate_tokens(model, tokens, seq_len=8, batch_size=4, device="cpu", max_tokens=20)
    want, count = _reference(model_dir, tokens[:21].tolist(), 8)
    assert res["tokens"] == count == 20 and abs(res["loss"] - want) <= 1e-5 * want and res["bits_per_byte"] is None


def _metrics(run, records):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_draws_loss_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    _metrics(run, [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "eval_loss": 4.2},
                   {"step": 3, "loss": 3.5}])
    assert main(["plot", str(run)]) == 0
    png = run / "loss.png"
    assert capsys.readouterr().out.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from mamba_parallel.plots import read_losses

    train, evals = read_losses(run / "metrics.jsonl")
    assert train == [(1, 5.0), (2, 4.0), (3, 3.5)] and evals == [(2, 4.2)]
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    import sys

    from mamba_parallel.plots import plot_after_run

    run = tmp_path / "run"
    _metrics(run, [{"step": 1, "loss": 5.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    note = plot_after_run(run)
    assert note == "no loss curve: matplotlib is not installed: no loss plot (pip install matplotlib)"
    assert not (run / "loss.png").exists()


def test_version_and_train_help_sections(capsys):
    with pytest.raises(SystemExit) as ex:
        main(["--version"])
    assert ex.value.code == 0 and capsys.readouterr().out.startswith("mamba-parallel ")
    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    titles = [g.title for g in train._action_groups]
    assert titles[-5:] == ["model", "data", "batch and schedule", "hardware and parallelism",
                           "output, checkpoints, monitoring"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in train._action_groups}
    assert "batch_size" in groups["batch and schedule"] and "tp" in groups["hardware and parallelism"]
