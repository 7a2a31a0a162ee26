"""TrainConfig: every setting of `mamba-parallel train`, one field per flag, with its help text.

Resolution order (later wins): the field defaults below, with ``--resume`` the run's own ``<out>/config.toml``,
a TOML file given by ``--config``, the command-line flags. The resolved config is written to ``<out>/config.toml``. TOML keys are the field names (``batch_size``;
``batch-size`` is accepted too); an optional ``[model]`` table overrides MambaConfig fields of the preset.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from mamba_parallel.config import PRESETS, ConfigError, MambaConfig, get_preset

DEFAULT_PRESET = "small-byte-mamba2"
# What a training step rebuilds in the backward unless told otherwise: the conv output, one more depthwise conv per
# layer (1-2 % of a step) for 8-11 KB per token and layer at the 1.3b - 2.8b sizes, as mamba_ssm's fused
# backward does (docs/memory.md). Compiled blocks keep it (saved-tensor hooks are eager-only); "none" keeps it.
DEFAULT_RECOMPUTE = "conv"


def _f(default, help: str, *, choices=None, flag_type=None, metavar=None):
    return field(default=default, metadata={"help": help, "choices": choices, "flag_type": flag_type,
                                            "metavar": metavar})


@dataclass
class TrainConfig:
    # ---- model ---------------------------------------------------------------------------------------------------
    preset: str = _f(DEFAULT_PRESET, "model preset (see mamba_parallel/config.py PRESETS)", choices=list(PRESETS))
    model: dict = field(default_factory=dict, metadata={"help": "TOML [model] table: MambaConfig overrides"})
    # ---- data ----------------------------------------------------------------------------------------------------
    data: str | None = _f(None, "token folder from `prepare-data`, or raw text: a file, a directory, .jsonl or "
                                ".parquet (tokenized into <out>/data first). Default: the Python standard "
                                "library's own .py sources", flag_type=str)
    tokenizer: str | None = _f(None, "HF tokenizers tokenizer.json (file or folder); default: bytes", flag_type=str)
    val_fraction: float = _f(0.005, "share of the raw data held out for evaluation when preparing it")
    allow_binary: bool = _f(False, "tokenize raw data files that are not valid UTF-8 text anyway (bad bytes "
                                   "become U+FFFD); by default such a file is refused, naming it")
    doc_boundaries: bool = _f(True, "keep documents apart: each sequence carries where its documents start "
                                    "(seq_idx), so no state flows from one document into the next and no token "
                                    "is scored against the next document's first token")
    # ---- batch and schedule --------------------------------------------------------------------------------------
    steps: int = _f(600, "optimizer steps in total (a resumed run continues up to this count)")
    batch_size: int | str = _f(8, "sequences per rank per micro-step, or auto: the largest that fits (a short "
                                  "measured probe on a GPU, the memory model of --parallel auto on CPU; printed and "
                                  "stored in <out>/config.toml)", flag_type=lambda v: _int_or_auto(v, "batch-size"))
    grad_accum: int = _f(1, "micro-steps per optimizer step (global batch = batch_size x dp ranks x grad_accum)")
    global_batch_size: int = _f(0, "sequences per optimizer step over all ranks (0: batch_size x dp x grad_accum): "
                                   "reached by gradient accumulation at any world size, so a resume on another "
                                   "number of GPUs keeps it; must be a multiple of batch_size x dp")
    seq_len: int = _f(256, "tokens per training sequence")
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.1, "the cosine schedule ends at lr x min_lr_ratio")
    warmup: int = _f(30, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (never applied to norms, biases, A_log, D, dt_bias)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    seed: int = _f(0, "seed of the weight init and of the data order")
    # ---- hardware and parallelism --------------------------------------------------------------------------------
    device: str | None = _f(None, "cpu or cuda (default: cuda when available)", choices=["cpu", "cuda"],
                            flag_type=str)
    dtype: str = _f("fp32", "fp32, or bf16 = bf16 autocast over fp32 master weights", choices=["fp32", "bf16"])
    dp_mode: str = _f("fsdp", "data parallel: fsdp (FSDP2 fully_shard: weights, gradients and AdamW state sharded) "
                              "or ddp (whole replicas: a little faster within one node when the model and its AdamW "
                              "state fit on each GPU)", choices=["fsdp", "ddp"])
    dp_replicate: int = _f(1, "with --dp-mode fsdp: replicas of the FSDP group (HSDP: shard within a node, "
                              "replicate across nodes)")
    tp: int = _f(1, "tensor parallel degree (ranks of one tp group share a batch)")
    cp: int = _f(1, "context parallel degree (each cp rank gets a contiguous slice of every sequence)")
    tp_overlap: bool = _f(False, "with --tp > 1: each mixer / MLP gathers its sequence-parallel input in ring steps "
                                 "behind per-shard matmuls of its first projection instead of before it (opt-in)")
    pp: int = _f(1, "pipeline parallel degree: the layers split into stages over pp ranks (outermost mesh dim; "
                    "composes with --tp, --cp and data parallel; docs/pipeline.md)")
    pp_schedule: str = _f("1f1b", "pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved-1f1b "
                                  "(several stages per rank), interleaved-zb or zbv (zero bubble)",
                          choices=["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv"])
    pp_stages_per_rank: int = _f(0, "stages per pipeline rank for the interleaved schedules (0: the schedule's "
                                    "default, 1 or 2)")
    pp_split: str = _f("balanced", "layers per stage: balanced (by parameter count) or a comma list, e.g. 30,34")
    microbatches: int = _f(0, "micro-batches per optimizer step (each --batch-size sequences per rank); with --pp "
                              "the pipeline's micro-batches (0: grad_accum, at least pp), otherwise the same as "
                              "--grad-accum")
    parallel: str = _f("manual", "auto: choose tp/cp (then pp, CPU offload) from the model and GPU memory, print "
                                 "the plan and why, refuse one that will not fit; manual: use --tp/--cp/--pp",
                       choices=["auto", "manual"])
    cpu_offload: bool = _f(False, "FSDP2 CPU offload: parameters, gradients and AdamW state in host memory, each "
                                  "block copied to the GPU for its compute (one big model on few GPUs; also on one "
                                  "GPU)")
    param_dtype: str = _f("fp32", "dtype the weights and gradients are stored in: bf16 halves them (AdamW moments "
                                  "stay fp32, updates rounded stochastically into the bf16 weights)",
                          choices=["fp32", "bf16"])
    activation_checkpointing: bool = _f(False, "recompute each block's activations in the backward pass")
    recompute: str = _f(DEFAULT_RECOMPUTE, "comma list of activations each layer rebuilds in the backward instead "
                            "of keeping them (less memory for one more cheap kernel per layer; docs/memory.md): "
                            "conv = the conv output, dt = Mamba's dt_proj output, gate = out_proj's input (where "
                            "out_proj does not already run fused with the norm / gate, which keeps none), states = "
                            "the SSD's chunk states (Mamba2), fewer selective-scan checkpoints (Mamba); none = keep "
                            "everything. Eager only: under --compile only states applies",
                        metavar="ITEMS")
    compile: bool = _f(False, "torch.compile each block")
    deterministic: bool = _f(False, "bitwise-repeatable steps: torch's deterministic algorithms and one fixed "
                                    "kernel configuration (no autotuning); a little slower")
    dist_timeout: int = _f(1800, "seconds a collective may wait for the other ranks before the run fails "
                                 "(the process group's timeout)")
    cuda_graph: bool = _f(False, "capture the whole training step (forward + backward of every micro-batch, "
                                 "clipping, fused AdamW) in one CUDA graph and replay it: no per-kernel host "
                                 "launch cost; one GPU or --tp only (not data / context parallel)")
    fsdp_param_dtype: str = _f("fp32", "FSDP2 compute dtype of the gathered weights (bf16 halves all-gather "
                                       "traffic; master weights and gradient reduction stay fp32)",
                               choices=["fp32", "bf16"])
    reshard_after_forward: bool = _f(True, "FSDP2: free gathered block weights after forward (off: keep them "
                                           "until backward, more memory, fewer all-gathers)")
    fsdp_blocks_per_unit: int = _f(1, "FSDP2: shard this many consecutive blocks as one unit (fewer, larger "
                                      "all-gathers and less host time per step; more memory)")
    ddp_bucket_mb: float | None = _f(None, "DDP gradient bucket size in MB (default: torch's 25)", flag_type=float)
    ddp_bf16_grads: bool = _f(False, "DDP: all-reduce gradients in bf16 (half the traffic)")
    # ---- output, checkpoints, monitoring -------------------------------------------------------------------------
    out: str = _f("runs/default", "output folder: metrics.jsonl, config.toml, checkpoints/, final/")
    resume: bool = _f(False, "continue from the newest complete checkpoint in --out")
    log_every: int = _f(10, "log metrics every N steps")
    eval_every: int = _f(200, "evaluate on the held-out split every N steps (0 = only at the end)")
    eval_batches: int = _f(8, "batches per evaluation (each of batch_size sequences per rank)")
    save_every: int = _f(200, "checkpoint every N steps (0 = only at the end and on SIGTERM)")
    save_final: bool = _f(True, "at the end, the last step's checkpoint and final/ (--no-save-final: a throughput "
                                "or smoke run of a big model that should write nothing)")
    keep: int = _f(2, "keep the newest N complete checkpoints")
    sample_tokens: int = _f(200, "tokens to generate as a sample when training ends (0 = none)")
    sample_prompt: str = _f("def ", "prompt of the closing sample")
    progress: bool = _f(True, "show a progress bar on rank 0 when the output is a terminal")

    # ---- derived -------------------------------------------------------------------------------------------------
    def model_config(self) -> MambaConfig:
        """The preset with the [model] overrides applied; a table (``ssm_cfg.d_state = 32``) updates the preset's
        table instead of replacing it (which would silently drop the preset's mixer settings)."""
        preset = PRESETS.get(self.preset, {})
        merged = {k: {**preset[k], **v} if isinstance(v, dict) and isinstance(preset.get(k), dict) else v
                  for k, v in self.model.items()}
        try:
            return get_preset(self.preset, **merged)
        except ConfigError as e:
            msg = str(e)
            raise ConfigError("[model] " + msg.removeprefix("MambaConfig.") if msg.startswith("MambaConfig.")
                              else msg) from None

    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')}: {why}")

        if self.preset not in PRESETS:
            raise ConfigError(f"--preset: unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        need(self.batch_size == "auto" or (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool)),
             "batch_size", f"must be an integer >= 1 or auto, got {self.batch_size!r}")
        for name in ("steps", "grad_accum", "seq_len", "tp", "cp", "pp", "dp_replicate", "keep",
                     "eval_batches", "fsdp_blocks_per_unit") + (("batch_size",) if self.batch_size != "auto" else ()):
            need(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "log_every", "eval_every", "save_every", "sample_tokens", "global_batch_size",
                     "microbatches", "pp_stages_per_rank"):
            need(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        need(self.log_every >= 1, "log_every", "must be >= 1")
        need(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be a positive number, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must lie in [0, 1], got {self.min_lr_ratio}")
        need(0 <= self.val_fraction < 1, "val_fraction", f"must lie in [0, 1), got {self.val_fraction}")
        need(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        for name in ("beta1", "beta2"):
            need(0 <= getattr(self, name) < 1, name, f"must lie in [0, 1), got {getattr(self, name)}")
        need(self.weight_decay >= 0 and math.isfinite(self.weight_decay), "weight_decay",
             f"must be >= 0, got {self.weight_decay}")
        need(self.dist_timeout >= 1, "dist_timeout", f"must be >= 1 second, got {self.dist_timeout}")
        from mamba_parallel.input_checks import check_prompt

        check_prompt(self.sample_prompt, "--sample-prompt")
        for f in fields(self):
            ch = f.metadata.get("choices")
            v = getattr(self, f.name)
            if ch and v is not None and v not in ch:
                need(False, f.name, f"must be one of {ch}, got {v!r}")
        if self.recompute:
            from mamba_parallel.layers.recompute import RECOMPUTE_ITEMS, parse_items  # lazy: imports torch, layers

            unknown = parse_items(self.recompute)[1]
            need(not unknown, "recompute", f"unknown item(s) {', '.join(unknown)} in {self.recompute!r}; expected a "
                                           f"comma list of {', '.join(RECOMPUTE_ITEMS)}, or none")
        need(self.seq_len % self.cp == 0, "seq_len", f"{self.seq_len} is not divisible by --cp {self.cp}")
        if self.cuda_graph:  # the rest of the layout (data parallel ranks) is known at launch: trainer.py
            need(self.device != "cpu", "cuda_graph", "needs a CUDA device, got --device cpu")
            need(self.cp == 1, "cuda_graph", f"does not support context parallelism (--cp {self.cp})")
        self.model_config()  # raises ConfigError naming the bad [model] field

    def to_toml(self) -> str:
        """The resolved config as TOML (None values are left out, as TOML has no null)."""
        lines, model = [], None
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "model":
                model = v
            elif v is not None:
                lines.append(f"{f.name} = {_toml_value(v)}")
        if model:
            lines.append("\n[model]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in model.items()]
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {v!r} ({type(v).__name__}) to TOML")


def _int_or_auto(value: str, flag: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--{flag} must be an integer or auto, got {value!r}") from None


# Settings of the machine a run happens to be on, not of the run: `--resume` does not take them from the run's
# config.toml (a checkpoint resumes at any layout).
MACHINE_FIELDS = frozenset({"device", "dp_mode", "dp_replicate", "tp", "cp", "tp_overlap", "pp", "pp_schedule",
                            "pp_stages_per_rank", "pp_split", "microbatches", "cpu_offload", "parallel",
                            "activation_checkpointing",
                            "recompute", "compile", "cuda_graph", "fsdp_param_dtype", "reshard_after_forward",
                            "fsdp_blocks_per_unit", "ddp_bucket_mb", "ddp_bf16_grads", "progress", "resume",
                            "deterministic", "dist_timeout"})


# ---- flags and TOML --------------------------------------------------------------------------------------------
def _flag_type(f) -> Any:
    t = f.metadata.get("flag_type")
    if t is not None:
        return t
    return type(f.default) if f.default is not MISSING else str


# `train --help` shows the flags in the sections of TrainConfig, each starting at this field.
FLAG_SECTIONS = {"preset": "model", "data": "data", "steps": "batch and schedule",
                 "device": "hardware and parallelism", "out": "output, checkpoints, monitoring"}


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (``--batch-size`` for batch_size), every default None = "not given"."""
    p.add_argument("--config", metavar="FILE", help="TOML file with the same fields; flags override it")
    group = p
    for f in fields(TrainConfig):
        if f.name in FLAG_SECTIONS:
            group = p.add_argument_group(FLAG_SECTIONS[f.name])
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_text = f.metadata["help"] + (f" (default: {default})" if default not in (None, "") else "")
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, type=_flag_type(f), default=None, help=help_text,
                           choices=f.metadata.get("choices"),
                           metavar=None if f.metadata.get("choices")
                           else f.metadata.get("metavar") or f.name.upper())


def load_toml(path: str) -> dict:
    """Read a train config TOML into a dict of TrainConfig fields; unknown keys -> ConfigError naming the file."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: invalid TOML: {e}") from None
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"--config {path}: unknown key {key!r}; known keys: {', '.join(known)}")
        if name == "model" and not isinstance(value, dict):
            raise ConfigError(f"--config {path}: 'model' must be a table of MambaConfig fields")
        out[name] = value
    return out


def resolve_config(args: argparse.Namespace | None = None, toml_path: str | None = None,
                   **overrides: Any) -> TrainConfig:
    """Defaults <- TOML file <- parsed flags <- keyword overrides; validated."""
    values: dict[str, Any] = {}
    path = toml_path or (getattr(args, "config", None) if args is not None else None)
    if path:
        values.update(load_toml(path))
    if args is not None:
        for f in fields(TrainConfig):
            v = getattr(args, f.name, None)
            if v is not None:
                values[f.name] = v
    known = {f.name for f in fields(TrainConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ConfigError(f"unknown train setting(s) {bad}; known: {sorted(known)}")
    values.update(overrides)
    saved = os.path.join(values.get("out", TrainConfig.out), "config.toml")
    if values.get("resume") and os.path.isfile(saved):
        # `train --out DIR --resume` continues the run as it was configured (DIR/config.toml, written at its
        # start): model, data, schedule. The machine's settings (device, parallel layout, speed options) come from
        # the defaults / flags of now, as a checkpoint loads at any layout. --config and flags still win.
        run = {k: v for k, v in load_toml(saved).items() if k not in MACHINE_FIELDS}
        values = {**run, **values}
    try:
        cfg = TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(f"train config: {e}") from None
    for f in fields(TrainConfig):  # TOML gives ints where floats are meant, and may give wrong types
        v = getattr(cfg, f.name)
        want = _flag_type(f)
        if v is None or f.name == "model" or not isinstance(want, type):  # a parser (int or auto): validate()
            continue
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            setattr(cfg, f.name, float(v))
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{f.name}: expected {want.__name__}, got {v!r}")
    cfg.validate()
    return cfg
