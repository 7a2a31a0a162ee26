"""Gradient arena: a ``split`` whose backward does not concatenate its pieces' gradients.

``t.split(sizes, dim)``'s backward allocates t's gradient and copies every piece's gradient into it. Here the
ops consuming the pieces may instead write their input gradient straight into the right slice of one buffer
(the arena, t's shape), found through ``grad_slot(piece)``; the split's backward then checks that each arriving
gradient IS its slice (same memory, shape and strides) and returns the arena as t's gradient without copying.
Anything else (an op that ignores its slot, a piece used twice so autograd sums its gradients, a piece with no
gradient) falls back to a copy into the slice (zeros for None), so the result is always the plain split's.

    parts = split_with_grad_arena(t, sizes, dim=-1)
    xt = tag_view(parts[1].transpose(1, 2), parts[1], lambda g: g.transpose(1, 2))
    slot = grad_slot(x)   # op forward / setup_context, on its input; None when x has no arena
    dest = slot.get()     # op backward: x's shape and dtype, a view of the arena; write dx there, return it

Plain split (no slot, no overhead) without grad, for an input that does not require grad, and while
torch.compile traces (the compiled graph plans its own buffers).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

_ATTR = "_mp_grad_slot"  # attribute carrying a piece's GradSlot on the piece tensor


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _dense_strides(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """t's strides when its elements exactly fill a block of memory (any dimension order), else None."""
    if t.numel() == 0:
        return None
    expected = 1
    for i in sorted(range(t.dim()), key=t.stride):
        if t.shape[i] == 1:
            continue
        if t.stride(i) != expected:
            return None
        expected *= t.shape[i]
    return tuple(t.stride())


class _Arena:
    """One split's gradient buffer, allocated on the first request of a backward pass and handed back (released)
    by the split's backward, so a retained graph's next backward starts with a fresh buffer."""

    __slots__ = ("shape", "stride", "dtype", "device", "dim", "offsets", "sizes", "buffer", "taken")

    def __init__(self, t: torch.Tensor, sizes: Sequence[int], dim: int):
        self.shape, self.dtype, self.device, self.dim = t.shape, t.dtype, t.device, dim
        # The arena keeps t's layout when t is dense (e.g. a transposed channels-last conv output), else contiguous;
        # only the strides are kept, not t (its memory is not ours to hold).
        self.stride = _dense_strides(t)
        self.sizes = list(sizes)
        self.offsets = [0]
        for s in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + s)
        self.buffer: Optional[torch.Tensor] = None
        self.taken: set[int] = set()

    def ensure(self) -> torch.Tensor:
        if self.buffer is None:
            if self.stride is not None:
                self.buffer = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
            else:
                self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buffer

    def piece(self, i: int) -> torch.Tensor:
        return self.ensure().narrow(self.dim, self.offsets[i], self.sizes[i])

    def take(self, i: int) -> Optional[torch.Tensor]:
        """Slice i the first time it is asked for in this backward pass, else None (someone already writes it)."""
        if i in self.taken:
            return None
        self.taken.add(i)
        return self.piece(i)

    def release(self) -> None:
        self.buffer, self.taken = None, set()


class GradSlot:
    """Where the gradient of one piece (or of a view of it, see ``tag_view``) should be written."""

    __slots__ = ("_arena", "_index", "_parent", "_to_view", "_shape", "_dtype")

    def __init__(self, shape, dtype, arena: Optional[_Arena] = None, index: int = -1,
                 parent: Optional["GradSlot"] = None, to_view: Optional[Callable] = None):
        self._arena, self._index, self._parent, self._to_view = arena, index, parent, to_view
        self._shape, self._dtype = torch.Size(shape), dtype

    def get(self) -> torch.Tensor:
        """Backward only: a tensor with the tagged tensor's shape and dtype to write its gradient into.

        The first call of a backward pass returns the arena's slice (strided: a slice of a wider dimension, so
        the writing kernel must honour output strides); later calls (a piece consumed twice) return a fresh,
        unshared buffer, whose gradient the split then copies."""
        if self._parent is not None:
            out = self._to_view(self._parent.get())
        else:
            out = self._arena.take(self._index)
            if out is None:
                out = torch.empty(self._shape, dtype=self._dtype, device=self._arena.device)
        if out.shape != self._shape or out.dtype != self._dtype:
            raise RuntimeError(f"grad_arena: slot gives {tuple(out.shape)} {out.dtype}, but the tagged tensor is "
                               f"{tuple(self._shape)} {self._dtype}: tag_view's to_view does not invert the view")
        return out


def grad_slot(x: torch.Tensor) -> Optional[GradSlot]:
    """x: an op's input. -> its GradSlot when x is a piece of ``split_with_grad_arena`` (or a ``tag_view`` of one)
    and a gradient will flow to it; None otherwise (the op then allocates its input gradient itself)."""
    slot = getattr(x, _ATTR, None)
    if slot is None or not x.requires_grad or _compiling():
        return None
    return slot


def tag_view(view: torch.Tensor, base: torch.Tensor, to_view: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """view: a view of ``base`` made between the split and the consuming op (transpose, unflatten, ...);
    to_view: maps a tensor shaped like base to one shaped like view by the same view ops. -> ``view`` itself,
    carrying a slot whose ``get()`` is ``to_view(base's slot.get())``. No-op when base carries no slot."""
    parent = getattr(base, _ATTR, None)
    if parent is not None and view.requires_grad:
        setattr(view, _ATTR, GradSlot(view.shape, view.dtype, parent=parent, to_view=to_view))
    return view


def _is_same_memory(g: torch.Tensor, ref: torch.Tensor) -> bool:
    """g occupies exactly ref's elements (strides of size-1 dimensions do not address memory)."""
    if g.data_ptr() != ref.data_ptr() or g.shape != ref.shape or g.dtype != ref.dtype or g.device != ref.device:
        return False
    return all(n == 1 or a == b for n, a, b in zip(g.shape, g.stride(), ref.stride()))


def _zeros_piece(arena: _Arena, i: int) -> torch.Tensor:
    shape = list(arena.shape)
    shape[arena.dim] = arena.sizes[i]
    return torch.zeros(shape, dtype=arena.dtype, device=arena.device)


def _copy_into(dest: torch.Tensor, g: torch.Tensor) -> None:
    """The fallback: what split's own backward does for this piece."""
    if g.untyped_storage().data_ptr() == dest.untyped_storage().data_ptr():
        g = g.clone()  # another view of the arena: copy_ must not read what it overwrites
    dest.copy_(g)


class _SplitWithArena(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sizes, dim, arena):
        ctx.arena = arena
        ctx.set_materialize_grads(False)  # a piece without gradient: zero its slice, never a full zero tensor
        return tuple(t.split(sizes, dim))

    @staticmethod
    def backward(ctx, *grads):
        arena: _Arena = ctx.arena
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            # create_graph=True (double backward): a differentiable concatenation, as split's own backward
            arena.release()
            whole = [g if g is not None else _zeros_piece(arena, i) for i, g in enumerate(grads)]
            return torch.cat(whole, dim=arena.dim), None, None, None
        for i, g in enumerate(grads):
            dest = arena.piece(i)
            if g is None:
                dest.zero_()
            elif i in arena.taken and _is_same_memory(g, dest):
                continue  # the consuming op wrote its gradient in place: nothing to copy
            else:
                _copy_into(dest, g)
        whole = arena.ensure()
        arena.release()
        return whole, None, None, None


def split_with_grad_arena(t: torch.Tensor, sizes: Sequence[int], dim: int = -1) -> tuple[torch.Tensor, ...]:
    """t (..., sum(sizes), ...) -> pieces like ``t.split(sizes, dim)`` (views of t), each carrying a grad slot.

    sizes: a list of ints summing to t.shape[dim] (the local shard's sizes under tensor parallelism)."""
    sizes = [int(s) for s in sizes]
    d = dim % t.dim()
    if sum(sizes) != t.shape[d] or any(s < 0 for s in sizes):
        raise ValueError(f"split_with_grad_arena: sizes {sizes} (sum {sum(sizes)}) do not split dim {dim} of t with "
                         f"shape {tuple(t.shape)}")
    if not (torch.is_grad_enabled() and t.requires_grad) or _compiling():
        return tuple(t.split(sizes, d))
    arena = _Arena(t, sizes, d)
    parts = _SplitWithArena.apply(t, sizes, d, arena)
    for i, p in enumerate(parts):
        setattr(p, _ATTR, GradSlot(p.shape, p.dtype, arena=arena, index=i))
    return parts


__all__ = ["GradSlot", "grad_slot", "split_with_grad_arena", "tag_view"]
