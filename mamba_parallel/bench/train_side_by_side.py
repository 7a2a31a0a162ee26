"""One training step of a preset, mamba_ssm's model beside ours, same initial weights, same batch, same process.

The peer as its users run it: mamba_ssm's ``MambaLMHeadModel``, ``F.cross_entropy`` on its logits. Ours as our users
run it: the model from ``MambaLMHeadModel.from_pretrained`` with its defaults and its fused loss. Both: fp32
parameters, bf16 autocast, fused AdamW (lr 1e-4, weight decay 0.1, betas 0.9 / 0.95), no gradient clipping. The
peer model is built and initialised by the peer, written with its ``save_pretrained`` and read back by ours, so
both start from the same weights; both step-1 losses (before any update, same batch) are reported and checked to
agree within bf16 tolerance. Each side: ``--warmup-steps`` untimed steps, then ``--steps`` CUDA-event timed steps
(median); peak memory from ``torch.cuda.max_memory_allocated`` with the cache emptied and the peak reset before it.
With ``cuda_graph`` our step runs as ``--cuda-graph`` trains (train/cuda_graph.py: the whole step captured once,
then replayed; its first call warms up, undoes that, captures and replays, so step 1 is the same loss and the
capture's memory counts in the peak); the peer's as it ships, eager.
"""

from __future__ import annotations

import gc
import statistics

import torch

from mamba_parallel.bench.peer import load_ours, save_peer_weights
from mamba_parallel.bench.results import error_text, make_row, say
from mamba_parallel.bench.timing import Clock, synchronize
from mamba_parallel.train.config import DEFAULT_RECOMPUTE

PRESETS = ["mamba2-130m", "mamba2-370m", "mamba2-1.3b", "mamba2-2.7b",
           "mamba-130m", "mamba-370m", "mamba-1.4b", "mamba-2.8b"]
LR, WEIGHT_DECAY, BETAS = 1e-4, 0.1, (0.9, 0.95)
LOSS_RTOL = 5e-3  # bf16 autocast: the two step-1 losses (same weights, same batch) agree to this relative error


def our_loss(model, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Our model's own (fused) loss; targets[:, t] is the token after position t (pre-shifted)."""
    return model(input_ids, targets=targets).loss


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def time_steps(loss_fn, optimizer, device, warmup: int, steps: int, graphed=None) -> dict:
    """Run ``warmup + steps`` training steps; -> step-1 loss, median step ms, peak GiB (CUDA), all losses.
    ``graphed``: a ``GraphedTrainStep`` call (-> (loss, norm)) that runs each step instead (loss_fn unused)."""
    cuda = torch.device(device).type == "cuda"
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cuda)
    clock = Clock(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    marks, losses = [], []
    for i in range(warmup + steps):
        start = clock.mark()
        if graphed is not None:
            loss, _ = graphed()
        else:
            with autocast:
                loss = loss_fn()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        stop = clock.mark()
        losses.append(loss.detach().clone())  # a graph's loss is a static buffer: the next replay overwrites it
        if i >= warmup:
            marks.append((start, stop))
    synchronize(device)
    step_ms = statistics.median(clock.ms(a, b) for a, b in marks)
    return {"step1_loss": losses[0].item(), "losses": [x.item() for x in losses], "step_ms": step_ms,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def _side(name, build, loss_of, device, warmup, steps, log, combine=None,
          graph_batch=None) -> tuple[dict | None, str | None]:
    """Build one side's model + optimizer, time its steps, free it; -> (figures, error). ``combine(figures,
    error)``: what every rank of a data-parallel run agrees on (the slowest rank's time, the mean loss).
    ``graph_batch`` (input ids, targets): our model's step as one CUDA graph on that batch (``--cuda-graph``)."""
    model = opt = figures = error = graphed = None
    try:
        _free(device)
        model = build()
        model.train()
        opt = side_optimizer(model, device)
        if graph_batch is not None:
            from mamba_parallel.train.cuda_graph import GraphedTrainStep

            step = GraphedTrainStep(model, opt, grad_clip=None, autocast_dtype=torch.bfloat16)
            graphed = lambda: step(*graph_batch)  # noqa: E731
        figures = time_steps(lambda: loss_of(model), opt, device, warmup, steps, graphed=graphed)
    except Exception as e:  # an OOM or a failing side is recorded; the other side and the next preset go on
        error = error_text(e)
    finally:
        model = opt = graphed = step = None  # noqa: F841 (frees the side before the next one is measured)
        _free(device)
    if combine is not None:
        figures, error = combine(figures, error)
    if error is not None:
        log(f"train {name}: {error}")
        return None, error
    peak = "" if figures["peak_gib"] is None else f", peak {figures['peak_gib']:.1f} GiB"
    log(f"train {name}: step-1 loss {figures['step1_loss']:.4f}, {figures['step_ms']:.1f} ms/step{peak}")
    return figures, None


def _optimizer_groups(model) -> list[dict]:
    """The usual decay / no-decay groups (norms, biases, A_log, D, dt_bias without weight decay), for both sides."""
    from mamba_parallel.train.optim import no_weight_decay

    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            (no_decay if no_weight_decay(name, p) else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


def side_optimizer(model, device) -> torch.optim.AdamW:
    """The AdamW every side of the training benchmarks steps with (fused on CUDA, the groups above)."""
    return torch.optim.AdamW(_optimizer_groups(model), lr=LR, betas=BETAS,
                             fused=torch.device(device).type == "cuda" or None)


def run_preset(preset: str, peer, device, seq_len: int = 2048, batch: int = 8, warmup: int = 2, steps: int = 5,
               seed: int = 0, loss_rtol: float = LOSS_RTOL, log=say, n_layer: int | None = None,
               recompute: str = DEFAULT_RECOMPUTE, cuda_graph: bool = False) -> tuple[list[dict], dict]:
    """-> (rows: tokens/s, step ms, peak GiB; check: both step-1 losses and whether they agree). ``n_layer``: the
    preset cut to that many layers (the compile warm-up). ``recompute``: what our layers rebuild in the backward
    instead of keeping (layers/recompute.py; the peer's model as it is): the case names it unless it is the
    training default. ``cuda_graph``: our step captured as one CUDA graph (the peer's eager, as it ships): the case
    names it."""
    from mamba_parallel.config import get_preset
    from mamba_parallel.layers.recompute import apply_recompute
    from mamba_parallel.models.lm import MambaLMHeadModel

    config = get_preset(preset)
    if n_layer is not None:
        config = config.with_layers(n_layer)
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=gen)
    ids, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    figures, errors, handed = {}, {}, {}

    def build_peer():
        torch.manual_seed(seed)
        model = peer.build_lm(config, device)
        handed["folder"] = save_peer_weights(peer, model)  # ours reads them after the peer's side is freed
        return model

    def build_ours():
        if "folder" in handed:
            return apply_recompute(load_ours(handed.pop("folder"), device), recompute)
        torch.manual_seed(seed)
        return apply_recompute(MambaLMHeadModel(config, device=device), recompute)

    if peer is not None:
        figures["peer"], errors["peer"] = _side(f"{preset} {peer.name}", build_peer,
                                                lambda m: peer.loss(m, ids, targets), device, warmup, steps, log)
        if "folder" not in handed and figures["peer"] is None:
            errors["ours_weights"] = "the peer's weights were not handed over; ours starts from its own init"
    figures["ours"], errors["ours"] = _side(f"{preset} ours", build_ours, lambda m: our_loss(m, ids, targets),
                                            device, warmup, steps, log,
                                            graph_batch=(ids, targets) if cuda_graph else None)
    if "folder" in handed:  # ours failed before reading it
        import shutil
        shutil.rmtree(handed.pop("folder"), ignore_errors=True)
    case = (f"{preset} b{batch} L{seq_len}" + (f" recompute {recompute or 'none'}" if recompute != DEFAULT_RECOMPUTE
                                               else "")
            + (" cuda graph (ours)" if cuda_graph else ""))
    rows = _rows(case, figures, errors, batch * seq_len, peer is not None, preset=preset)
    check = _loss_check(preset, figures.get("ours"), figures.get("peer") if peer is not None else None, loss_rtol,
                        log)
    if errors.get("ours_weights"):
        check["note"] = errors["ours_weights"]
    return rows, check


def _rows(case: str, figures: dict, errors: dict, tokens_per_step: int, with_peer: bool, **extra) -> list[dict]:
    """tokens/s, step ms and peak memory rows of one case; ``figures`` maps "ours" / "peer" to a side's figures."""
    def value(side, key):
        f = figures.get(side)
        return None if f is None else f[key]

    def tps(side):
        ms = value(side, "step_ms")
        return None if ms is None else tokens_per_step / ms * 1e3

    sides = ["ours"] + (["peer"] if with_peer else [])
    errs = {s: errors.get(s) for s in sides}
    return [make_row(case, "tokens/s", "tokens/s", "higher", {s: tps(s) for s in sides}, errs, **extra),
            make_row(case, "step", "ms", "lower", {s: value(s, "step_ms") for s in sides}, errs, **extra),
            make_row(case, "peak memory", "GiB", "lower", {s: value(s, "peak_gib") for s in sides}, errs, **extra)]


def _loss_check(preset: str, ours: dict | None, peer: dict | None, loss_rtol: float, log, **extra) -> dict:
    """Both step-1 losses (same weights, same batch, before any update) and whether they agree."""
    check = {"preset": preset, **extra, "ours_step1_loss": None if ours is None else ours["step1_loss"],
             "peer_step1_loss": None if peer is None else peer["step1_loss"], "rtol": loss_rtol}
    if check["ours_step1_loss"] is not None and check["peer_step1_loss"] is not None:
        rel = abs(check["ours_step1_loss"] - check["peer_step1_loss"]) / abs(check["peer_step1_loss"])
        check.update(rel_diff=rel, agree=rel <= loss_rtol)
        what = " ".join([preset, *map(str, extra.values())])
        log(f"train {what}: step-1 loss ours {check['ours_step1_loss']:.5f}, peer {check['peer_step1_loss']:.5f}"
            f" ({'agree' if check['agree'] else 'DIFFER'}, rel {rel:.1e})")
    return check


def run(presets, peer, device, seq_len=2048, batch=8, warmup=2, steps=5, seed=0, deadline=None, log=say,
        n_layer=None, recompute: str = DEFAULT_RECOMPUTE, cuda_graph: bool = False) -> dict:
    """Every preset (skipped with a note once ``deadline`` has passed) -> the result's settings, rows, checks."""
    rows, checks = [], []
    for preset in presets:
        if deadline is not None and deadline.passed():
            rows.append(make_row(f"{preset} b{batch} L{seq_len}", "tokens/s", "tokens/s", "higher", {"ours": None},
                                 {"ours": "skipped: time budget spent"}, preset=preset))
            continue
        new_rows, check = run_preset(preset, peer, device, seq_len, batch, warmup, steps, seed, log=log,
                                     n_layer=n_layer, recompute=recompute, cuda_graph=cuda_graph)
        rows += new_rows
        checks.append(check)
    return {"bench": "train", "title": "One training step (fp32 params, bf16 autocast, fused AdamW)",
            "settings": {"seq_len": seq_len, "batch": batch, "warmup_steps": warmup, "timed_steps": steps,
                         **({"n_layer": n_layer} if n_layer else {}),
                         "optimizer": f"AdamW fused, lr {LR}, weight decay {WEIGHT_DECAY}, betas {BETAS}, no clipping",
                         "peer": "MambaLMHeadModel + F.cross_entropy on its logits",
                         "ours": "MambaLMHeadModel.from_pretrained(peer's save_pretrained) + its fused loss"
                                 + f", recompute {recompute or 'none'}"
                                 + (", the whole step as one CUDA graph (--cuda-graph)" if cuda_graph else ""),
                         "sides": ["ours"] + (["peer"] if peer is not None else [])},
            "rows": rows, "checks": {"step1_loss": checks}}
