"""The longest sequence one GPU trains at batch 1, ours and the peer's, by doubling until the first out-of-memory.

Each side builds its own model once (fp32 params, fused AdamW, bf16 autocast; the peer: mamba_ssm's
``MambaLMHeadModel`` + ``F.cross_entropy`` as it ships; ours: defaults + its fused loss), then trains one untimed
and one timed step at ``start``, ``2 * start``, ... tokens, stopping at the first length that runs out of memory (or
at ``max_len``). Rows: the longest length that trained, and tokens/s and peak memory at every length tried. Our
side can take the memory options a user of long sequences would (``activation_checkpointing``: every block
recomputed in the backward; ``recompute``: layers/recompute.py's items); the case names them.
"""

from __future__ import annotations

import gc

import torch

from mamba_parallel.bench.results import error_text, make_row, say
from mamba_parallel.bench.timing import Clock, synchronize
from mamba_parallel.bench.train_side_by_side import our_loss, side_optimizer


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def probe(build, loss_of, device, lengths, vocab: int, log=say, name: str = "") -> dict:
    """{length: {"tokens_per_s", "peak_gib"} or {"error"}} for lengths tried in order, stopping at the first
    failure; ``build()`` -> model, ``loss_of(model, ids, targets)`` -> loss."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    out = {}
    model = opt = None
    try:
        model = build().train()
        opt = side_optimizer(model, device)
        for length in lengths:
            if model is None:
                break
            ids = targets = None
            try:
                gen = torch.Generator().manual_seed(length)
                tokens = torch.randint(0, vocab, (1, length + 1), generator=gen)
                ids, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                clock = Clock(device)
                for step in range(2):  # the first untimed (autotuning at this length)
                    start = clock.mark()
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                        loss = loss_of(model, ids, targets)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    stop = clock.mark()
                synchronize(device)
                ms = clock.ms(start, stop)
                out[length] = {"tokens_per_s": length / ms * 1e3,
                               "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
                peak = out[length]["peak_gib"]
                log(f"long_context {name} {length}: {out[length]['tokens_per_s']:.0f} tokens/s"
                    + ("" if peak is None else f", peak {peak:.1f} GiB"))
            except Exception as e:
                out[length] = {"error": "out of memory" if _is_oom(e) else error_text(e)}
                log(f"long_context {name} {length}: {out[length]['error']}")
                break
            finally:
                del ids, targets
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    except Exception as e:  # the model itself did not build
        out[lengths[0]] = {"error": error_text(e)}
        log(f"long_context {name}: {error_text(e)}")
    finally:
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def run(preset: str, peer, device, start: int = 16384, max_len: int = 262144, log=say,
        n_layer: int | None = None, activation_checkpointing: bool = False, recompute: str = "") -> dict:
    """``n_layer``: the preset cut to that many layers (the compile warm-up). ``activation_checkpointing``,
    ``recompute``: our side's memory options (the peer's model as it ships)."""
    from mamba_parallel.config import get_preset
    from mamba_parallel.distributed.parallelize import apply_activation_checkpointing
    from mamba_parallel.layers.recompute import apply_recompute
    from mamba_parallel.models.lm import MambaLMHeadModel

    if start < 1 or max_len < start:
        raise ValueError(f"bench long_context: need 1 <= --start <= --max-len, got {start}, {max_len}")
    config = get_preset(preset)
    if n_layer is not None:
        config = config.with_layers(n_layer)
    lengths = []
    while start <= max_len:
        lengths.append(start)
        start *= 2
    found = {}
    if peer is not None:
        def build_peer():
            torch.manual_seed(0)
            return peer.build_lm(config, device)
        found["peer"] = probe(build_peer, peer.loss, device, lengths, config.vocab_size, log, f"{preset} {peer.name}")

    def build_ours():
        torch.manual_seed(0)
        model = apply_recompute(MambaLMHeadModel(config, device=device), recompute or None)
        return apply_activation_checkpointing(model) if activation_checkpointing else model
    found["ours"] = probe(build_ours, our_loss, device, lengths, config.vocab_size, log, f"{preset} ours")
    sides = ["ours"] + (["peer"] if peer is not None else [])
    options = ", ".join((["activation checkpointing"] if activation_checkpointing else [])
                        + ([f"recompute {recompute}"] if recompute else []))
    case = f"{preset} b1" + (f" (ours: {options})" if options else "")

    def longest(side):
        ok = [n for n, r in found[side].items() if "error" not in r]
        return max(ok) if ok else None

    rows = [make_row(case, "longest trained sequence", "tokens", "higher",
                     {s: longest(s) for s in sides}, preset=preset,
                     reached_max_len={s: longest(s) == lengths[-1] for s in sides})]
    for n in lengths:
        if not any(n in found[s] for s in sides):
            break
        errs = {s: found[s].get(n, {}).get("error") for s in sides}
        for metric, unit, key, better in (("tokens/s", "tokens/s", "tokens_per_s", "higher"),
                                          ("peak memory", "GiB", "peak_gib", "lower")):
            rows.append(make_row(f"{case} L{n}", metric, unit, better,
                                 {s: found[s].get(n, {}).get(key) for s in sides}, errs, preset=preset, seq_len=n))
    # a run with our memory options is a table of its own (the report keeps the newest run of each)
    return {"bench": "long_context_options" if options else "long_context",
            "title": "Longest trainable sequence on one GPU, batch 1" + (f" (ours: {options})" if options else ""),
            "settings": {"preset": preset, "lengths": lengths, "activation_checkpointing": activation_checkpointing,
                         **({"recompute": recompute} if recompute else {}),
                         **({"n_layer": n_layer} if n_layer else {}),
                         "steps_per_length": "1 untimed + 1 timed", "sides": sides},
            "rows": rows}
