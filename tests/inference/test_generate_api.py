"""generate()'s arguments as transformers and mamba_ssm users write them: lengths, greedy default, sampling
filters equal to transformers' warpers, repetition penalty, several eos ids, min length, streamers, scores, a
left-padded batch, clear errors."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import CountingLM

from mamba_parallel import get_preset
from mamba_parallel.inference import generate
from mamba_parallel.inference.sampling import warp
from mamba_parallel.models import MambaLMHeadModel


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MambaLMHeadModel(get_preset("tiny-mamba2")).eval()


def _prompt(b=2, L=5, seed=3):
    return torch.randint(0, 256, (b, L), generator=torch.Generator().manual_seed(seed))


class Recorder:
    """A streamer with transformers' interface: put(tokens) (the prompt first), end()."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_lengths_greedy_default_and_clear_errors(model):
    p = _prompt()
    out = model.generate(p, max_new_tokens=6)
    assert torch.equal(out, model.generate(p, max_length=11))  # max_length counts the prompt
    assert torch.equal(out, model.generate(p, max_new_tokens=6, temperature=0.0))  # greedy by default
    assert torch.equal(out, model.generate(inputs=p, max_new_tokens=6))  # transformers' name for the prompt
    assert torch.equal(model.generate(p, max_length=3), p)  # already longer than max_length
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['max_tokens'\]"):
        model.generate(p, max_tokens=6)
    with pytest.raises(TypeError, match="by keyword, max_new_tokens=N or max_length=N"):
        model.generate(p, 6)
    with pytest.raises(ValueError, match="say how long"):
        model.generate(p)
    with pytest.raises(ValueError, match="num_beams=4 is not supported"):
        model.generate(p, max_new_tokens=2, num_beams=4)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(p, max_new_tokens=2, do_sample=True, top_p=1.5)


def test_sampling_switches(model):
    p = _prompt(b=4, L=3)
    greedy = model.generate(p, max_new_tokens=8)
    # temperature alone does not sample (transformers: do_sample decides); top_k != 1 does (mamba_ssm's rule)
    assert torch.equal(model.generate(p, max_new_tokens=8, temperature=1.3), greedy)
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    a = model.generate(p, max_new_tokens=8, top_k=0, temperature=1.5, generator=g())
    b = model.generate(p, max_new_tokens=8, do_sample=True, top_k=0, temperature=1.5, generator=g())
    assert torch.equal(a, b) and not torch.equal(a, greedy)
    assert torch.equal(model.generate(p, max_new_tokens=8, do_sample=True, top_k=1), greedy)


def test_warp_equals_transformers_warpers():
    transformers = pytest.importorskip("transformers")
    from transformers.generation import logits_process as lp

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    for temperature, top_k, top_p, min_p in [(0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 50, 1.0, 0.1),
                                             (0.9, 20, 0.9, 0.05)]:
        ref = logits.clone()
        for proc in (lp.TemperatureLogitsWarper(temperature), lp.TopKLogitsWarper(top_k) if top_k else None,
                     lp.TopPLogitsWarper(top_p) if top_p < 1 else None, lp.MinPLogitsWarper(min_p) if min_p else None):
            if proc is not None:
                ref = proc(None, ref)
        ours = warp(logits, temperature, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), (temperature, top_k, top_p, min_p)
        keep = torch.isfinite(ref)
        torch.testing.assert_close(ours[keep], ref[keep])


def test_repetition_penalty_and_scores_equal_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()
    from mamba_parallel.models.formats import load_pretrained

    cfg = transformers.Mamba2Config(hidden_size=32, num_hidden_layers=2, state_size=8, vocab_size=64, num_heads=4,
                                    head_dim=16, n_groups=1, chunk_size=8, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, repetition_penalty=1.8, return_dict_in_generate=True, output_scores=True)
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kw)
    got = ours.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 8
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.stack([s.argmax(-1) for s in got.scores], 1), got.sequences[:, 5:])


def test_several_eos_ids_pad_and_min_new_tokens():
    lm = CountingLM()  # the next token is (token + 1) % 16
    p = torch.tensor([[0, 3], [7, 1]])
    out = generate(lm, p, max_new_tokens=6, eos_token_id=[5, 3], pad_token_id=15)
    # row 0: 4 5 (eos) then pad; row 1: 2 3 (eos) then pad
    assert out.tolist() == [[0, 3, 4, 5], [7, 1, 2, 3]]
    out = generate(lm, torch.tensor([[0, 3], [7, 2]]), max_new_tokens=6, eos_token_id=[5, 3], pad_token_id=15)
    assert out.tolist() == [[0, 3, 4, 5], [7, 2, 3, 15]]  # row 1 ends first: pad after its eos
    # min_new_tokens: eos cannot end a row before 3 new tokens (its logit is masked; the next likeliest wins)
    out = generate(lm, torch.tensor([[4]]), max_new_tokens=5, eos_token_id=5, min_new_tokens=3)
    assert out.tolist() == [[4, 0, 1, 2, 3, 4]]


def test_streamer_sees_the_prompt_then_each_token(model):
    p = _prompt(b=1, L=4)
    rec = Recorder()
    out = model.generate(p, max_new_tokens=5, streamer=rec)
    assert rec.ended and torch.equal(rec.puts[0], p) and len(rec.puts) == 6
    assert torch.equal(torch.cat(rec.puts[1:]), out[0, 4:])
    with pytest.raises(ValueError, match="streamer follows one sequence"):
        model.generate(_prompt(b=2), max_new_tokens=2, streamer=Recorder())


def test_ragged_return_dict_and_left_padded_batch(model):
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([1, 2, 3, 4, 5])]
    res = model.generate(prompts, max_new_tokens=4, return_dict_in_generate=True, output_scores=True)
    for seq, prm in zip(res.sequences, prompts):
        assert torch.equal(seq, model.generate(prm[None], max_new_tokens=4)[0])
    assert len(res.scores) == 4 and res.scores[0].shape == (3, 256)
    firsts = torch.stack([s[prm.numel()] for s, prm in zip(res.sequences, prompts)])
    assert torch.equal(res.scores[0].argmax(-1), firsts)  # scores come back in input order
    # max_length per row with ragged prompts: each row stops at its own total length
    capped = model.generate(prompts, max_length=5)
    assert [c.numel() for c in capped] == [5, 5, 5]
    # a left-padded batch (tokenizer(..., padding_side="left")) decodes each row as if alone, same layout back
    L = 5
    padded = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.long)
    for i, prm in enumerate(prompts):
        padded[i, L - prm.numel():], mask[i, L - prm.numel():] = prm, 1
    out = model.generate(padded, attention_mask=mask, max_new_tokens=4)
    assert out.shape == (3, L + 4) and torch.equal(out[:, :L], padded)
    for i, prm in enumerate(prompts):
        assert torch.equal(out[i, L:], model.generate(prm[None], max_new_tokens=4)[0, prm.numel():])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(padded, attention_mask=mask.flip(1), max_new_tokens=2)


def test_cg_is_the_cuda_graph_flag(model):
    if torch.cuda.is_available():
        pytest.skip("checked by the GPU test")
    with pytest.raises(ValueError, match="CUDA-graph decode needs the model on a CUDA device"):
        model.generate(_prompt(), max_new_tokens=2, cg=True)
    with pytest.raises(ValueError, match="cg and cuda_graph are the same option"):
        model.generate(_prompt(), max_new_tokens=2, cg=True, cuda_graph=False)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_gpu_streamer_and_scores_under_cuda_graphs(preset):
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(preset)).cuda().eval()
    p = _prompt(b=1, L=6).cuda()
    eager = model.generate(p, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    rec = Recorder()
    graphed = model.generate(p, max_new_tokens=12, cg=True, streamer=rec, return_dict_in_generate=True,
                             output_scores=True)
    assert torch.equal(graphed.sequences, eager.sequences)
    assert torch.equal(torch.cat(rec.puts[1:]).cuda(), graphed.sequences[0, 6:]) and rec.ended
    for a, b in zip(graphed.scores, eager.scores):  # scores are copies, not the graph's static buffer
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    sampled = [model.generate(p, max_new_tokens=12, cg=True, do_sample=True, top_p=0.9,
                              generator=torch.Generator("cuda").manual_seed(1)) for _ in range(2)]
    assert torch.equal(*sampled)
