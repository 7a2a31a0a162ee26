"""Generation beside mamba_ssm: each one's public ``generate`` with CUDA graphs, same weights, same prompts.

    mamba-parallel bench generate [--peer | --no-peer] [--models mamba2-130m mamba2-2.7b mamba-2.8b]
        [--batch-sizes 1 64] [--prompt-len 256] [--new-tokens 256] [--repeats 2] [--json PATH]

Random bf16 weights (timing only), built and initialised by the peer and handed to ours through its
``save_pretrained`` and our ``from_pretrained`` (without the peer: our own init). Greedy (top_k = 1). The peer:
``model.generate(input_ids, max_length=prompt + n, top_k=1, cg=True)``; ours: ``model.generate(input_ids,
max_new_tokens=n, top_k=1, cuda_graph=True)``. Each call is timed whole with CUDA events; prefill ms = the call with 1 new token,
decode ms/step = (call with n new tokens - call with 1) / (n - 1); median of --repeats after one untimed call of
each length (graph capture). ``tokens_match``: the share of new tokens the two sides agree on.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from mamba_parallel.bench import peer as peer_mod
from mamba_parallel.bench.results import add_git_commit_flag, error_text, make_row, publish, say
from mamba_parallel.bench.timing import DTYPES, Clock

MODELS = ["mamba2-130m", "mamba2-2.7b", "mamba-2.8b"]


def our_generate(model, input_ids: torch.Tensor, new_tokens: int, cuda_graph: bool, state_dtype=None) -> torch.Tensor:
    return model.generate(input_ids, max_new_tokens=new_tokens, top_k=1, cuda_graph=cuda_graph,
                          state_dtype=state_dtype)


def _release_ours(model) -> None:
    from mamba_parallel.inference.cuda_graph import release_graphs

    release_graphs(model)


def time_generate(gen, prompt: torch.Tensor, new_tokens: int, repeats: int, device) -> dict:
    """gen(prompt, n) -> tokens; -> prefill ms, decode ms/step (from n and 1 new tokens), the n-token output."""
    clock = Clock(device)

    def one(n):
        start = clock.mark()
        out = gen(prompt, n)
        return clock.ms(start, clock.mark()), out

    _, tokens = one(new_tokens)  # untimed: captures the graphs, autotunes the kernels
    one(1)
    long_ms, short_ms = [], []
    for _ in range(repeats):
        long_ms.append(one(new_tokens)[0])
        short_ms.append(one(1)[0])
    prefill = statistics.median(short_ms)
    decode = (statistics.median(long_ms) - prefill) / max(new_tokens - 1, 1)
    return {"prefill_ms": prefill, "decode_ms_per_step": decode, "total_ms": statistics.median(long_ms),
            "tokens": tokens[:, prompt.shape[1]:]}


def run_model(preset: str, peer, device, batch_sizes=(1, 64), prompt_len: int = 256, new_tokens: int = 256,
              repeats: int = 2, dtype: str = "bf16", seed: int = 0, log=say, n_layer: int | None = None,
              state_dtype: str = "fp32") -> list[dict]:
    """Every batch size of one model -> rows (decode ms/step, prefill ms), both sides on the same weights.
    ``n_layer``: the preset cut to that many layers (the compile warm-up)."""
    from mamba_parallel.config import get_preset
    from mamba_parallel.models.lm import MambaLMHeadModel

    config = get_preset(preset)
    if n_layer is not None:
        config = config.with_layers(n_layer)
    device = torch.device(device)
    cuda_graph = device.type == "cuda"
    models, gens, errors = {}, {}, {}
    torch.manual_seed(seed)
    if peer is not None:
        try:
            models["peer"] = peer.build_lm(config, device, DTYPES[dtype]).eval()
            gens["peer"] = lambda p, n: peer.generate(models["peer"], p, n, cuda_graph)
        except Exception as e:
            errors["peer"] = error_text(e)
            log(f"generate {preset} {peer.name}: {errors['peer']}")
    try:
        if "peer" in models:
            models["ours"] = peer_mod.ours_from_peer(peer, models["peer"], device, DTYPES[dtype]).eval()
        else:
            models["ours"] = MambaLMHeadModel(config, device=device, dtype=DTYPES[dtype]).eval()
        gens["ours"] = lambda p, n: our_generate(models["ours"], p, n, cuda_graph, DTYPES[state_dtype])
    except Exception as e:
        errors["ours"] = error_text(e)
        log(f"generate {preset} ours: {errors['ours']}")
    sides = ["ours"] + (["peer"] if peer is not None else [])
    rows = []
    for batch in batch_sizes:
        gen = torch.Generator().manual_seed(seed + batch)
        prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=gen).to(device)
        figures, errs = {}, dict(errors)
        for side in sides:
            if side not in gens:
                continue
            try:
                figures[side] = time_generate(gens[side], prompt, new_tokens, repeats, device)
                log(f"generate {preset} b{batch} {side}: prefill {figures[side]['prefill_ms']:.2f} ms, "
                    f"decode {figures[side]['decode_ms_per_step']:.3f} ms/step")
            except Exception as e:
                errs[side] = error_text(e)
                log(f"generate {preset} b{batch} {side}: {errs[side]}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        extra = {"preset": preset, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens}
        if "ours" in figures and "peer" in figures:
            a, b = figures["ours"]["tokens"], figures["peer"]["tokens"]
            extra["tokens_match"] = (a == b).float().mean().item() if a.shape == b.shape else 0.0
        case = f"{preset} b{batch}"
        value = {s: (figures[s]["decode_ms_per_step"] if s in figures else None) for s in sides}
        rows.append(make_row(case, "decode", "ms/step", "lower", value, errs, **extra))
        value = {s: (figures[s]["prefill_ms"] if s in figures else None) for s in sides}
        rows.append(make_row(case, f"prefill {prompt_len} tokens", "ms", "lower", value, errs, **extra))
    if "ours" in models:
        _release_ours(models["ours"])
    if "peer" in models:
        peer.release(models["peer"])
    models.clear()
    gens.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(models, peer, device, batch_sizes=(1, 64), prompt_len=256, new_tokens=256, repeats=2, dtype="bf16",
        seed=0, deadline=None, log=say, n_layer=None, state_dtype="fp32") -> dict:
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError(f"bench generate: need --prompt-len >= 1, --new-tokens >= 2, --repeats >= 1, got "
                         f"{prompt_len}, {new_tokens}, {repeats}")
    rows = []
    for preset in models:
        if deadline is not None and deadline.passed():
            rows.append(make_row(f"{preset}", "decode", "ms/step", "lower", {"ours": None},
                                 {"ours": "skipped: time budget spent"}, preset=preset))
            continue
        rows += run_model(preset, peer, device, batch_sizes, prompt_len, new_tokens, repeats, dtype, seed, log,
                          n_layer=n_layer, state_dtype=state_dtype)
    # fp32 states are ours by default; bf16 ones are what mamba_ssm keeps for a bf16 model: a table of their own
    bench, title = "generate", "Generation (public generate, CUDA graphs, greedy)"
    if state_dtype != "fp32":
        bench, title = f"generate_{state_dtype}_states", f"{title}, our recurrent states in {state_dtype}"
    return {"bench": bench, "title": title,
            "settings": {"dtype": dtype, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
                         "batch_sizes": list(batch_sizes), "cuda_graph": torch.device(device).type == "cuda",
                         **({"n_layer": n_layer} if n_layer else {}),
                         **({"state_dtype": state_dtype} if state_dtype != "fp32" else {}),
                         "peer": "generate(input_ids, max_length, top_k=1, cg=True)",
                         "ours": "generate(input_ids, new_tokens, top_k=1, cuda_graph=True)",
                         "sides": ["ours"] + (["peer"] if peer is not None else [])},
            "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench generate", description=__doc__.splitlines()[0])
    peer_mod.add_peer_flags(ap)
    ap.add_argument("--models", nargs="+", default=MODELS, help=f"presets (default: {' '.join(MODELS)})")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="default: 1 64")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default: 256)")
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens of the long call (default: 256)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls of each length, median (default: 2)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight dtype (default: bf16)")
    ap.add_argument("--state-dtype", choices=sorted(DTYPES), default="fp32",
                    help="our recurrent states (default: fp32; mamba_ssm keeps them in the weight dtype)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default: 0)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="write the result: a .json file, or a folder (then <date>-<device>/generate.json in it)")
    add_git_commit_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    peer = peer_mod.resolve_peer(a.peer, a.peer_impl)
    result = run(a.models, peer, device, a.batch_sizes, a.prompt_len, a.new_tokens, a.repeats, a.dtype, a.seed,
                 state_dtype=a.state_dtype)
    publish(result, device, peer, path=a.json, git_commit=a.git_commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
