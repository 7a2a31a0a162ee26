"""``mamba-parallel generate``: text from a model folder (or hub name), with the API's defaults: greedy unless
``--do-sample``; the checkpoint's generation_config.json fills what the flags leave unset. Streams to a terminal.
``--tp N`` under ``torchrun --nproc_per_node N``: every rank holds 1/N of the weights (a model larger than one
GPU), all ranks decode together and rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys

from mamba_parallel.config import ConfigError


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a saved model folder",
                       description="Load a model folder (mamba_ssm, HF or Mistral layout, e.g. <out>/final; or a "
                                   "hub name) and continue a prompt. Greedy by default, as model.generate.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="model folder (config.json + weights)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text to continue; '-' (or leaving it out with a pipe on stdin) reads stdin")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default: 100)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--do-sample", action="store_true", help="sample (default: greedy, as the API)")
    mode.add_argument("--greedy", action="store_true",
                      help="greedy even when the checkpoint's generation_config.json says to sample")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest, 0 = all (default: 50)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus threshold (default: 1.0 = off)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the likeliest (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="CTRL's penalty (default: 1.0 = off)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the continuation contains TEXT (repeatable); the stop text is not printed")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they come (default: on when stdout is a terminal)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weight dtype (default: auto = as saved)")
    p.add_argument("--cuda-graph", action="store_true", help="replay a captured decode step (CUDA, Mamba layers)")
    p.add_argument("--state-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="recurrent SSM states (default: fp32; bf16 halves the bytes a large batch's step moves)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json (default: the one in --checkpoint, else bytes)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel over N processes, each holding 1/N of the weights; run under "
                        "torchrun --nproc_per_node N (default: 1)")


def _prompt(args) -> str:
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if args.prompt is None and sys.stdin.isatty():
        raise ConfigError("give --prompt TEXT, or pipe the prompt on stdin (--prompt -)")
    text = sys.stdin.read()
    if not text:
        raise ConfigError("--prompt -: stdin was empty")
    return text


def _load_tensor_parallel(args, device, dtype):
    """The model built on the meta device, sharded over the torchrun group (tp = world size) and materialised on
    this rank's device, then filled from the checkpoint tensor by tensor, each rank reading off the file only its
    own slices: neither host memory nor any GPU ever holds the whole model.
    -> (model, whether this is rank 0, whether this call made the process group)."""
    import torch.distributed as dist

    from mamba_parallel.distributed.data_parallel import init_distributed

    if args.cuda_graph:
        raise ConfigError("--cuda-graph does not capture tensor-parallel decoding (its collectives): leave it out "
                          "with --tp")
    created = not dist.is_initialized()
    env = init_distributed(device.type)  # torchrun's group (none when run alone)
    world = env.world_size
    if args.tp != world:
        raise ConfigError(f"--tp {args.tp} needs as many processes: run under torchrun --nproc_per_node "
                          f"{args.tp} (WORLD_SIZE is {world})")
    try:
        return _load_shards(args, dtype, env, world), env.is_main, created
    except BaseException:
        if created:  # a bad checkpoint: the error is said and the group this call made is left cleanly
            dist.destroy_process_group()
        raise


def _load_shards(args, dtype, env, world):
    """This rank's tensor-parallel model (``_load_tensor_parallel``), in the group ``env`` joined."""
    import torch.distributed as dist

    from mamba_parallel.distributed.materialize import load_sharded_checkpoint, retie_after_to_empty, tied_groups
    from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims
    from mamba_parallel.distributed.tp_plan import apply_tensor_parallel
    from mamba_parallel.models import MambaLMHeadModel
    from mamba_parallel.models.formats import open_checkpoint

    # shapes and dtypes only; a legacy torch file (read whole, on every rank) is refused
    ckpt = open_checkpoint(args.checkpoint, lazy_only=True)
    model = MambaLMHeadModel(ckpt.config, device="meta", dtype=ckpt.dtype(dtype))
    dims = ParallelDims(dp_shard=1, tp=args.tp, world_size=world)
    dims.build_mesh(env.device.type)
    try:
        apply_tensor_parallel(model, dims.submesh("tp"), sequence_parallel=False)
    except ParallelConfigError as e:
        raise ConfigError(f"--tp {args.tp}: {e}") from None
    groups = tied_groups(model)
    model.to_empty(device=env.device)
    retie_after_to_empty(groups)
    load_sharded_checkpoint(model, ckpt)  # each rank reads its own slices
    ckpt.attach_metadata(model)
    dist.barrier()
    return model.eval()


def cmd_generate(args) -> int:
    import torch

    from mamba_parallel.models import MambaLMHeadModel

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompt = _prompt(args)
    dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.tp > 1:
        model, is_main, created = _load_tensor_parallel(args, device, dtype)
        try:
            return _generate(args, model, device, prompt, is_main)
        finally:
            if created:
                torch.distributed.destroy_process_group()
    model = MambaLMHeadModel.from_pretrained(args.checkpoint, device=device, dtype=dtype).eval()
    return _generate(args, model, device, prompt, True)


def _generate(args, model, device, prompt: str, is_main: bool) -> int:
    import torch

    from mamba_parallel.inference.text_streamer import TextStreamer
    from mamba_parallel.input_checks import check_vocab_fits, warn_unencodable
    from mamba_parallel.train.tokenizer import tokenizer_for_checkpoint

    folder = str(model.tokenizer_folder or args.checkpoint)
    tokenizer = tokenizer_for_checkpoint(folder, args.tokenizer)
    check_vocab_fits(tokenizer.vocab_size, model.config.padded_vocab_size,
                     "--tokenizer" if args.tokenizer else f"the tokenizer of {args.checkpoint}")
    if is_main:  # said once under --tp
        warn_unencodable(tokenizer, prompt)
    if (is_main and tokenizer.vocab_size < model.config.vocab_size and not args.tokenizer
            and tokenizer.spec == "byte"):
        print(f"mamba-parallel generate: note: no tokenizer.json in {args.checkpoint!r}: using bytes for a model "
              f"of vocab {model.config.vocab_size}; pass --tokenizer if it was trained with another", file=sys.stderr)
    ids = tokenizer.encode(prompt) or [tokenizer.eos_token_id or 0]
    stream = (sys.stdout.isatty() if args.stream is None else args.stream) and is_main
    eos = set(model.generation_config.eos_ids()) | ({tokenizer.eos_token_id} - {None})
    streamer = TextStreamer(tokenizer, stop_strings=tuple(args.stop), skip_ids=eos) if stream else None
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    options = {k: v for k, v in options.items() if v is not None}
    if args.do_sample or args.greedy:
        options["do_sample"] = bool(args.do_sample)
    if model.generation_config.eos_token_id is None and tokenizer.eos_token_id is not None:
        options["eos_token_id"] = tokenizer.eos_token_id
    if args.stop:
        options.update(stop_strings=list(args.stop), tokenizer=tokenizer)
    generator = torch.Generator(device).manual_seed(args.seed)
    if streamer is not None:
        print(prompt, end="", flush=True)
    out = model.generate(torch.tensor([ids], device=device), streamer=streamer, generator=generator,
                         cuda_graph=args.cuda_graph, state_dtype=args.state_dtype, **options)
    if streamer is None and is_main:
        new = out[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))  # the eos token is not text
        text = tokenizer.decode(new[:cut])
        for s in args.stop:
            at = text.find(s)
            text = text if at < 0 else text[:at]
        print(prompt + text)
    return 0
