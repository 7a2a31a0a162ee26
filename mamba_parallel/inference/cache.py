"""The inference cache: one object per generation, holding every layer's recurrent state.

``key_value_memory_dict[layer_idx]`` is what that layer's mixer allocated:
- Mamba / Mamba2: ``(conv_state (B, conv_dim, d_conv - 1), ssm_state)`` with ssm_state (B, d_inner, d_state) for
  Mamba-1 and (B, nheads, headdim, d_state) for Mamba-2, always fp32;
- MHA: ``kv_cache (B, max_seqlen, 2, nheads_kv, head_dim)``.
``seqlen_offset`` counts the tokens already in the cache; the caller advances it after each forward. Setting it
also writes the device tensor ``position`` (when allocated), which a one-token attention step reads instead of the
Python int: a captured CUDA graph then sees the current position at every replay.
"""

from __future__ import annotations

import torch


class InferenceParams:
    """Per-generation cache (mamba_ssm's field names). ``max_batch_size`` rows, ``max_seqlen`` positions."""

    def __init__(self, max_seqlen: int, max_batch_size: int, seqlen_offset: int = 0, batch_size_offset: int = 0,
                 key_value_memory_dict: dict | None = None, lengths_per_sample: torch.Tensor | None = None,
                 position: torch.Tensor | None = None):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.batch_size_offset = batch_size_offset
        self.key_value_memory_dict = {} if key_value_memory_dict is None else key_value_memory_dict
        self.lengths_per_sample = lengths_per_sample
        self.position = position  # 0-dim int64 on the model's device, mirrors seqlen_offset
        self.seqlen_offset = seqlen_offset

    @property
    def seqlen_offset(self) -> int:
        return self._seqlen_offset

    @seqlen_offset.setter
    def seqlen_offset(self, value: int) -> None:
        self._seqlen_offset = int(value)
        if self.position is not None:
            self.position.fill_(self._seqlen_offset)  # a device-side write, no host sync

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new sequence in the same buffers: zero every state and rewind the offset."""
        if max_seqlen > self.max_seqlen or max_batch_size > self.max_batch_size:
            raise ValueError(f"InferenceParams.reset: ({max_seqlen=}, {max_batch_size=}) exceeds the allocated "
                             f"({self.max_seqlen}, {self.max_batch_size})")
        self.max_seqlen, self.max_batch_size = max_seqlen, max_batch_size
        self.seqlen_offset = 0
        for states in self.key_value_memory_dict.values():
            for t in states if isinstance(states, tuple) else (states,):
                t.zero_()
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()

    def states(self, layer_idx: int):
        """The cache entry of layer ``layer_idx`` (raises a clear error when it was never allocated)."""
        if layer_idx not in self.key_value_memory_dict:
            raise KeyError(f"InferenceParams: no cache for layer_idx={layer_idx}; build the cache with "
                           f"model.allocate_inference_cache(...)")
        return self.key_value_memory_dict[layer_idx]

    def position_tensor(self, device: torch.device) -> torch.Tensor:
        """seqlen_offset as a 0-dim int64 tensor on ``device`` (the mirrored ``position`` when allocated)."""
        if self.position is not None and self.position.device == device:
            return self.position
        return torch.full((), self._seqlen_offset, dtype=torch.long, device=device)
