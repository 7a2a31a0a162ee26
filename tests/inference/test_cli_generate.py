"""`mamba-parallel generate`: the API's defaults (greedy), streaming, stop strings, a prompt from stdin."""

from __future__ import annotations

import io
import json

import pytest
import torch

from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.cli import main
from mamba_parallel.train.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset("tiny-mamba2"))
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    return path


def _api_text(folder, prompt: str, n: int, **kwargs) -> str:
    model = MambaLMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([list(prompt.encode())])
    out = model.generate(ids, max_new_tokens=n, eos_token_id=0, **kwargs)[0, ids.shape[1]:].tolist()
    out = out[:out.index(0)] if 0 in out else out
    return prompt + ByteTokenizer().decode(out)


def _run(capsys, *argv) -> str:
    assert main(["generate", *argv]) == 0
    return capsys.readouterr().out


def test_greedy_by_default_streamed_or_not(folder, capsys):
    want = _api_text(folder, "ab", 12)
    plain = _run(capsys, "--checkpoint", str(folder), "--prompt", "ab", "--max-new-tokens", "12", "--no-stream")
    streamed = _run(capsys, "--checkpoint", str(folder), "--prompt", "ab", "--max-new-tokens", "12", "--stream")
    assert plain == want + "\n" and streamed == want + "\n"


def test_state_dtype_flag(folder, capsys):
    want = _api_text(folder, "ab", 8, state_dtype=torch.bfloat16)
    out = _run(capsys, "--checkpoint", str(folder), "--prompt", "ab", "--max-new-tokens", "8", "--no-stream",
               "--state-dtype", "bf16")
    assert out == want + "\n"


def test_stop_strings_and_stdin(folder, capsys, monkeypatch):
    full = _api_text(folder, "xy", 16)[2:]
    stop = full[3:5]  # a piece of the greedy continuation: generation stops there, it is not printed
    want = "xy" + full[:full.find(stop)]
    for stream in ("--stream", "--no-stream"):
        out = _run(capsys, "--checkpoint", str(folder), "--prompt", "xy", "--max-new-tokens", "16", "--stop", stop,
                   stream)
        assert out == want + "\n", (stream, out, want)
    monkeypatch.setattr("sys.stdin", io.StringIO("xy"))
    out = _run(capsys, "--checkpoint", str(folder), "--prompt", "-", "--max-new-tokens", "16", "--no-stream")
    assert out == "xy" + full + "\n"


def test_greedy_flag_overrides_a_sampling_generation_config(folder, capsys, tmp_path):
    import shutil

    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.5,
                                                                        "top_k": 0}))
    common = ["--checkpoint", str(tmp_path / "m"), "--prompt", "ab", "--max-new-tokens", "12", "--no-stream"]
    greedy = _run(capsys, *common, "--greedy")
    assert greedy == _api_text(folder, "ab", 12) + "\n"
    sampled = [_run(capsys, *common, "--seed", str(s)) for s in (1, 2, 3)]
    assert any(s != greedy for s in sampled)  # the checkpoint's defaults say sample


def test_bad_input_is_one_clear_error(folder, capsys):
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "a", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
