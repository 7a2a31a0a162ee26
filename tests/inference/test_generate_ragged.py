"""generate() on a list of prompts of different lengths (ragged requests sharing one batched cache)."""

import pytest
import torch
from helpers import CountingLM

from mamba_parallel import get_preset
from mamba_parallel.inference import generate
from mamba_parallel.models import MambaLMHeadModel

_MODELS = {}


def _model(preset):
    if preset not in _MODELS:
        torch.manual_seed(0)
        model = MambaLMHeadModel(get_preset(preset)).eval()
        with torch.no_grad():  # at init the tied embedding dominates (greedy repeats its input token): let the
            for layer in model.backbone.layers:  # mixers' recurrent state decide the next token instead
                layer.mixer.out_proj.weight.mul_(30)
        _MODELS[preset] = model
    return _MODELS[preset]


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_ragged_greedy_equals_each_prompt_alone(preset):
    model = _model(preset)
    prompts = _prompts([5, 2, 19, 2, 1])  # unsorted, a repeated length (one prefill group), > chunk_size
    out = model.generate(prompts, max_new_tokens=6, temperature=0.0)
    assert isinstance(out, list) and len(out) == len(prompts)
    for p, o in zip(prompts, out):
        alone = model.generate(p[None], max_new_tokens=6, temperature=0.0)[0]
        assert torch.equal(o, alone), (p.numel(), o, alone)


def test_equal_length_list_equals_the_rectangular_call():
    model = _model("tiny-mamba2")
    prompts = _prompts([4, 4, 4], seed=2)
    rect = model.generate(torch.stack(prompts), max_new_tokens=5, temperature=1.0, do_sample=True, generator=torch.Generator().manual_seed(3))
    listed = model.generate(prompts, max_new_tokens=5, temperature=1.0, do_sample=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.stack(listed), rect)
    # A hybrid accepts equal lengths: its KV cache position is then the same for every row.
    hybrid = _model("tiny-hybrid")
    assert torch.equal(torch.stack(hybrid.generate(prompts, max_new_tokens=3, temperature=0.0)),
                       hybrid.generate(torch.stack(prompts), max_new_tokens=3, temperature=0.0))


def test_eos_ends_each_row_on_its_own():
    model = _model("tiny-mamba")
    prompts = _prompts([3, 7, 1], seed=4)
    greedy = model.generate(prompts, max_new_tokens=8, temperature=0.0)
    eos = int(greedy[1][7 + 2])  # the token row 1 emits at step 2
    out = model.generate(prompts, max_new_tokens=8, temperature=0.0, eos_token_id=eos)
    for g, o, p in zip(greedy, out, prompts):
        new = g[p.numel():]
        hits = (new == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else len(new)
        assert torch.equal(o, g[: p.numel() + stop]), (eos, o, g)
    assert out[1].numel() <= 7 + 3 and int(out[1][-1]) == eos


def test_ragged_bookkeeping_order_and_eos_with_a_counting_model():
    lm = CountingLM()
    prompts = [torch.tensor([0, 3]), torch.tensor([7, 1, 1]), torch.tensor([2]), torch.tensor([9, 4])]
    out = generate(lm, prompts, max_new_tokens=6, temperature=0.0, eos_token_id=5)
    assert [o.tolist() for o in out] == [[0, 3, 4, 5], [7, 1, 1, 2, 3, 4, 5], [2, 3, 4, 5], [9, 4, 5]]
    # One prefill per distinct length (the two length-2 prompts together), then 4-row steps from the longest.
    assert lm.calls == [(1, 1, 0), (2, 2, 0), (1, 3, 0), (4, 1, 3), (4, 1, 4), (4, 1, 5)]
    no_eos = generate(lm, prompts[:3], max_new_tokens=3, temperature=0.0)
    assert [o.tolist() for o in no_eos] == [[0, 3, 4, 5, 6], [7, 1, 1, 2, 3, 4], [2, 3, 4, 5]]
    assert all(torch.equal(o, p) for o, p in zip(generate(lm, prompts, max_new_tokens=0), prompts))


def test_ragged_errors_name_the_reason():
    with pytest.raises(ValueError, match=r"attention.*KV cache has one position for the whole batch"):
        _model("tiny-hybrid").generate(_prompts([3, 5]), max_new_tokens=2)
    lm = CountingLM()
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty 1-D integer tensor"):
        generate(lm, [torch.tensor([1]), torch.tensor([[1, 2]])], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        generate(lm, [torch.tensor([], dtype=torch.long)], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        generate(lm, [], max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_ragged_cuda_graph_equals_eager(preset):
    model = _model(preset).cuda()
    prompts = [p.cuda() for p in _prompts([5, 2, 9, 2, 1])]
    eager = model.generate(prompts, max_new_tokens=8, temperature=0.0)
    graphed = model.generate(prompts, max_new_tokens=8, temperature=0.0, cuda_graph=True)
    for e, g, p in zip(eager, graphed, prompts):
        assert torch.equal(e, g) and torch.equal(e, model.generate(p[None], max_new_tokens=8, temperature=0.0)[0])
