"""AdamW for weights stored in bf16 (``--param-dtype bf16``): moments and the update in fp32, the new weight
written back with stochastic rounding.

Weights and gradients in bf16 take 4 bytes per parameter instead of 8, AdamW's two fp32 moments 8: 12 bytes in
all instead of 16 (a 7B model: 84 GB instead of 112, what lets it train on one GPU with its states in host memory).
Rounding the fp32 result to the nearest bf16 would drop every update smaller than half a bf16 step (2^-9 relative):
stochastic rounding keeps them in expectation (Gupta et al., 2015; Zamirai et al., 2020), so the loss follows the
fp32 run's. State keys and shapes are torch AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``; DTensors under FSDP2),
so checkpoints load either way round.
"""

from __future__ import annotations

import math
import warnings

import torch

# Host-resident weights (FSDP2 CPU offload) are updated in slices of this many elements: the fp32 temporaries of a
# slice stay small (16 MiB each) however large the tensor, and one update pass runs over each.
CPU_SLICE = 1 << 22
NOISE_POOL = 1 << 24  # random 16-bit values drawn once for the host rounding (64 MiB); slices read windows of it


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_(target: torch.Tensor, value: torch.Tensor) -> None:
    """target (bf16) <- value (fp32, same shape) rounded up or down at random, in proportion to the distance: add
    16 random low bits to the fp32 pattern, keep its high 16 bits (the bf16 value, rounded toward zero)."""
    bits = torch.randint_like(value, 0, 1 << 16, dtype=torch.int32)
    _round_with(target, value.clone(), bits)


def _round_with(target: torch.Tensor, scratch: torch.Tensor, noise: torch.Tensor) -> None:
    """The rounding of ``stochastic_round_`` with the given low bits; ``scratch`` (fp32, the value) is overwritten."""
    bits = scratch.view(torch.int32)
    bits.add_(noise).bitwise_and_(-65536)
    target.copy_(scratch)


def _mix64(*xs: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the noise window offsets, reproducible across processes."""
    h = 0
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


class _HostNoise:
    """Random low bits for the stochastic rounding of host tensors, without a generator pass per update: torch's
    CPU generator fills a tensor on one thread (5-8 ns an element, 40-60 s for a 7B model: the whole host step).
    A pool of ``size`` uniform values is drawn once (from torch's generator: reproducible under manual_seed); each
    slice reads a window of it at an offset hashed from (run seed, step, parameter, slice). A weight's bits are then
    uniform and independent of its value, which is what keeps the rounding unbiased, they change from step to step,
    and the weights of one slice get distinct draws."""

    def __init__(self, size: int = NOISE_POOL, span: int = CPU_SLICE):
        self.seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
        self.size, self.span = size, span
        self.pool = torch.randint(0, 1 << 16, (size + span,), dtype=torch.int32)

    def window(self, n: int, step: int, index: int, offset: int) -> torch.Tensor:
        if n > self.span:
            raise ValueError(f"a noise window of {n} elements is longer than the pool's span {self.span}")
        lo = _mix64(self.seed, step, index, offset) % self.size
        return self.pool[lo:lo + n]


def _host_slice_update(w, g, m, v, noise, lr, b1, b2, eps, wd, bc1, bc2_sqrt):
    """One slice of a host-resident bf16 weight: torch AdamW's formulas in fp32, the rounding of ``_round_with``.
    Compiled (one vectorised pass over the slice that reads and writes each state once: half the memory traffic of
    the fused op between copies); the scalars are 0-d tensors, so a new learning rate does not recompile."""
    gf = g.float()
    m.lerp_(gf, 1 - b1)
    v.mul_(b2).addcmul_(gf, gf, value=1 - b2)
    new = w.float() * (1 - lr * wd) - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)
    bits = (new.view(torch.int32) + noise) & -65536
    w.copy_(bits.view(torch.float32))


_COMPILED: dict[str, object] = {}


def _compiled_host_update():
    """The compiled ``_host_slice_update`` (torch.compile's C++ backend: it needs a C++ compiler), or None when it
    cannot be built here; then a warning says so once and the uncompiled path runs (the same update, slower)."""
    if "fn" not in _COMPILED:
        fn = torch.compile(_host_slice_update, dynamic=True, fullgraph=True)
        try:
            w, g = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
            fn(w, g, torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.int32),
               *(torch.tensor(x) for x in (0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 1.0)))
        except Exception as exc:  # no C++ compiler, or a torch build without inductor
            warnings.warn(f"bf16 AdamW: the host update runs uncompiled (about half its speed): torch.compile "
                          f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            fn = None
        _COMPILED["fn"] = fn
    return _COMPILED["fn"]


class AdamWFp32State(torch.optim.AdamW):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction) with fp32 moments for bf16 (or fp32)
    weights; fp32 weights get torch AdamW's result up to rounding. Options amsgrad / maximize / capturable /
    differentiable / fused are not supported. ``compile_host``: update host-resident bf16 weights (CPU offload)
    with a compiled kernel (needs a C++ compiler; without one, a warning and the uncompiled path)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, compile_host=True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._noise: _HostNoise | None = None  # made at the first host-resident bf16 update
        self._compile_host = compile_host

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        base = 0  # a parameter's position over all groups is part of its rounding noise's seed
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            lr = float(lr)
            for index, p in enumerate(group["params"], start=base):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                w, g = _local(p), _local(p.grad)
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                if w.device.type == "cpu" and all(x.is_contiguous() for x in (w, g, m, v)):
                    self._host_update(w, g, m, v, state["step"], lr, b1, b2, eps, wd, index)
                    continue
                g = g.float()
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                new = w.float()
                new.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                new.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                if w.dtype == torch.bfloat16:
                    _round_with(w, new, torch.randint_like(new, 0, 1 << 16, dtype=torch.int32))
                else:
                    w.copy_(new)
            base += len(group["params"])
        return loss

    def _host_update(self, w, g, m, v, step, lr, b1, b2, eps, wd, index):
        """The same update on host memory, slice by slice, rounded back to bf16 with pooled noise: one compiled pass
        per slice, or (uncompiled, and for fp32 weights) torch's fused AdamW over an fp32 copy of the slice."""
        w, g, m, v = w.view(-1), g.view(-1), m.view(-1), v.view(-1)
        n = w.numel()
        size = min(n, CPU_SLICE)
        new = torch.empty(size, dtype=torch.float32) if w.dtype != torch.float32 else None
        grad = torch.empty(size, dtype=torch.float32) if g.dtype != torch.float32 else None
        rounded = w.dtype == torch.bfloat16
        if rounded and (self._noise is None or self._noise.span < size):
            self._noise = _HostNoise(span=max(size, CPU_SLICE))
        fn = _compiled_host_update() if rounded and self._compile_host else None
        if fn is not None:
            t = float(step)
            scalars = [torch.tensor(x, dtype=torch.float32) for x in
                       (lr, b1, b2, eps, wd, 1 - b1 ** t, math.sqrt(1 - b2 ** t))]
            for lo in range(0, n, size):
                k = min(size, n - lo)
                fn(w[lo:lo + k], g[lo:lo + k], m[lo:lo + k], v[lo:lo + k],
                   self._noise.window(k, int(step), index, lo), *scalars)
            return
        for lo in range(0, n, size):
            k = min(size, n - lo)
            ws, gs = w[lo:lo + k], g[lo:lo + k]
            nw = ws if new is None else new[:k].copy_(ws)
            ng = gs if grad is None else grad[:k].copy_(gs)
            torch._fused_adamw_([nw], [ng], [m[lo:lo + k]], [v[lo:lo + k]], [], [step], lr=lr, beta1=b1, beta2=b2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            if rounded:
                _round_with(ws, nw, self._noise.window(k, int(step), index, lo))
            elif new is not None:
                ws.copy_(nw)
