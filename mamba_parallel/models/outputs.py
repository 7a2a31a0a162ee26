"""``CausalLMOutput``: what a language model's forward returns (``.loss``, ``.logits``), as mamba_ssm and HF do.

Read it the way either library's users already do: ``out.logits`` / ``out.loss`` (attributes, mamba_ssm and HF),
``out["loss"]`` and ``out[0]`` / ``out.to_tuple()`` (HF's ``ModelOutput``: indices skip the fields that are None,
so ``out[0]`` is the loss when one was computed, else the logits, as in both). It is a registered pytree node, so
FSDP / DDP hooks and ``torch.compile`` see the tensors inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree


@dataclass
class CausalLMOutput:
    """loss: () fp32 mean cross-entropy, or None when no labels / targets were given.
    logits: (batch, seqlen or num_last_tokens, padded_vocab) in the hidden dtype, or None when only the loss was
    asked for (the chunked loss never forms them; pass ``return_logits=True`` to get both)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def to_tuple(self) -> tuple:
        """The fields that are not None, in order (HF's ``ModelOutput.to_tuple``)."""
        return tuple(v for v in (getattr(self, f.name) for f in fields(self)) if v is not None)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(f"CausalLMOutput has no {key!r}; it holds {self.keys()}")
            return getattr(self, key)
        return self.to_tuple()[key]

    def __iter__(self):
        return iter(self.to_tuple())

    def __len__(self) -> int:
        return len(self.to_tuple())


pytree.register_dataclass(CausalLMOutput)
