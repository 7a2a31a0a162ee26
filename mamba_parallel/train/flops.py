"""Training FLOPs per token and model FLOP utilisation (MFU).

FLOPs per trained token (forward + backward = 3 x forward):

    6 * N_matmul  +  3 * sum over layers of the mixer's sequence term (forward FLOPs per token)

- ``N_matmul``: every parameter that multiplies activations, i.e. all parameters, the tied embedding counted once
  (as the lm_head matmul; the lookup itself is free), an untied input embedding left out.
- Mamba-2 (SSD, chunk size Q, heads H, head dim P, state N, groups G), per token, forward:
  ``2*Q*G*N`` (C·Bᵀ inside a chunk) + ``2*Q*H*P`` (applying it to x) + ``2*H*P*N`` (chunk states)
  + ``2*H*P*N`` (states to outputs); the chunk-to-chunk state passing is negligible.
- Mamba-1 (selective scan, d_inner D, state N): ``9*D*N`` per token, forward (the Mamba paper's count).
- Attention (heads h, head dim d, sequence L): ``4*L*h*d`` per token forward (QKᵀ and AV, causal mask not
  discounted, as in the PaLM MFU formula).

MFU = achieved FLOP/s / (peak FLOP/s per device x devices). Peaks are dense tensor-core figures by device name and
dtype; on CPU (or an unknown GPU) MFU is reported as null rather than against a guessed peak.
"""

from __future__ import annotations

import torch

from mamba_parallel.config import MambaConfig

# Dense peak FLOP/s per GPU: (bf16, fp32). fp32 uses the TF32 tensor-core rate torch enables by default for
# matmuls when allowed; we count plain fp32 (non-TF32) to stay conservative.
PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "H800": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "A800": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (125e12, 31.2e12),
    "RTX 4090": (165e12, 82.6e12),
}


def matmul_params(model: torch.nn.Module, config: MambaConfig) -> int:
    """Parameters that take part in a matmul per token (see the module docstring)."""
    seen, n = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += p.numel()
    if not config.tie_embeddings:
        n -= config.padded_vocab_size * config.d_model
    return n


def sequence_flops_per_token(config: MambaConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the scans / attention (the part 6·N does not count), summed over layers."""
    c = config.mixer_cfg
    if config.layer == "Mamba2":
        q = min(c["chunk_size"], seq_len)
        h, p, n, g = config.nheads, c["headdim"], c["d_state"], c["ngroups"]
        mixer = 2 * q * g * n + 2 * q * h * p + 4 * h * p * n
    elif config.layer == "Mamba3":  # B.C per head (each head turns B / C by its own phase), R ranks per token
        q = min(c["chunk_size"], seq_len)
        h, p, n = config.nheads, c["headdim"], c["d_state"]
        R = c["mimo_rank"] if c["is_mimo"] else 1
        mixer = 2 * q * R * R * h * (n + p) + 4 * R * h * p * n
    else:
        mixer = 9 * config.d_inner * c["d_state"]
    total = 0.0
    for i in range(config.n_layer):
        kind = config.layer_kind(i)
        if kind == "attention":
            a = config.attn_params
            total += 4 * seq_len * a["num_heads"] * a["head_dim"]
        elif kind != "mlp":  # an MLP block has no sequence op
            total += mixer
    return total


def train_flops_per_token(model: torch.nn.Module, config: MambaConfig, seq_len: int) -> float:
    return 6.0 * matmul_params(model, config) + 3.0 * sequence_flops_per_token(config, seq_len)


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device for this dtype ("bf16" / "fp32"); None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, fp32) in PEAK_FLOPS.items():
        if key in name:
            return bf16 if dtype == "bf16" else fp32
    return None
