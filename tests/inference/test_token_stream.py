"""Streaming every row of a batch: TokenStream and stream_generate give, step by step, what generate returns."""

import threading

import pytest
import torch

from mamba_parallel import get_preset
from mamba_parallel.inference import TokenStream, stream_generate
from mamba_parallel.inference.token_stream import GenerationCancelled
from mamba_parallel.models import MambaLMHeadModel

_MODEL = {}


def _model():
    if not _MODEL:
        torch.manual_seed(0)
        model = MambaLMHeadModel(get_preset("tiny-mamba2")).eval()
        with torch.no_grad():  # let the mixers, not the tied embedding, choose the next token
            for layer in model.backbone.layers:
                layer.mixer.out_proj.weight.mul_(30)
        _MODEL["m"] = model
    return _MODEL["m"]


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def test_a_batch_streams_what_generate_returns():
    model = _model()
    ids = torch.stack(_prompts([6, 6, 6]))
    steps = list(stream_generate(model, ids, max_new_tokens=5, temperature=0.0))
    assert len(steps) == 5 and all(s.shape == (3,) and s.dtype == torch.long and s.device.type == "cpu"
                                   for s in steps)
    out = model.generate(ids, max_new_tokens=5, temperature=0.0)
    assert torch.equal(torch.stack(steps, 1), out[:, 6:])


def test_ragged_rows_stream_in_input_order_and_pad_past_their_limit():
    model = _model()
    prompts = _prompts([5, 9, 2])  # unsorted: decoded in length order, streamed in input order
    steps = torch.stack(list(stream_generate(model, prompts, max_length=12, temperature=0.0, pad_token_id=7)), 1)
    out = model.generate(prompts, max_length=12, temperature=0.0)
    assert steps.shape == (3, 10)  # the shortest prompt's limit: 12 - 2 new tokens
    for row, (p, o) in enumerate(zip(prompts, out)):
        new = o[p.numel():]
        assert torch.equal(steps[row, :new.numel()], new)
        assert bool((steps[row, new.numel():] == 7).all())


def test_finished_rows_show_the_pad_and_the_stream_stops_with_generate():
    model = _model()
    ids = torch.stack(_prompts([4, 4], seed=3))
    free = model.generate(ids, max_new_tokens=8, temperature=0.0)[:, 4:]
    eos = int(free[0, 1])  # row 0 ends at its second new token
    steps = torch.stack(list(stream_generate(model, ids, max_new_tokens=8, temperature=0.0, eos_token_id=eos,
                                             pad_token_id=0)), 1)
    out = model.generate(ids, max_new_tokens=8, temperature=0.0, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(steps, out[:, 4:4 + steps.shape[1]])
    assert int(steps[0, 1]) == eos and bool((steps[0, 2:] == 0).all())


def test_errors_reach_the_caller_and_closing_early_stops_the_generation():
    model = _model()
    with pytest.raises(ValueError, match="input_ids must be"):
        list(stream_generate(model, torch.zeros(3, dtype=torch.long), max_new_tokens=2))
    with pytest.raises(ValueError, match="brings its own streamer"):
        next(stream_generate(model, torch.zeros(1, 3, dtype=torch.long), streamer=TokenStream()))
    ids = torch.stack(_prompts([3, 3]))
    gen = stream_generate(model, ids, max_new_tokens=50, temperature=0.0)
    first = next(gen)
    gen.close()  # the worker stops at its next step and is joined
    assert first.shape == (2,)
    assert not [t for t in threading.enumerate() if t.name == "stream_generate"]


def test_a_token_stream_fed_by_generate_in_another_thread():
    model = _model()
    ids = torch.stack(_prompts([4, 4, 4], seed=5))
    stream = TokenStream(timeout=60)
    worker = threading.Thread(target=lambda: model.generate(ids, max_new_tokens=3, temperature=0.0,
                                                            streamer=stream))
    worker.start()
    steps = list(stream)
    worker.join()
    assert torch.equal(torch.stack(steps, 1), model.generate(ids, max_new_tokens=3, temperature=0.0)[:, 4:])
    stream.cancel()
    with pytest.raises(GenerationCancelled):
        stream.put(torch.zeros(3, dtype=torch.long))


def test_a_one_sequence_streamer_still_refuses_a_batch():
    class Printer:
        def put(self, tokens):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="follows one sequence.*TokenStream"):
        _model().generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=2, streamer=Printer())


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_gpu_every_row_streams_under_cuda_graphs(preset):
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(preset)).cuda().eval()
    prompts = [p.cuda() for p in _prompts([6, 3, 6])]
    eager = model.generate(prompts, max_new_tokens=9, temperature=0.0)
    steps = torch.stack(list(stream_generate(model, prompts, max_new_tokens=9, temperature=0.0, cg=True)), 1)
    for row, (p, o) in enumerate(zip(prompts, eager)):
        assert torch.equal(steps[row].cuda(), o[p.numel():])
