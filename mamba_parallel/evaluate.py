"""``mamba-parallel eval``: loss, perplexity and bits per byte of a model on held-out data.

Data: a token folder from ``prepare-data`` (its ``val`` split by default), or raw text (a file, a folder, .jsonl,
.parquet) tokenized with the model's tokenizer. The token stream is cut into windows of ``seq_len + 1`` tokens with
stride ``seq_len`` (the training windows): every token but the first is scored once, with the context of its
window. Bits per byte = the summed loss in bits / the UTF-8 bytes of the scored tokens' text (end-of-text
separators scored but counted as no bytes), so tokenizers of any vocabulary compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch

from mamba_parallel.config import ConfigError
from mamba_parallel.progress import progress_bar


def scored_bytes(tokenizer, targets: np.ndarray, skip: set[int]) -> int:
    """UTF-8 bytes of the text of ``targets`` (ids in ``skip``, e.g. end-of-text, have none)."""
    ids = [int(t) for t in targets if int(t) not in skip]
    if getattr(tokenizer, "spec", None) == "byte":
        return len(ids)
    return len(tokenizer.decode(ids).encode("utf-8"))


@torch.inference_mode()
def evaluate_tokens(model, tokens: np.ndarray, seq_len: int, batch_size: int, device, tokenizer=None,
                    eos_token_id: int | None = None, progress: bool | None = False,
                    max_tokens: int | None = None) -> dict:
    """tokens (N,) -> {"loss" (nats / token), "perplexity", "bits_per_byte" (None without a tokenizer),
    "tokens" (scored), "bytes"}. progress: a bar (None: when stderr is a terminal)."""
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    n = len(tokens)
    if n < 2:
        raise ConfigError(f"eval: need at least 2 tokens to score, the data holds {n}")
    starts = list(range(0, n - 1, seq_len))
    total_loss, total_tokens, total_bytes = 0.0, 0, 0
    skip = {eos_token_id} if eos_token_id is not None else set()
    with progress_bar("eval", total=len(starts), enabled=progress) as advance:
        for first in range(0, len(starts), batch_size):
            group = starts[first:first + batch_size]
            width = min(seq_len, n - 1 - group[0])
            rows = [np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in group]
            inputs = torch.full((len(rows), width), 0, dtype=torch.long)
            targets = torch.full((len(rows), width), -100, dtype=torch.long)
            for i, r in enumerate(rows):
                k = min(width, len(r) - 1)
                inputs[i, :k] = torch.from_numpy(r[:k])
                targets[i, :k] = torch.from_numpy(r[1:k + 1])
            count = int((targets != -100).sum())
            loss = model(inputs.to(device), targets=targets.to(device)).loss
            total_loss += float(loss) * count
            total_tokens += count
            if tokenizer is not None:
                total_bytes += sum(scored_bytes(tokenizer, r[1:], skip) for r in rows)
            advance(len(group), note=f"loss {total_loss / total_tokens:.4f}")
    loss = total_loss / total_tokens
    bpb = total_loss / math.log(2) / total_bytes if total_bytes else None
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "bits_per_byte": bpb, "tokens": total_tokens,
            "bytes": total_bytes if tokenizer is not None else None}


# ---- the command -------------------------------------------------------------------------------------------------
def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a model on held-out data",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="model folder (or hub name)")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="token folder from prepare-data, or raw text: a file, a folder, .jsonl or .parquet")
    p.add_argument("--split", choices=["val", "train"], default="val", help="split of a token folder (default: val)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens of context per window (default: 1024)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward (default: 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens (default: all)")
    p.add_argument("--text-field", default="text", help="field / column holding the text in .jsonl/.parquet")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json (default: the token folder's, else the checkpoint's, else bytes)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="weights (default: as saved)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on when stderr is a terminal)")


def _tokens_and_tokenizer(args, model_folder: str):
    from mamba_parallel.train.data import DataError, folder_tokenizer, is_prepared, iter_documents, open_split
    from mamba_parallel.train.data import read_header
    from mamba_parallel.train.tokenizer import load_tokenizer, tokenizer_for_checkpoint

    try:
        if os.path.isdir(args.data) and is_prepared(args.data):
            header = read_header(args.data)
            tokenizer = load_tokenizer(args.tokenizer or folder_tokenizer(args.data, header))
            return open_split(args.data, args.split), tokenizer, header.get("eos_token_id")
        tokenizer = tokenizer_for_checkpoint(model_folder, args.tokenizer)
        ids: list[int] = []
        for _, text in iter_documents(args.data, args.text_field):
            ids += tokenizer.encode(text)
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
    except DataError as e:
        msg = str(e)
        raise ConfigError(msg.replace("--data: ", "--data ", 1)) from None
    return np.asarray(ids, dtype=np.int64), tokenizer, tokenizer.eos_token_id


def cmd_eval(args) -> int:
    from mamba_parallel.models import MambaLMHeadModel

    for name in ("seq_len", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = MambaLMHeadModel.from_pretrained(args.checkpoint, device=device, dtype=dtype).eval()
    tokens, tokenizer, eos = _tokens_and_tokenizer(args, str(model.tokenizer_folder or args.checkpoint))
    if len(tokens) and int(tokens.max()) >= model.config.padded_vocab_size:
        raise ConfigError(f"--data holds token id {int(tokens.max())} but the model's vocabulary has "
                          f"{model.config.padded_vocab_size} entries: it was tokenized with another tokenizer")
    result = evaluate_tokens(model, tokens, args.seq_len, args.batch_size, device, tokenizer, eos, args.progress,
                             args.max_tokens)
    result.update(checkpoint=str(args.checkpoint), data=str(args.data), seq_len=args.seq_len)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.checkpoint} on {args.data}", show_header=True)
    for col in ("loss (nats/token)", "perplexity", "bits/byte", "tokens", "bytes"):
        table.add_column(col, justify="right")
    bpb = "-" if result["bits_per_byte"] is None else f"{result['bits_per_byte']:.4f}"
    table.add_row(f"{result['loss']:.4f}", f"{result['perplexity']:.3f}", bpb, f"{result['tokens']:,}",
                  "-" if result["bytes"] is None else f"{result['bytes']:,}")
    Console().print(table)
    return 0
