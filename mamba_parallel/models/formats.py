"""Checkpoint folders in the layouts people already have: mamba_ssm's, HF transformers', Mistral's.

``mamba_ssm``: ``config.json`` with mamba_ssm's MambaConfig fields + ``pytorch_model.bin`` (or
``model.safetensors``); state-dict names are ours (docs/API.md), ``lm_head.weight`` may be present when tied.
``hf``: ``config.json`` of a transformers class (MambaForCausalLM, Mamba2ForCausalLM, FalconMambaForCausalLM,
BambaForCausalLM, NemotronHForCausalLM: models/hf_config.py) + ``model.safetensors`` (or ``pytorch_model.bin``,
or shards with an ``*.index.json``); names per architecture, a tied ``lm_head.weight`` omitted.
``mistral``: Mamba-Codestral's ``params.json`` + ``consolidated.safetensors`` (models/mistral_format.py).

The format of a folder is detected: config.json with ``model_type`` / ``architectures`` -> HF, with mamba_ssm's
fields (``d_model``, ``n_layer``) -> mamba_ssm; no config.json but params.json -> mistral (a folder holding both,
as Mamba-Codestral's repository does, reads config.json unless ``format="mistral"``). Loading builds the model on
the meta device and assigns the checkpoint's tensors, read one by one, so the weights exist once, on ``device`` in
``dtype`` ("auto": the dtype they were saved in), never initialised. A ``org/name`` that is not a folder is fetched
from the Hugging Face hub when huggingface_hub is installed (models/hub.py). ``open_checkpoint`` is the reading
alone (names, pieces, casts, a tied head), whole tensors or boxes of them: the sharded loader of ``generate --tp``
(distributed/materialize.py) reads each rank's slices through it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from mamba_parallel.config import MambaConfig
from mamba_parallel.inference.generation_config import FILE as GENERATION_FILE
from mamba_parallel.inference.generation_config import GenerationConfig
from mamba_parallel.manifest import ManifestError, verify_before_load, write_manifest
from mamba_parallel.models import mistral_format
from mamba_parallel.models.hf_config import HFConfigError, config_from_hf, hf_arch_for, hf_arch_of, hf_config_from
from mamba_parallel.models.hf_config import supported_hf_types
from mamba_parallel.models.hub import HubError, download, looks_like_hub_name
from mamba_parallel.models.ssm_config import SsmConfigError, config_from_mamba_ssm, mamba_ssm_config_json
from mamba_parallel.models.tensor_layout import (
    EMBEDDING,
    IDENTITY,
    LM_HEAD,
    LayoutError,
    TensorLayout,
    plan_load,
    split_for_save,
)
from mamba_parallel.progress import progress_bar
from mamba_parallel.models.weights_io import (
    MISTRAL_WEIGHTS,
    SAFETENSORS,
    TORCH_BIN,
    WEIGHT_FILES,
    WeightReader,
    WeightsFileError,
    find_weights,
    folder_listing,
    parse_size,
    weight_files_in,
    write_sharded,
    write_text,
    write_weights,
)

FORMATS = ("mamba_ssm", "hf", "mistral")
# Tokenizer files carried over beside the weights (save_pretrained, convert).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "tokenizer.model.v3", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
DEFAULT_MAX_SHARD_SIZE = "5GB"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded / saved as asked; the message says what differs and where."""


# ---- detection ------------------------------------------------------------------------------------------------
def _read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(raw).__name__}, not an object")
    return raw


def read_config_json(folder: Path) -> dict:
    file = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a checkpoint is a folder with config.json and weights)")
    if not file.is_file():
        raise CheckpointError(f"{folder}: no config.json; the folder holds: {folder_listing(folder)}")
    return _read_json(file)


def _detect(folder: Path, format: str | None = None) -> tuple[str, dict]:
    """(format, parsed config.json or params.json) of ``folder``."""
    if format is not None and format not in FORMATS:
        raise CheckpointError(f"format={format!r} is not one of {FORMATS}")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a checkpoint is a folder with config.json and weights)")
    params = folder / mistral_format.PARAMS
    if format == "mistral" or (format is None and not (folder / "config.json").is_file() and params.is_file()):
        if not params.is_file():
            raise CheckpointError(f"{folder}: format='mistral' needs {mistral_format.PARAMS}; the folder holds: "
                                  f"{folder_listing(folder)}")
        return "mistral", _read_json(params)
    raw = read_config_json(folder)
    fmt = format
    if fmt is None:
        if "model_type" in raw or "architectures" in raw:
            fmt = "hf"
        elif "d_model" in raw and "n_layer" in raw:
            fmt = "mamba_ssm"
        else:
            raise CheckpointError(
                f"{folder / 'config.json'}: neither an HF transformers config (no model_type / architectures) nor "
                f"a mamba_ssm config (needs d_model and n_layer); found keys: {sorted(raw)}")
    if fmt == "hf" and hf_arch_of(raw) is None:
        raise CheckpointError(
            f"{folder / 'config.json'}: an HF transformers config of model_type={raw.get('model_type')!r}, "
            f"architectures={raw.get('architectures')!r}; supported are {supported_hf_types()}")
    return fmt, raw


def detect_format(path: str | Path) -> str:
    """"hf", "mamba_ssm" or "mistral" for the checkpoint folder ``path``; CheckpointError when it is none."""
    return _detect(Path(path))[0]


def _config(folder: Path, fmt: str, raw: dict) -> MambaConfig:
    try:
        if fmt == "hf":
            return config_from_hf(raw, str(folder / "config.json"))
        if fmt == "mistral":
            return mistral_format.config_from_params(raw, str(folder / mistral_format.PARAMS))
        return config_from_mamba_ssm(raw, str(folder / "config.json"))
    except (HFConfigError, SsmConfigError, mistral_format.MistralConfigError) as e:
        raise CheckpointError(str(e)) from e


def load_config(path: str | Path, format: str | None = None) -> tuple[MambaConfig, str]:
    """(MambaConfig, format) of the checkpoint folder ``path``."""
    folder = Path(path)
    fmt, raw = _detect(folder, format)
    return _config(folder, fmt, raw), fmt


def _layout(fmt: str, config: MambaConfig, raw: dict | None = None) -> TensorLayout:
    if fmt == "mamba_ssm":
        return IDENTITY
    if fmt == "mistral":
        return mistral_format.LAYOUT
    arch = hf_arch_of(raw) if raw is not None else hf_arch_for(config)
    return TensorLayout(lambda ours: arch.tensor_names(config, ours), base=arch.base,
                        alternatives=(*arch.file_prefixes, ""), ignored=arch.ignored, stores_tied_head=arch.unties,
                        describe=arch.architecture)


# ---- loading --------------------------------------------------------------------------------------------------
def _describe(config: MambaConfig) -> str:
    m = config.mixer_cfg
    extra = f", headdim={m['headdim']}, ngroups={m['ngroups']}" if config.layer in ("Mamba2", "Mamba3") else ""
    kinds = ""
    if config.attn_layer_idx or config.mlp_layer_idx:
        kinds = f", attention layers {config.attn_layer_idx}, MLP layers {config.mlp_layer_idx}"
    return (f"{config.layer}, d_model={config.d_model}, n_layer={config.n_layer}, "
            f"vocab={config.padded_vocab_size}, d_state={m['d_state']}, expand={m['expand']}{extra}{kinds}")


def _dtype_from(value, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise CheckpointError(f"{what}={value!r} is not a floating torch dtype (e.g. torch.bfloat16 or 'auto')")
    return dt


def resolve_dtype(dtype, raw: dict, reader: WeightReader) -> torch.dtype:
    """"auto" (or None): the dtype the checkpoint was saved in (its config's dtype / torch_dtype, else the dtype of
    most of its weights), as transformers' dtype="auto"; otherwise ``dtype`` itself."""
    if dtype is not None and dtype != "auto":
        return _dtype_from(dtype, "dtype")
    for key in ("dtype", "torch_dtype"):
        name = raw.get(key)
        if isinstance(name, str):
            dt = getattr(torch, name.removeprefix("torch."), None)
            if isinstance(dt, torch.dtype) and dt.is_floating_point:
                return dt
    return reader.floating_dtype() or torch.get_default_dtype()


def resolve_folder(path: str | Path, format: str | None = None, revision: str | None = None) -> Path:
    """A local checkpoint folder, or the hub snapshot of ``org/name`` (models/hub.py)."""
    folder = Path(path)
    if folder.is_dir() or not looks_like_hub_name(str(path)):
        return folder
    try:
        return download(str(path), revision=revision, format=format)
    except HubError as e:
        raise CheckpointError(str(e)) from e


class Checkpoint:
    """A checkpoint folder opened for reading (``open_checkpoint``): its config, and its tensors by OUR names, read
    whole or one box at a time. The one place a format's conversion lives (names, the pieces a fused tensor is
    stored as, dtype casts, a tied head): ``load_pretrained`` and the sharded loader
    (``distributed.materialize.load_sharded_checkpoint``) both read through it."""

    def __init__(self, folder: Path, fmt: str, raw: dict, config: MambaConfig, reader: WeightReader):
        self.folder, self.format, self.raw, self.config, self.reader = folder, fmt, raw, config, reader
        self.layout = _layout(fmt, config, raw if fmt == "hf" else None)
        self.tied = bool(config.tie_embeddings)
        self.sources: dict[str, list[tuple[str, int | None]]] | None = None  # by plan()
        self._shapes: dict[str, tuple[int, ...]] = {}

    @property
    def path(self) -> Path:
        """The weights file (or shard index): what errors name."""
        return self.reader.path

    def dtype(self, dtype="auto") -> torch.dtype:
        return resolve_dtype(dtype, self.raw, self.reader)

    def plan(self, expected: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[str, int | None]]]:
        """Match the model's tensors (our name -> shape) with the file's: CheckpointError naming the file and every
        missing, unexpected and mis-shaped tensor (both shapes); then ``read`` knows where each one is."""
        what = f"{'params.json' if self.format == 'mistral' else 'config.json'} ({_describe(self.config)})"
        try:
            self.sources = plan_load(self.layout, expected, self.reader.shapes, self.tied, str(self.path),
                                     what).sources
        except LayoutError as e:
            raise CheckpointError(str(e)) from e
        self._shapes = dict(expected)
        return self.sources

    def read(self, name: str, device: torch.device, dtype: torch.dtype | None,
             index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Our tensor ``name`` (``plan`` first), or only the box ``index`` of it (one slice per dim, steps of 1),
        on ``device``, floating values cast to ``dtype``. A tensor stored in pieces (concatenated along dim 0) reads
        only the pieces the box's rows fall in."""
        pieces = self.sources[name]
        if len(pieces) == 1:
            return self.reader.read(pieces[0][0], device, dtype, index)
        if index is None:
            return torch.cat([self.reader.read(n, device, dtype) for n, _ in pieces], dim=0)
        start, stop, _ = index[0].indices(self._shapes[name][0])
        parts, at = [], 0
        for file_name, rows in pieces:
            lo, hi = max(start, at), min(stop, at + rows)
            if lo < hi:
                parts.append(self.reader.read(file_name, device, dtype, (slice(lo - at, hi - at), *index[1:])))
            at += rows
        if not parts:  # an empty box
            parts = [self.reader.read(pieces[0][0], device, dtype, (slice(0, 0), *index[1:]))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def check_tied_head(self, index: tuple[slice, ...] | None = None, embedding: torch.Tensor | None = None) -> None:
        """A stored head must equal the embedding it is tied to (mamba_ssm stores both, sharing one storage);
        ``index``: compare only that box (each rank its own, so together they compare all); ``embedding``: that
        box of the embedding as already read (in the file's dtype), not read again."""
        if not (self.tied and LM_HEAD in self.sources):
            return
        head_name, emb_name = self.sources[LM_HEAD][0][0], self.sources[EMBEDDING][0][0]
        if self.reader.same_storage(head_name, emb_name):
            return
        cpu = torch.device("cpu")
        if embedding is None:
            embedding = self.reader.read(emb_name, cpu, None, index)
        if not torch.equal(self.reader.read(head_name, cpu, None, index), embedding.to(cpu)):
            raise CheckpointError(f"{self.path}: the config ties the embeddings but {head_name} differs from "
                                  f"{emb_name}")

    def attach_metadata(self, model: nn.Module) -> None:
        """``model.generation_config`` (generation_config.json, else config.json's token ids) and
        ``model.tokenizer_folder`` (this folder when it holds tokenizer files)."""
        try:
            model.generation_config = GenerationConfig.from_folder(self.folder, self.raw if self.format == "hf" else {})
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        model.tokenizer_folder = self.folder if any((self.folder / f).is_file() for f in TOKENIZER_FILES) else None


def open_checkpoint(path: str | Path, format: str | None = None, revision: str | None = None,
                    lazy_only: bool = False, verify: bool = True) -> Checkpoint:
    """A checkpoint folder (or hub name) opened: its manifest verified (``verify``), format detected, config read,
    weights indexed (shapes and dtypes only; no tensor data is read). ``lazy_only``: refuse weights that can only
    be read whole (a legacy torch file)."""
    folder = resolve_folder(path, format, revision)
    if verify and folder.is_dir():  # its manifest (ours) is checked before anything is read; a folder from
        try:                        # elsewhere has none
            verify_before_load(str(folder))
        except ManifestError as e:
            raise CheckpointError(str(e)) from None
    fmt, raw = _detect(folder, format)
    config = _config(folder, fmt, raw)
    try:
        reader = WeightReader(find_weights(folder, (MISTRAL_WEIGHTS,) if fmt == "mistral" else WEIGHT_FILES),
                              lazy_only=lazy_only)
    except WeightsFileError as e:
        raise CheckpointError(str(e)) from e
    return Checkpoint(folder, fmt, raw, config, reader)


def load_pretrained(path: str | Path, device: torch.device | str | None = None, dtype="auto",
                    model_cls: type | None = None, format: str | None = None, revision: str | None = None,
                    torch_dtype=None, progress: bool | None = False) -> nn.Module:
    """A ``MambaLMHeadModel`` (or ``model_cls``) from a mamba_ssm / HF / Mistral checkpoint folder or hub name.

    device: where the weights go (default CPU). dtype: "auto" (default: as saved, like transformers' dtype="auto"),
    or a torch dtype every parameter gets (``torch_dtype``: transformers 4's name for it). format: force one layout
    when a folder holds several (Mamba-Codestral's has HF and Mistral files). revision: of a hub name.
    progress: a bar over the tensors read (None: when stderr is a terminal).
    The model's ``generation_config`` comes from generation_config.json (else config.json's token ids); a folder
    with tokenizer files is remembered as ``model.tokenizer_folder`` (save_pretrained copies them).
    """
    dtype = _one_dtype(dtype, torch_dtype)
    ckpt = open_checkpoint(path, format, revision)
    if model_cls is None:
        from mamba_parallel.models.lm import MambaLMHeadModel as model_cls
    device = torch.device("cpu" if device is None else device)
    model = model_cls(ckpt.config, device="meta", dtype=ckpt.dtype(dtype))  # no memory, no init
    sources = ckpt.plan({n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()})

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    tied = ckpt.tied
    ckpt.check_tied_head()
    state = {}
    with progress_bar(f"loading {ckpt.folder.name}", total=len(sources), enabled=progress) as advance:
        for name in sources:
            advance()
            if tied and name == LM_HEAD:
                continue
            like = params.get(name, buffers.get(name))
            state[name] = ckpt.read(name, device, like.dtype if like.is_floating_point() else None)
    model.load_state_dict(state, strict=False, assign=True)
    del state
    if tied:
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        else:
            model.lm_head.weight = model.backbone.embedding.weight
    # assign=True replaces the Parameter objects: keep the attributes the model set on them (_no_weight_decay...).
    for name, p in model.named_parameters(remove_duplicate=False):
        old = params[name]
        if p is not old:
            for key, value in old.__dict__.items():
                p.__dict__.setdefault(key, value)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"{ckpt.path}: these tensors were not loaded (still on the meta device): {left}")
    ckpt.attach_metadata(model)
    return model.eval()  # as transformers returns it (no layer here behaves differently in training mode)


def _one_dtype(dtype, torch_dtype):
    if torch_dtype is None:
        return dtype
    if dtype not in (None, "auto"):
        raise CheckpointError("pass dtype or torch_dtype (the same option), not both")
    return torch_dtype


# ---- saving ---------------------------------------------------------------------------------------------------
def _full_cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict on CPU, contiguous, sharded (DTensor) entries gathered."""
    out = {}
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().to("cpu").contiguous()
    # Keep the tie visible to torch.save (one storage) after the copies above.
    if LM_HEAD in out and EMBEDDING in out and _shares(model, LM_HEAD, EMBEDDING):
        out[LM_HEAD] = out[EMBEDDING]
    return out


def _shares(model: nn.Module, a: str, b: str) -> bool:
    sd = model.state_dict(keep_vars=True)
    return sd[a] is sd[b]


def _config_text(model: nn.Module, format: str) -> tuple[str, str]:
    """(file name, text) of the format's config file."""
    config: MambaConfig = model.config
    try:
        if format == "hf":
            raw = hf_config_from(config, _dtype_name(model))
            gen = getattr(model, "generation_config", None) or GenerationConfig()
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if getattr(gen, key) is not None:
                    raw[key] = getattr(gen, key)
            return "config.json", json.dumps(raw, indent=2)
        if format == "mistral":
            return mistral_format.PARAMS, json.dumps(mistral_format.params_from_config(config), indent=2)
        return "config.json", mamba_ssm_config_json(config)
    except (HFConfigError, mistral_format.MistralConfigError) as e:
        raise CheckpointError(str(e)) from e


def _copy_tokenizer(tokenizer, source: Path | None, folder: Path) -> list[str]:
    """Write the tokenizer beside the weights: ``tokenizer`` (a folder / tokenizer file, or an object with
    save_pretrained / save), else the files of ``source`` (the folder the model was loaded from)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        saver = getattr(tokenizer, "save_pretrained", None) or getattr(tokenizer, "save", None)
        if saver is None:
            raise CheckpointError(f"tokenizer: a {type(tokenizer).__name__} has no save_pretrained / save")
        saver(str(folder))
        return [f for f in TOKENIZER_FILES if (folder / f).is_file()]
    if tokenizer is not None:
        src = Path(tokenizer)
        if src.is_file():
            shutil.copyfile(src, folder / src.name)
            return [src.name]
        if not src.is_dir():
            raise CheckpointError(f"tokenizer={str(tokenizer)!r}: no such file or folder")
        source = src
    if source is None or source.resolve() == folder.resolve():
        return []
    copied = [f for f in TOKENIZER_FILES if (source / f).is_file()]
    for f in copied:
        shutil.copyfile(source / f, folder / f)
    return copied


def save_pretrained(model: nn.Module, path: str | Path, format: str = "mamba_ssm",
                    safe_serialization: bool | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                    tokenizer=None, progress: bool | None = False) -> Path:
    """Write ``model`` (with a ``.config`` MambaConfig) to the folder ``path``; returns the weights file (the
    shard index when sharded).

    format "mamba_ssm": config.json + pytorch_model.bin (model.safetensors with safe_serialization=True).
    format "hf": the transformers class's config.json + model.safetensors (pytorch_model.bin with
    safe_serialization=False); a model no transformers class here can hold raises CheckpointError saying why.
    format "mistral": params.json + consolidated.safetensors (Mamba-Codestral's layout; Mamba-2 only).
    Weights past ``max_shard_size`` (default 5GB, as transformers) are sharded with an index (mamba_ssm / hf);
    generation_config.json holds the model's generation defaults; the tokenizer files (``tokenizer``, else those of
    the folder the model was loaded from) are copied beside. Weights of another kind already in the folder are an
    error (the loader could pick the wrong ones). Under torch.distributed every rank must call this (sharded
    tensors are gathered); rank 0 writes. progress: a bar over the weight files written (None: on a terminal).
    """
    if format not in FORMATS:
        raise CheckpointError(f"format={format!r} is not one of {FORMATS}")
    if format == "mistral" and safe_serialization is False:
        raise CheckpointError("format='mistral' stores safetensors only (consolidated.safetensors)")
    if safe_serialization is None:
        safe_serialization = format != "mamba_ssm"
    config: MambaConfig = model.config
    config_name, config_text = _config_text(model, format)
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: exists and is not a folder")
    single = MISTRAL_WEIGHTS if format == "mistral" else (SAFETENSORS if safe_serialization else TORCH_BIN)
    existing = weight_files_in(folder) + ([MISTRAL_WEIGHTS] if (folder / MISTRAL_WEIGHTS).is_file() else [])
    others = [n for n in existing if n != single]
    if others:
        raise CheckpointError(f"{folder}: already holds {', '.join(others)}; writing {single} beside it would make "
                              "the folder ambiguous. Remove it or save to another folder.")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise CheckpointError(str(e)) from e

    state = _full_cpu_state(model)
    tied = LM_HEAD in state and EMBEDDING in state and state[LM_HEAD] is state[EMBEDDING]
    layout = _layout(format, config)
    if tied and format == "mamba_ssm" and safe_serialization:
        del state[LM_HEAD]  # safetensors cannot hold shared tensors; the loader re-ties
    if tied and (format == "mistral" or (format == "hf" and layout.stores_tied_head)):
        state[LM_HEAD] = state[EMBEDDING].clone()  # the reader does not tie: store the head, as its own tensor
    file_state = split_for_save(layout, state, tied)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return folder / single
    folder.mkdir(parents=True, exist_ok=True)
    if format == "mistral":
        write_weights(file_state, folder / MISTRAL_WEIGHTS)
        files = [folder / MISTRAL_WEIGHTS]
    else:
        with progress_bar(f"writing {folder.name}", enabled=progress, unit="files") as advance:
            files = write_sharded(file_state, folder, safe_serialization, max_bytes, on_file=advance)
    write_text(config_text, folder / config_name)
    written = [f.name for f in files] + [config_name]
    gen = getattr(model, "generation_config", None) or GenerationConfig()
    if format == "hf" or gen != GenerationConfig():  # transformers always writes one; the others when it says something
        write_text(gen.to_json(), folder / GENERATION_FILE)
        written.append(GENERATION_FILE)
    written += _copy_tokenizer(tokenizer, getattr(model, "tokenizer_folder", None), folder)
    write_manifest(str(folder), written, writer="save_pretrained")  # last: a folder with a manifest is whole
    return files[0]


def _dtype_name(model: nn.Module) -> str | None:
    for p in model.parameters():
        return str(p.dtype).removeprefix("torch.")
    return None
