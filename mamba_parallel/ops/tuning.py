"""Launch configurations shared by the autotuned kernels (SSD, Mamba-3): a few candidates on the GPU, one small
config in the CPU interpreter (small blocks there also exercise the multi-block loops on tiny test shapes).
Inside ``ops.use_autotune(False)`` the first GPU candidate that fits the device runs untuned: fast compiles for
tests, and one fixed summation order for ``--deterministic``.

A candidate fits when its compiled kernel needs no more shared memory than the device gives one program (227 KiB
on an H100 / H200, 163 KiB on an A100, 99 KiB on most consumer GPUs): the others are dropped before tuning, so a
table written for one GPU does not fail on a smaller one. Shared memory is known exactly only after compiling
(the software pipeline's buffers and the layout conversions depend on the dtype, the tile sizes and num_stages),
so the check compiles the candidate: a compile tuning or the launch would pay anyway.
"""

from __future__ import annotations

import functools

import torch
import triton

from mamba_parallel.ops.backend import autotune_enabled, interpret_mode


def config(num_warps: int = 4, num_stages: int = 2, **blocks) -> triton.Config:
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


def describe(c: triton.Config) -> str:
    blocks = ", ".join(f"{k}={v}" for k, v in c.kwargs.items())
    return f"({blocks}, num_warps={c.num_warps}, num_stages={c.num_stages})"


def fitting(configs, shared_of, limit: int, first_only: bool = False) -> list:
    """The candidates whose ``shared_of(config)`` bytes are at most ``limit``, in order (only the first one with
    ``first_only``: later ones are then not compiled). None fits: an error naming every candidate's need."""
    out, needs = [], []
    for c in configs:
        need = shared_of(c)
        needs.append(need)
        if need <= limit:
            out.append(c)
            if first_only:
                break
    if not out:
        listed = "; ".join(f"{describe(c)}: {n} bytes" for c, n in zip(configs, needs))
        raise triton.runtime.errors.OutOfResources(min(needs), limit, f"shared memory (no launch candidate fits: "
                                                                      f"{listed})")
    return out


@functools.lru_cache(maxsize=None)
def device_shared_limit(device: int) -> int:
    """Shared memory one program may use on CUDA device ``device`` (what Triton checks at launch), in bytes."""
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(device)["max_shared_mem"])


def _jit(kernel):
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


def _shared_of(kernel, nargs: dict, kwargs: dict):
    """config -> shared bytes of ``kernel`` compiled for these arguments with that config (compiled, not run)."""
    jit = _jit(kernel)

    def need(c: triton.Config) -> int:
        compiled = jit.warmup(**nargs, **kwargs, **c.all_kwargs(), grid=(1,))
        return int(compiled.metadata.shared)
    return need


def _current_limit() -> int:
    from triton.runtime import driver

    return device_shared_limit(driver.active.get_current_device())


def _fit_pruner(kernel):
    """The autotuner's early pruning: the candidates that fit the current device."""
    def prune(configs, nargs, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}  # the autotuner's launch options
        return fitting(configs, _shared_of(kernel, nargs, kwargs), _current_limit())
    return prune


class _FirstFit:
    """An untuned launch: the first candidate that fits the device, chosen once per autotune key (and dtypes)."""

    def __init__(self, kernel, configs, keys):
        self.kernel, self.configs, self.keys = kernel, configs, keys
        self.arg_names = _jit(kernel).arg_names
        self.cache: dict = {}

    def chosen(self, args, kwargs) -> triton.Config:
        nargs = dict(zip(self.arg_names, args))
        every = {**nargs, **kwargs}
        key = tuple(every.get(k) for k in self.keys) + tuple(str(v.dtype) for v in every.values()
                                                            if hasattr(v, "dtype"))
        c = self.cache.get(key)
        if c is None:
            c = self.configs[0] if len(self.configs) == 1 else fitting(
                self.configs, _shared_of(self.kernel, nargs, kwargs), _current_limit(), first_only=True)[0]
            self.cache[key] = c
        return c

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.kernel[grid](*args, **kwargs, **self.chosen(args, kwargs).all_kwargs())
        return launch


class Tuner:
    """``tuner(kernel, name, dtype)``: the kernel wrapped in its autotuner, from ``table[name]`` = (GPU candidates,
    interpreter config, autotune key[, GPU candidates for 4-byte operands]); ``dtype``: the kernel's operand
    dtype, which picks the fp32 candidates when a table gives them (fp32 tiles are twice the bytes of bf16's).
    ``restore[name]``: arguments a launch of that kernel may read after writing (e.g. a buffer that is both its
    input and its output), put back after each of the tuner's trial runs. One wrapper per (kernel, name,
    candidates, interpreter, autotune) kept."""

    def __init__(self, table: dict, restore: dict | None = None):
        self.table = table
        self.restore = restore or {}
        self._cache: dict = {}

    def candidates(self, name: str, dtype: torch.dtype | None = None) -> list:
        entry = self.table[name]
        wide = dtype is not None and dtype.itemsize >= 4 and len(entry) > 3
        return entry[3] if wide else entry[0]

    def launches(self, name: str, dtype: torch.dtype | None = None) -> list:
        """Every config a launch of ``name`` may run with here: the interpreter's, else the GPU candidates (for
        sizing buffers with a slot per program of any of them)."""
        return [self.table[name][1]] if interpret_mode() else self.candidates(name, dtype)

    def __call__(self, kernel, name: str, dtype: torch.dtype | None = None):
        autotune = autotune_enabled()
        gpu = self.candidates(name, dtype)
        key = (id(kernel), name, id(gpu), interpret_mode(), autotune)
        fn = self._cache.get(key)
        if fn is None:
            _, interp, keys = self.table[name][:3]
            if interpret_mode():
                fn = triton.autotune(configs=[interp], key=keys)(kernel)
            elif autotune:
                fn = triton.autotune(configs=gpu, key=keys, restore_value=self.restore.get(name),
                                     prune_configs_by={"early_config_prune": _fit_pruner(kernel)})(kernel)
            else:
                fn = _FirstFit(kernel, gpu, keys)
            self._cache[key] = fn
        return fn


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision dots (Triton would use tf32 otherwise); half types use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_pow2(n: int, least: int = 16) -> int:
    """A power-of-two block covering ``n`` whole (tl.dot needs every block dim >= 16)."""
    return max(least, triton.next_power_of_2(n))
