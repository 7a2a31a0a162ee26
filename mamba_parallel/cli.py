"""The `mamba-parallel` command: train, generate, prepare-data, convert, bench.

`mamba-parallel train` with no arguments trains the embedded default (a small byte-level Mamba-2 on the Python
standard library's sources); under `torchrun --nproc_per_node N` the same command runs data parallel.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mamba_parallel.config import ConfigError


def _train_parser(sub) -> None:
    from mamba_parallel.train.config import add_train_flags

    p = sub.add_parser("train", help="train a model (no arguments: the embedded CPU/GPU demo)",
                       description="Train a Mamba LM. Every flag is also a key of the --config TOML file; flags "
                                   "override the file. Under torchrun, one process per GPU (data parallel: FSDP2 "
                                   "by default).")
    add_train_flags(p)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a saved model folder",
                       description="Load a model folder (mamba_ssm or HF format, e.g. <out>/final) and sample.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="model folder (config.json + weights)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default: 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens, 0 = all (default: 40)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold, 0 = off (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weight dtype (default: fp32)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json (default: the one in --checkpoint, else bytes)")


def _prepare_parser(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize text into a token folder for --data",
                       description="Tokenize a text file, a folder, a .jsonl or a .parquet file (or 'stdlib') into "
                                   "train.bin / val.bin / header.json.")
    p.add_argument("source", help="text file, folder, .jsonl, .parquet, or 'stdlib'")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json (default: bytes)")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share held out for validation (0.005)")
    p.add_argument("--text-field", default="text", help="field / column holding the text in .jsonl/.parquet")


def _convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a model folder between the mamba_ssm and HF formats")
    p.add_argument("src", help="model folder (mamba_ssm: config.json + pytorch_model.bin, or HF)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--format", choices=["hf", "mamba_ssm"], required=True, help="format to write")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark: mamba_parallel/bench/bench_<NAME>.py",
                       description="Runs mamba_parallel.bench.bench_<NAME>.main(args).")
    p.add_argument("name", help="benchmark name, e.g. train")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mamba-parallel", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_parser, _generate_parser, _prepare_parser, _convert_parser, _bench_parser):
        add(sub)
    return p


# ---- commands ----------------------------------------------------------------------------------------------------
def cmd_train(args) -> int:
    from mamba_parallel.train.config import resolve_config
    from mamba_parallel.train.trainer import train

    import torch.distributed as dist

    try:
        train(resolve_config(args))  # a SIGTERM stop also returns normally: exit 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def cmd_generate(args) -> int:
    import torch

    from mamba_parallel.models import MambaLMHeadModel
    from mamba_parallel.train.tokenizer import tokenizer_for_checkpoint
    from mamba_parallel.train.trainer import sample_text

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model = MambaLMHeadModel.from_pretrained(args.checkpoint)
    model = model.to(device=device, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tokenizer = tokenizer_for_checkpoint(args.checkpoint, args.tokenizer)
    print(sample_text(model, tokenizer, args.prompt, args.max_new_tokens, device, args.temperature, args.top_k,
                      args.seed, top_p=args.top_p))
    return 0


def cmd_prepare(args) -> int:
    from mamba_parallel.train.data import prepare_data
    from mamba_parallel.train.tokenizer import load_tokenizer

    header = prepare_data(args.source, args.out, load_tokenizer(args.tokenizer), args.val_fraction, args.text_field)
    print(f"{args.out}: {header['tokens']['train']:,} train + {header['tokens']['val']:,} val tokens "
          f"({header['dtype']}, vocab {header['vocab_size']}, tokenizer {header['tokenizer']})")
    return 0


def cmd_convert(args) -> int:
    from mamba_parallel.models import MambaLMHeadModel

    MambaLMHeadModel.from_pretrained(args.src).save_pretrained(args.dst, format=args.format)
    print(f"wrote {args.dst} ({args.format} format)")
    return 0


def cmd_bench(args) -> int:
    module = f"mamba_parallel.bench.bench_{args.name}"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ConfigError(f"bench: no benchmark named {args.name!r} (no module {module})") from None
    rc = mod.main(args.args)
    return int(rc or 0)


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "prepare-data": cmd_prepare, "convert": cmd_convert,
            "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2: bad flags / config / data, 1: the run failed)."""
    from mamba_parallel.distributed.parallel_dims import ParallelConfigError
    from mamba_parallel.train.data import DataError
    from mamba_parallel.train.tokenizer import TokenizerError
    from mamba_parallel.train.trainer import TrainingError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError, TokenizerError, ParallelConfigError) as e:
        print(f"mamba-parallel {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"mamba-parallel {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
