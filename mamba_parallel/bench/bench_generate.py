"""Generation benchmark: prefill time, decode ms/step and tokens/s, eager and with CUDA-graph decode.

    python -m mamba_parallel.bench.bench_generate [--models mamba2-130m mamba2-2.7b mamba-2.8b]
        [--batch-sizes 1 64] [--prompt-len 256] [--gen-len 256] [--dtype bf16] [--modes eager graph] [--json PATH]

The setting of the peer figures (ANCHORS.md): bf16 weights, prompt 256, 256 new tokens, greedy. Random weights
(timing only). Each (model, batch, mode) runs the loop of ``generate``: prefill the prompt into a fresh cache
(gives the first new token), then ``gen_len - 1`` one-token steps, each followed by greedy argmax. Times are
medians over ``--repeats`` runs after one untimed run (which also captures the graph); decode ms/step is the
decode time over those steps, tokens/s = batch * 1000 / ms-per-step. "graph" replays the captured step of
inference/cuda_graph.py; its tokens are checked against eager's (``tokens_match``), and the benchmark loop's tokens
against ``model.generate`` (``generate_match``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch

from mamba_parallel.bench.report import ANCHORS
from mamba_parallel.config import get_preset

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("eager", "graph")


class _Clock:
    """Wall time of a stretch of work: CUDA events on a GPU (no sync inside the loop), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def greedy_loop(run, cache, prompt: torch.Tensor, gen_len: int, vocab: int, clock: _Clock):
    """The decode loop of ``generate`` (greedy) with ``run`` = the model or a GraphedDecoder.

    prompt (b, L) -> (new tokens (b, gen_len), prefill ms (to the first new token), decode ms of the rest).
    """
    t0 = clock.mark()
    logits = run(prompt, inference_params=cache, num_last_tokens=1).logits[:, -1, :vocab]
    cache.seqlen_offset = prompt.shape[1]
    token = logits.argmax(dim=-1)
    t1 = clock.mark()
    tokens = [token]
    for _ in range(gen_len - 1):
        logits = run(token[:, None], inference_params=cache).logits[:, -1, :vocab]
        cache.seqlen_offset += 1
        token = logits.argmax(dim=-1)
        tokens.append(token)
    t2 = clock.mark()
    return torch.stack(tokens, dim=1), clock.ms(t0, t1), clock.ms(t1, t2)


def build_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A randomly initialised ``preset`` model in ``dtype`` on ``device``, in eval mode."""
    from mamba_parallel.models.lm import MambaLMHeadModel

    torch.manual_seed(seed)
    return MambaLMHeadModel(get_preset(preset), device=device, dtype=dtype).eval()


def _generate_supports_graphs() -> bool:
    from mamba_parallel.inference.generate import generate

    return "cuda_graph" in inspect.signature(generate).parameters


@torch.inference_mode()
def bench_one(model, preset: str, batch: int, mode: str, prompt_len: int, gen_len: int, repeats: int,
              device: torch.device, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """Times one (model, batch, mode) -> (result row, the generated tokens (b, gen_len))."""
    from mamba_parallel.inference.cuda_graph import decode_runner

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed + batch)
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
    clock = _Clock(device)
    max_seqlen = prompt_len + gen_len
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    prefill, decode, tokens = [], [], None
    for i in range(repeats + 1):  # run 0: warm-up (autotuning, graph capture)
        run, cache = decode_runner(model, batch, max_seqlen, cuda_graph=mode == "graph")
        tokens, p_ms, d_ms = greedy_loop(run, cache, prompt, gen_len, vocab, clock)
        if i > 0:
            prefill.append(p_ms)
            decode.append(d_ms)
    steps = max(gen_len - 1, 1)
    decode_ms = statistics.median(decode) / steps
    row = dict(model=preset, batch=batch, mode=mode, prompt_len=prompt_len, gen_len=gen_len,
               prefill_ms=statistics.median(prefill), decode_ms_per_step=decode_ms,
               decode_tokens_per_s=batch * 1e3 / decode_ms if decode_ms > 0 else float("inf"),
               total_ms=statistics.median(p + d for p, d in zip(prefill, decode)))
    row["e2e_tokens_per_s"] = batch * gen_len * 1e3 / row["total_ms"]
    # model.generate (the library path) on the same prompt: its greedy tokens must be the loop's tokens.
    kwargs = {"cuda_graph": True} if mode == "graph" and _generate_supports_graphs() else {}
    if mode == "eager" or kwargs:
        t0 = clock.mark()
        out = model.generate(prompt, gen_len, temperature=0.0, **kwargs)
        row["generate_ms"] = clock.ms(t0, clock.mark())
        row["generate_match"] = bool(torch.equal(out[:, prompt_len:], tokens))
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    peer = ANCHORS["generate"].get(preset, {}).get(batch)
    if peer is not None:
        row["peer_ms_per_step"] = peer
        row["x_peer"] = peer / decode_ms
    return row, tokens


def run_benchmark(models: list[str], batch_sizes: list[int], modes: list[str], prompt_len: int = 256,
                  gen_len: int = 256, dtype: str = "bf16", device: str | None = None, repeats: int = 3,
                  seed: int = 0, log=print) -> dict:
    """Every model x batch x mode -> {"bench": "generate", ..., "rows": [row, ...]} (rows as in ``bench_one``)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bad = sorted(set(modes) - set(MODES))
    if bad:
        raise ValueError(f"bench_generate: unknown --modes {bad}; known: {list(MODES)}")
    if "graph" in modes and dev.type != "cuda":
        raise ValueError(f"bench_generate: --modes graph needs a CUDA device, got --device {dev}")
    if prompt_len < 1 or gen_len < 1 or repeats < 1:
        raise ValueError(f"bench_generate: need --prompt-len, --gen-len, --repeats >= 1, got {prompt_len}, "
                         f"{gen_len}, {repeats}")
    result = dict(bench="generate", device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                  torch=torch.__version__, dtype=dtype, prompt_len=prompt_len, gen_len=gen_len, repeats=repeats,
                  rows=[])
    for preset in models:
        model = build_model(preset, dev, DTYPES[dtype], seed)
        for batch in batch_sizes:
            eager_tokens = None
            for mode in modes:
                try:
                    row, tokens = bench_one(model, preset, batch, mode, prompt_len, gen_len, repeats, dev, seed)
                except torch.cuda.OutOfMemoryError as e:
                    row, tokens = dict(model=preset, batch=batch, mode=mode, error=f"OutOfMemoryError: "
                                       f"{str(e)[:200]}"), None
                if mode == "eager":
                    eager_tokens = tokens
                elif eager_tokens is not None and tokens is not None:
                    row["tokens_match"] = (eager_tokens == tokens).float().mean().item()
                result["rows"].append(row)
                log(json.dumps(row))
        from mamba_parallel.inference.cuda_graph import release_graphs

        release_graphs(model)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return result


def format_table(result: dict) -> str:
    """A Markdown table of ``run_benchmark``'s result."""
    lines = [f"prompt {result['prompt_len']}, {result['gen_len']} new tokens, greedy, {result['dtype']} weights, "
             f"{result['device']}", "",
             "| model | batch | mode | prefill ms | decode ms/step | tokens/s | peer ms/step | x peer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['error'][:60]} | | | | |")
            continue
        peer = f"{r['peer_ms_per_step']:.2f}" if "peer_ms_per_step" in r else "–"
        ratio = f"{r['x_peer']:.2f}x" if "x_peer" in r else "–"
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['prefill_ms']:.2f} | "
                     f"{r['decode_ms_per_step']:.3f} | {r['decode_tokens_per_s']:,.0f} | {peer} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench generate", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mamba2-130m", "mamba2-2.7b", "mamba-2.8b"],
                    help="presets to time (default: the three of ANCHORS.md)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="default: 1 64")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default: 256)")
    ap.add_argument("--gen-len", type=int, default=256, help="new tokens (default: 256)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight dtype (default: bf16)")
    ap.add_argument("--modes", nargs="+", default=None, choices=MODES,
                    help="eager and/or graph (default: both on CUDA, eager on CPU)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting, median (default: 3)")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default: 0)")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results to PATH")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    modes = a.modes or (list(MODES) if device == "cuda" else ["eager"])
    result = run_benchmark(a.models, a.batch_sizes, modes, a.prompt_len, a.gen_len, a.dtype, device, a.repeats,
                           a.seed)
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
