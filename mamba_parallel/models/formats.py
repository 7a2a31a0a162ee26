"""Checkpoint folders in the layouts people already have: mamba_ssm's and HF transformers'.

``mamba_ssm``: ``config.json`` with mamba_ssm's MambaConfig fields + ``pytorch_model.bin`` (or
``model.safetensors``); state-dict names are ours (docs/API.md), ``lm_head.weight`` may be present when tied.
``hf``: ``config.json`` of transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` + ``model.safetensors`` (or
``pytorch_model.bin``, or sharded ``*.index.json``); the names differ from ours only in
``backbone.embeddings.weight``, the tied ``lm_head.weight`` is omitted.

The format of a folder is detected from its config.json: ``model_type`` / ``architectures`` -> HF, mamba_ssm's
fields (``d_model``, ``n_layer``) -> mamba_ssm. Loading builds the model on the meta device and assigns the
checkpoint's tensors, read one by one, so the weights exist once, on ``device`` in ``dtype``, never initialised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mamba_parallel.config import MambaConfig
from mamba_parallel.models.hf_config import (
    HFConfigError,
    config_from_hf,
    hf_config_from,
    hf_model_type,
)
from mamba_parallel.models.ssm_config import SsmConfigError, config_from_mamba_ssm, mamba_ssm_config_json
from mamba_parallel.models.weights_io import (
    SAFETENSORS,
    TORCH_BIN,
    WEIGHT_FILES,
    WeightReader,
    WeightsFileError,
    find_weights,
    folder_listing,
    write_text,
    write_weights,
)

FORMATS = ("mamba_ssm", "hf")
EMBEDDING = "backbone.embedding.weight"
LM_HEAD = "lm_head.weight"
_HF_EMBEDDING = "backbone.embeddings.weight"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded / saved as asked; the message says what differs and where."""


# ---- detection ------------------------------------------------------------------------------------------------
def read_config_json(folder: Path) -> dict:
    file = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a checkpoint is a folder with config.json and weights)")
    if not file.is_file():
        raise CheckpointError(f"{folder}: no config.json; the folder holds: {folder_listing(folder)}")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(raw).__name__}, not an object")
    return raw


def detect_format(path: str | Path) -> str:
    """"hf" or "mamba_ssm" for the checkpoint folder ``path``; CheckpointError when it is neither."""
    return _detect(Path(path), read_config_json(Path(path)))


def _detect(folder: Path, raw: dict) -> str:
    if "model_type" in raw or "architectures" in raw:
        if hf_model_type(raw) is None:
            raise CheckpointError(
                f"{folder / 'config.json'}: an HF transformers config of model_type={raw.get('model_type')!r}, "
                f"architectures={raw.get('architectures')!r}; supported are model_type 'mamba' "
                "(MambaForCausalLM) and 'mamba2' (Mamba2ForCausalLM)")
        return "hf"
    if "d_model" in raw and "n_layer" in raw:
        return "mamba_ssm"
    raise CheckpointError(
        f"{folder / 'config.json'}: neither an HF transformers Mamba config (no model_type / architectures) nor a "
        f"mamba_ssm config (needs d_model and n_layer); found keys: {sorted(raw)}")


# ---- names ----------------------------------------------------------------------------------------------------
def hf_name(name: str) -> str:
    """Our (mamba_ssm's) state-dict name -> transformers' name."""
    return _HF_EMBEDDING if name == EMBEDDING else name


def name_from_hf(name: str) -> str:
    """transformers' state-dict name -> ours; backbone-only models (MambaModel) have no "backbone." prefix."""
    if not name.startswith("backbone.") and name != LM_HEAD:
        name = "backbone." + name
    return EMBEDDING if name == _HF_EMBEDDING else name


# ---- loading --------------------------------------------------------------------------------------------------
def _describe(config: MambaConfig) -> str:
    m = config.mixer_cfg
    extra = f", headdim={m['headdim']}, ngroups={m['ngroups']}" if config.layer == "Mamba2" else ""
    return (f"{config.layer}, d_model={config.d_model}, n_layer={config.n_layer}, "
            f"vocab={config.padded_vocab_size}, d_state={m['d_state']}, expand={m['expand']}{extra}")


def _check_names_and_shapes(expected: dict, found: dict, to_file_name, weights: Path, config: MambaConfig,
                            tied: bool) -> None:
    """One CheckpointError listing every missing, unexpected and mis-shaped tensor (names as in the file)."""
    optional = {LM_HEAD} if tied else set()  # a tied head may or may not be stored (mamba_ssm: yes, HF: no)
    missing = [n for n in expected if n not in found and n not in optional]
    unexpected = [n for n in found if n not in expected and n not in optional]
    mismatched = [(n, expected[n], found[n]) for n in expected if n in found and found[n] != expected[n]]
    if not (missing or unexpected or mismatched):
        return
    lines = [f"{weights}: the weights do not match config.json ({_describe(config)})"]
    if mismatched:
        lines.append(f"  shape mismatch ({len(mismatched)}):")
        lines += [f"    {to_file_name(n)}: expected {tuple(e)}, found {tuple(f)}" for n, e, f in mismatched]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(to_file_name(n) for n in missing))
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(to_file_name(n) for n in unexpected))
    raise CheckpointError("\n".join(lines))


def _check_tied_head(reader: WeightReader, head: str, embedding: str) -> None:
    """A stored head must equal the embedding it is tied to (mamba_ssm stores both, sharing one storage)."""
    if reader.same_storage(head, embedding):
        return
    cpu = torch.device("cpu")
    if not torch.equal(reader.read(head, cpu, None), reader.read(embedding, cpu, None)):
        raise CheckpointError(f"{reader.path}: config.json ties the embeddings but {head} differs from {embedding}")


def load_config(path: str | Path) -> tuple[MambaConfig, str]:
    """(MambaConfig, format) of the checkpoint folder ``path``."""
    folder = Path(path)
    raw = read_config_json(folder)
    fmt = _detect(folder, raw)
    try:
        config = (config_from_hf if fmt == "hf" else config_from_mamba_ssm)(raw, str(folder / "config.json"))
    except (HFConfigError, SsmConfigError) as e:
        raise CheckpointError(str(e)) from e
    return config, fmt


def load_pretrained(path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    model_cls: type | None = None) -> nn.Module:
    """A ``MambaLMHeadModel`` (or ``model_cls``) from a mamba_ssm or HF checkpoint folder (format auto-detected).

    device: where the weights go (default CPU). dtype: the parameters' dtype as ``model_cls(config, dtype=dtype)``
    would create them (default: torch's default dtype, as mamba_ssm does), whatever the file stores.
    """
    folder = Path(path)
    config, fmt = load_config(folder)
    try:
        reader = WeightReader(find_weights(folder))
    except WeightsFileError as e:
        raise CheckpointError(str(e)) from e
    if model_cls is None:
        from mamba_parallel.models.lm import MambaLMHeadModel as model_cls
    device = torch.device("cpu" if device is None else device)
    model = model_cls(config, device="meta", dtype=dtype)  # shapes and dtypes only; no memory, no init

    # Our name -> the name in the file.
    if fmt == "hf":
        file_names = {name_from_hf(n): n for n in reader.shapes}
        to_file_name = hf_name
    else:
        file_names = {n: n for n in reader.shapes}
        to_file_name = str
    expected = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    found = {n: reader.shapes[f] for n, f in file_names.items()}
    tied = bool(config.tie_embeddings)
    _check_names_and_shapes(expected, found, to_file_name, reader.path, config, tied)

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    if tied and LM_HEAD in file_names:
        _check_tied_head(reader, file_names[LM_HEAD], file_names[EMBEDDING])
    state = {}
    for name in expected:
        if name in file_names and not (tied and name == LM_HEAD):
            like = params.get(name, buffers.get(name))
            state[name] = reader.read(file_names[name], device, like.dtype if like.is_floating_point() else None)
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
        raise CheckpointError(f"{reader.path}: these tensors were not loaded (still on the meta device): {left}")
    return model


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


def save_pretrained(model: nn.Module, path: str | Path, format: str = "mamba_ssm",
                    safe_serialization: bool | None = None) -> Path:
    """Write ``model`` (with a ``.config`` MambaConfig) to the folder ``path``; returns the weights file.

    format "mamba_ssm": config.json + pytorch_model.bin (model.safetensors with safe_serialization=True).
    format "hf": transformers' config.json + model.safetensors (pytorch_model.bin with safe_serialization=False);
    a model transformers cannot express (hybrid, MLP, ...) raises CheckpointError saying why.
    A weights file of the other kind already in the folder is an error (the loader would pick the wrong one).
    Under torch.distributed every rank must call this (sharded tensors are gathered); rank 0 writes.
    """
    if format not in FORMATS:
        raise CheckpointError(f"format={format!r} is not one of {FORMATS}")
    config: MambaConfig = model.config
    if safe_serialization is None:
        safe_serialization = format == "hf"
    folder = Path(path)
    weights = folder / (SAFETENSORS if safe_serialization else TORCH_BIN)
    if format == "hf":
        try:
            config_json = json.dumps(hf_config_from(config, _dtype_name(model)), indent=2)
        except HFConfigError as e:
            raise CheckpointError(str(e)) from e
    else:
        config_json = mamba_ssm_config_json(config)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: exists and is not a folder")
    others = [n for n in WEIGHT_FILES if n != weights.name and (folder / n).exists()]
    if others:
        raise CheckpointError(f"{folder}: already holds {', '.join(others)}; writing {weights.name} beside it "
                              "would make the folder ambiguous. Remove it or save to another folder.")

    state = _full_cpu_state(model)
    tied = LM_HEAD in state and EMBEDDING in state and state[LM_HEAD] is state[EMBEDDING]
    if tied and (format == "hf" or safe_serialization):
        del state[LM_HEAD]  # HF omits the tied head; safetensors cannot hold shared tensors
    if format == "hf":
        state = {hf_name(n): t for n, t in state.items()}
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return weights
    folder.mkdir(parents=True, exist_ok=True)
    write_weights(state, weights)
    write_text(config_json, folder / "config.json")
    return weights


def _dtype_name(model: nn.Module) -> str | None:
    for p in model.parameters():
        return str(p.dtype).removeprefix("torch.")
    return None
