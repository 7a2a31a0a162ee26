"""The `mamba-parallel` command: train, generate, eval, prepare-data, convert, plot, bench.

`mamba-parallel train` with no arguments trains the embedded default (a small byte-level Mamba-2 on the Python
standard library's sources); under `torchrun --nproc_per_node N` the same command runs data parallel.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    from mamba_parallel.inference.cli_generate import add_generate_parser

    add_generate_parser(sub)


def _prepare_parser(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize text into a token folder for --data",
                       description="Tokenize a text file, a folder, a .jsonl or a .parquet file (or 'stdlib') into "
                                   "train.bin / val.bin / header.json.")
    p.add_argument("source", help="text file, folder, .jsonl, .parquet, or 'stdlib'")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json (default: bytes)")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share held out for validation (0.005)")
    p.add_argument("--text-field", default="text", help="field / column holding the text in .jsonl/.parquet")
    p.add_argument("--allow-binary", action="store_true",
                   help="tokenize files that are not valid UTF-8 text anyway (bad bytes become U+FFFD); by default "
                        "such a file is refused, naming it")


def _convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a model folder between the mamba_ssm, HF and Mistral formats")
    p.add_argument("src", help="model folder (mamba_ssm, HF transformers or Mistral's params.json layout) or a "
                               "hub name")
    p.add_argument("dst", help="output folder")
    p.add_argument("--format", choices=["hf", "mamba_ssm", "mistral"], required=True, help="format to write")
    p.add_argument("--from-format", choices=["hf", "mamba_ssm", "mistral"], default=None,
                   help="layout to read when SRC holds several (default: detected)")
    p.add_argument("--max-shard-size", default="5GB", help="shard the weights past this size (default: 5GB)")


def _verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a model / token / checkpoint / run folder against its manifest",
                       description="Verify the sizes and SHA-256 of every file a folder's manifest lists: a model "
                                   "folder, a token folder, a DCP checkpoint, or a whole run folder (--out). Exit 1 "
                                   "when anything does not match.")
    p.add_argument("path", metavar="PATH", help="the folder to check")
    p.add_argument("--workers", type=int, default=None, help="hashing threads (default: one per CPU core)")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (side by side with mamba_ssm when it imports)",
                       description="Runs mamba_parallel.bench.bench_<NAME>.main(args): ssd, selective_scan, train, "
                                   "generate, long_context (each with --peer / --no-peer), all (every one, then "
                                   "the report), ops, scaling; also profile_train, profile_decode and report "
                                   "(docs/performance.md).")
    p.add_argument("name", help="benchmark name, e.g. train, all, report")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def _eval_parser(sub) -> None:
    from mamba_parallel.evaluate import add_eval_parser

    add_eval_parser(sub)


def _plot_parser(sub) -> None:
    from mamba_parallel.plots import add_plot_parser

    add_plot_parser(sub)


def version_text() -> str:
    """``mamba-parallel --version``: this package's version, and the torch / triton it runs on."""
    import importlib.metadata

    import mamba_parallel

    try:
        ours = importlib.metadata.version("mamba-parallel")
    except importlib.metadata.PackageNotFoundError:  # a source checkout that is not installed
        ours = mamba_parallel.__version__
    parts = [f"mamba-parallel {ours}"]
    for dist in ("torch", "triton"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return ", ".join(parts) + f", python {sys.version.split()[0]}"


class _VersionAction(argparse.Action):
    """--version, computed only when asked (the versions are looked up then)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mamba-parallel", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=_VersionAction, help="print the versions of mamba-parallel, torch, triton")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_parser, _generate_parser, _eval_parser, _prepare_parser, _convert_parser, _plot_parser,
                _verify_parser, _bench_parser):
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


def _check_model_folder(path: str, what: str) -> None:
    """Point a user who names a training run or a DCP checkpoint instead of a model folder at the right one."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    if os.path.isfile(os.path.join(path, "config.toml")) and os.path.isdir(os.path.join(path, "checkpoints")):
        raise ConfigError(f"{what} {path!r} is a training run folder; its model folder is "
                          f"{os.path.join(path, 'final')!r} (written when the run completes)")
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(f"{what} {path!r} is a training checkpoint (DCP, for `train --resume`); a model folder "
                          f"is <out>/final, written when the run completes")


def cmd_generate(args) -> int:
    from mamba_parallel.inference.cli_generate import cmd_generate as run
    from mamba_parallel.input_checks import check_prompt, check_sampling

    check_sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty)
    if args.prompt not in (None, "-"):
        check_prompt(args.prompt)
    _check_model_folder(args.checkpoint, "--checkpoint")
    return run(args)


def cmd_prepare(args) -> int:
    from mamba_parallel.progress import progress_bar
    from mamba_parallel.train.data import DataError, prepare_data
    from mamba_parallel.train.tokenizer import load_tokenizer

    try:
        if not 0 <= args.val_fraction < 1:
            raise ConfigError(f"--val-fraction must lie in [0, 1), got {args.val_fraction}")
        with progress_bar("tokenizing", unit="documents") as advance:
            header = prepare_data(args.source, args.out, load_tokenizer(args.tokenizer), args.val_fraction,
                                  args.text_field, on_document=lambda name: advance(1, os.path.basename(name)),
                                  allow_binary=args.allow_binary)
    except DataError as e:  # the data module names the train flag; here the source is a positional argument
        msg = str(e)
        raise DataError("SOURCE " + msg[len("--data: "):] if msg.startswith("--data: ") else msg) from None
    print(f"{args.out}: {header['tokens']['train']:,} train + {header['tokens']['val']:,} val tokens "
          f"({header['dtype']}, vocab {header['vocab_size']}, tokenizer {header['tokenizer']})")
    return 0


def cmd_convert(args) -> int:
    from mamba_parallel.models import MambaLMHeadModel
    from mamba_parallel.models.formats import TOKENIZER_FILES

    _check_model_folder(args.src, "SRC")
    model = MambaLMHeadModel.from_pretrained(args.src, format=args.from_format, progress=None)
    # The tokenizer files of SRC come along (`generate --checkpoint DST` must find the same tokenizer).
    model.save_pretrained(args.dst, format=args.format, max_shard_size=args.max_shard_size, progress=None)
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(args.dst, f))]
    print(f"wrote {args.dst} ({args.format} format{', with ' + ', '.join(copied) if copied else ''})")
    return 0


# Modules of mamba_parallel/bench that are commands (the rest are their shared parts).
BENCH_COMMANDS = ("profile_train", "profile_decode", "report")


def cmd_verify(args) -> int:
    from mamba_parallel.train.verify import verify_path

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    return verify_path(args.path, workers=args.workers)


def bench_names() -> list[str]:
    """The names `mamba-parallel bench NAME` accepts: bench_<NAME>.py and BENCH_COMMANDS."""
    import pkgutil

    import mamba_parallel.bench as pkg

    names = [m.name for m in pkgutil.iter_modules(pkg.__path__)
             if m.name.startswith("bench_") or m.name in BENCH_COMMANDS]
    return sorted(n.removeprefix("bench_") for n in names)


def cmd_bench(args) -> int:
    for module in (f"mamba_parallel.bench.bench_{args.name}", f"mamba_parallel.bench.{args.name}"):
        if args.name not in bench_names():
            break
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        if hasattr(mod, "main"):
            return int(mod.main(args.args) or 0)
    raise ConfigError(f"bench: no benchmark named {args.name!r}; known: {', '.join(bench_names())}")


def cmd_eval(args) -> int:
    from mamba_parallel.evaluate import cmd_eval as run

    _check_model_folder(args.checkpoint, "--checkpoint")
    return run(args)


def cmd_plot(args) -> int:
    from mamba_parallel.plots import cmd_plot as run

    return run(args)


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "eval": cmd_eval, "prepare-data": cmd_prepare,
            "convert": cmd_convert, "plot": cmd_plot, "verify": cmd_verify, "bench": cmd_bench}


def _unknown_flags(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit 2 on unknown arguments with one line naming them and the nearest known flag (no 30-line usage)."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = [o for a in sub._actions for o in a.option_strings]
    hints = [f"{u} -> {m[0]}" for u in unknown if u.startswith("--")
             for m in [difflib.get_close_matches(u.split("=")[0], known, n=1, cutoff=0.75)] if m]
    hint = f" (did you mean: {', '.join(hints)}?)" if hints else ""
    print(f"mamba-parallel {command}: error: unrecognized arguments: {' '.join(unknown)}{hint}; "
          f"see `mamba-parallel {command} --help`", file=sys.stderr)
    raise SystemExit(2)


def _main_rank() -> bool:
    """False on the ranks > 0 of a torchrun launch: they stay quiet, so an error is said once."""
    return os.environ.get("RANK", "0") == "0"


def _say(command: str, kind: str, message) -> None:
    if _main_rank():
        print(f"mamba-parallel {command}: {kind}: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2: bad flags / config / data, 1: the run failed)."""
    import contextlib
    import io
    import warnings

    from mamba_parallel.distributed.parallel_dims import ParallelConfigError
    from mamba_parallel.manifest import ManifestError
    from mamba_parallel.models.formats import CheckpointError
    from mamba_parallel.train.data import DataError
    from mamba_parallel.train.tokenizer import TokenizerError
    from mamba_parallel.train.trainer import TrainingError

    parser = build_parser()
    with contextlib.nullcontext() if _main_rank() else contextlib.redirect_stderr(io.StringIO()):
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _unknown_flags(parser, args.command, unknown)
    # A warning is one line naming the command, as errors are (no source location).
    warnings.formatwarning = lambda msg, *a, **k: f"mamba-parallel {args.command}: warning: {msg}\n"
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError, TokenizerError, ParallelConfigError, CheckpointError, ManifestError) as e:
        _say(args.command, "error", e)
        return 2
    except TrainingError as e:
        _say(args.command, "error", e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: no traceback; a training run keeps its last complete checkpoint
        if _main_rank():
            print(f"mamba-parallel {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
