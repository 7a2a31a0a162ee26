"""generate(): greedy determinism and agreement with the full forward, eos handling; sampling filters."""

import pytest
import torch
from helpers import CountingLM

from mamba_parallel import get_preset
from mamba_parallel.inference import generate, sample, top_k_filter, top_p_filter
from mamba_parallel.models import MambaLMHeadModel


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MambaLMHeadModel(get_preset("tiny-hybrid")).eval()


def _greedy_by_full_forward(model, ids, n):
    """Reference greedy decoding: re-run the whole sequence for every new token."""
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[:, -1, :model.config.vocab_size].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids


def test_greedy_is_deterministic_and_matches_full_forward(model):
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, max_new_tokens=8, temperature=0.0)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, top_k=1), out)  # top_k == 1 is greedy too
    assert torch.equal(out, _greedy_by_full_forward(model, prompt, 8))


def test_sampled_tokens_stay_in_vocab_and_follow_the_generator(model):
    model.config.vocab_size = 250  # padded vocab stays 256: padding rows must never be drawn
    try:
        prompt = torch.randint(0, 250, (4, 3), generator=torch.Generator().manual_seed(0))
        a = model.generate(prompt, max_new_tokens=12, temperature=1.5, do_sample=True, generator=torch.Generator().manual_seed(7))
        b = model.generate(prompt, max_new_tokens=12, temperature=1.5, do_sample=True, generator=torch.Generator().manual_seed(7))
    finally:
        model.config.vocab_size = 256
    assert torch.equal(a, b)
    assert int(a.max()) < 250
    assert len({tuple(r.tolist()) for r in a[:, 3:]}) > 1  # rows differ: it really samples


def _expected_with_eos(greedy_new: torch.Tensor, eos: int) -> torch.Tensor:
    """Greedy rows cut at their first eos and padded with eos; the loop stops once every row has emitted it."""
    rows, stops = [], []
    for row in greedy_new:
        hits = (row == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else len(row)
        rows.append(torch.cat([row[:stop], torch.full((len(row) - stop,), eos)]))
        stops.append(stop if len(hits) else None)
    n = len(greedy_new[0]) if None in stops else max(stops)
    return torch.stack(rows)[:, :n]


def test_eos_pads_finished_rows_and_stops_when_all_are_done(model):
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(5))
    greedy = model.generate(prompt, max_new_tokens=10, temperature=0.0)
    for eos in (int(greedy[0, 7]), int(greedy[1, 5])):  # tokens some rows emit at steps 3 and 1
        out = model.generate(prompt, max_new_tokens=10, temperature=0.0, eos_token_id=eos)
        expect = _expected_with_eos(greedy[:, 5:], eos)
        assert torch.equal(out[:, :5], prompt)
        assert torch.equal(out[:, 5:], expect), (eos, out[:, 5:], expect)
    # One row whose first token is eos: the loop ends after a single step.
    first = int(greedy[0, 5])
    assert torch.equal(model.generate(prompt[:1], max_new_tokens=10, temperature=0.0, eos_token_id=first),
                       greedy[:1, :6])


def test_generate_loop_bookkeeping_with_a_counting_model():
    lm = CountingLM()
    prompt = torch.tensor([[0, 3], [7, 1], [2, 2]])
    out = generate(lm, prompt, max_new_tokens=6, temperature=0.0, eos_token_id=5)
    # Row 0 reaches 5 at step 2, row 1 at step 4, row 2 at step 3: all done after 4 steps, finished rows padded.
    assert out.tolist() == [[0, 3, 4, 5, 5, 5], [7, 1, 2, 3, 4, 5], [2, 2, 3, 4, 5, 5]]
    # Prefill of the prompt at offset 0, then one token per step at the advancing offset, no step after the end.
    assert [(length, offset) for _, length, offset in lm.calls] == [(2, 0), (1, 2), (1, 3), (1, 4)]
    no_eos = generate(lm, prompt[:1], max_new_tokens=20, temperature=0.0)  # wraps past the vocab, never past 15
    assert no_eos.shape == (1, 22) and int(no_eos.max()) == 15
    assert torch.equal(generate(lm, prompt, max_new_tokens=0), prompt)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0], [0.0, 4.0, 1.0, 2.0, 5.0]])
    k2 = top_k_filter(logits, 2)
    assert torch.equal(torch.isfinite(k2), torch.tensor([[True, False, False, True, False],
                                                          [False, True, False, False, True]]))
    assert torch.equal(k2[torch.isfinite(k2)], logits[torch.isfinite(k2)])  # kept logits are untouched
    ties = top_k_filter(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 2)  # ties at the k-th value are all kept
    assert torch.isfinite(ties).tolist() == [[True, True, True, False]]
    probs = torch.softmax(logits, -1)
    p = top_p_filter(logits, 0.7)
    kept = torch.isfinite(p)
    for r in range(2):
        order = probs[r].argsort(descending=True)
        mass = probs[r][order].cumsum(0)
        n_needed = int((mass < 0.7).sum()) + 1  # the smallest prefix whose mass reaches 0.7
        assert kept[r].sum() == n_needed
        assert bool(kept[r, order[:n_needed]].all())
    assert torch.equal(top_p_filter(logits, 0.0), logits) and torch.equal(top_k_filter(logits, 0), logits)


def test_sample_respects_constraints_and_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    n = 20000
    draws = sample(logits.expand(n, 5), temperature=1.0, generator=g)
    freq = torch.bincount(draws, minlength=5).double() / n
    assert torch.allclose(freq, logits.exp().double(), atol=0.015), freq  # ~4 sigma at n = 20000
    top2 = sample(logits.expand(n, 5), top_k=2, generator=g)
    assert set(top2.unique().tolist()) == {0, 1}
    freq2 = torch.bincount(top2, minlength=2).double() / n
    assert abs(float(freq2[0]) - 0.4 / 0.7) < 0.02  # renormalised over the kept tokens
    nucleus = sample(logits.expand(n, 5), top_p=0.8, generator=g)  # 0.4 + 0.3 < 0.8 <= 0.85: keeps 3 tokens
    assert set(nucleus.unique().tolist()) == {0, 1, 2}
    assert torch.equal(sample(logits.expand(3, 5), temperature=0.0), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        sample(logits[None], temperature=-1.0)
