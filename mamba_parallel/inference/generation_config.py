"""A model's generation defaults (``model.generation_config``), read from and written to ``generation_config.json``
as transformers does: special token ids and, when a checkpoint ships them, sampling defaults.

``generate`` resolves each option as: its own argument, else a ``generation_config=`` argument, else
``model.generation_config``, else the built-in default (greedy; transformers' 50 / 1.0 for top_k / top_p when
sampling without them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FILE = "generation_config.json"


@dataclass
class GenerationConfig:
    """None = not set (the next level of defaults applies). eos_token_id: one id or a list (any of them ends a
    row)."""

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_any(cls, obj) -> "GenerationConfig":
        """Ours, a dict, or any object with these attribute names (transformers' GenerationConfig)."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
        return cls(**{f.name: get(f.name, None) for f in fields(cls)})

    @classmethod
    def from_folder(cls, folder: Path, config_json: dict | None = None) -> "GenerationConfig":
        """generation_config.json of ``folder`` when present, else the special token ids of its config.json."""
        file = folder / FILE
        if file.is_file():
            try:
                raw = json.loads(file.read_text())
            except ValueError as e:
                raise ValueError(f"{file}: not valid JSON ({e})") from e
            return cls.from_any(raw if isinstance(raw, dict) else {})
        raw = config_json or {}
        return cls(**{k: raw.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})

    def to_json(self) -> str:
        """The fields that are set, as transformers writes them (``_from_model_config`` when only token ids)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if set(out) <= {"bos_token_id", "eos_token_id", "pad_token_id"}:
            out = {"_from_model_config": True, **out}
        return json.dumps(out, indent=2)

    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
