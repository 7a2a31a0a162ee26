"""Eager fast path around the library's ``torch.library`` custom ops.

A custom op is what torch.compile needs (fake tensors, an opaque node in the graph), but in eager mode every call
pays the dispatcher and the generated autograd wrapper. Trivial op, CPU host: custom op 17.6 us forward / 35 us
forward + backward (10 us without grad); this path 7.1 / 22 us (3.3 us); a bare autograd.Function 5.9 / 21 us.
The small models' eager training step is host-bound, with ~10 of these calls per layer in each direction.

``fastpath(op, impl, setup_context=..., backward=...)``, next to the op's registration, returns (and attaches to
the op) a dispatcher that in eager mode runs the op's own Python implementation directly, through a lightweight
autograd.Function whose forward runs ``impl`` and the op's registered ``setup_context`` and whose backward is the
op's registered backward (so saved tensors and numerics are the op's). Ops without autograd (the ``*_bwd`` ops a
backward calls, the mutating ops) are called directly, their mutated arguments' version counters bumped as the
op would. Call sites write ``eager(op)(...)``.

The custom op itself runs instead (exactly today's behaviour) when:
- torch.compile / export traces (``torch.compiler.is_compiling()``);
- inside ``use_eager_fastpath(False)`` (tests comparing both paths), or in a process started with
  ``MAMBA_PARALLEL_EAGER_FASTPATH=0`` (the debugging switch, read once at import; docs/kernels/README.md);
- the first argument is a tensor subclass (FakeTensor, FunctionalTensor, DTensor, ...), or a TorchDispatchMode is
  active (op logs, FLOP counters and selective checkpointing see the op, not its insides);
- keyword arguments are passed (call sites pass positionally);
- an op without autograd is called with grad enabled on inputs that require grad (the op's own error).

One deliberate difference: the backward receives None, not zeros, for outputs whose gradient is unused
(``set_materialize_grads(False)``); custom ops materialise zeros (e.g. checkpoint-sized ones for the scan's
checkpoints output). Every registered backward here accepts None for those.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch._C import _any_requires_grad, _len_torch_dispatch_stack

ENV = "MAMBA_PARALLEL_EAGER_FASTPATH"
_ATTR = "_mp_eager_fastpath"  # attribute carrying an op's dispatcher on the CustomOpDef
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_REQUIRED = object()  # placeholder default of a parameter without one


_state = [os.environ.get(ENV) != "0"]  # the process default: on unless the variable is "0"


def enabled() -> bool:
    """Whether eager calls take the fast path (the innermost ``use_eager_fastpath`` block, else the default)."""
    return _state[-1]


@contextlib.contextmanager
def use_eager_fastpath(on: bool) -> Iterator[None]:
    """Inside the block, eager calls take the fast path (True) or always the custom op (False); blocks nest."""
    _state.append(bool(on))
    try:
        yield
    finally:
        _state.pop()


def eager(op: Callable) -> Callable:
    """The dispatcher ``fastpath`` registered for op, or op itself when it has none (e.g. a test's stand-in)."""
    return getattr(op, _ATTR, op)


def _mutated_positions(op) -> tuple[int, ...]:
    schema = op._opoverload._schema
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _defaults(impl: Callable) -> tuple[Any, ...]:
    return tuple(p.default if p.default is not inspect.Parameter.empty else _REQUIRED
                 for p in inspect.signature(impl).parameters.values())


def _autograd_function(name: str, impl: Callable, setup_context: Callable, backward: Callable):
    """A torch.autograd.Function running impl + setup_context forward and the op's registered backward."""

    def forward(ctx, *args):
        ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None, never as allocated zeros
        out = impl(*args)
        setup_context(ctx=ctx, inputs=args, output=out)
        return out

    def bwd(ctx, *grads):
        return backward(ctx, *grads)

    return type(f"{name}_eager", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(bwd)})


def fastpath(op, impl: Callable, *, setup_context: Optional[Callable] = None,
             backward: Optional[Callable] = None) -> Callable:
    """op: a ``torch.library.custom_op`` made from impl (``op = custom_op(name, ...)(impl)``); setup_context /
    backward: what ``op.register_autograd`` was given (both or neither). -> the dispatcher (also ``eager(op)``),
    called with op's positional arguments, returning what op returns."""
    if (setup_context is None) != (backward is None):
        raise ValueError(f"fastpath({op._qualname}): give both setup_context and backward, or neither")
    name = op._qualname
    mutated = _mutated_positions(op)
    if mutated and backward is not None:
        raise ValueError(f"fastpath({name}): an op that mutates arguments {mutated} and has autograd is not "
                         f"supported (the direct path would need mark_dirty)")
    for attr, given in (("_init_fn", impl), ("_setup_context_fn", setup_context), ("_backward_fn", backward)):
        registered = getattr(op, attr, given)  # private CustomOpDef fields: checked where this torch has them
        if registered is not given:
            raise ValueError(f"fastpath({name}): {attr.strip('_')} is not the one the op was made / registered with")
    defaults = _defaults(impl)
    defaulted = [i for i in mutated if i < len(defaults) and defaults[i] is not _REQUIRED]
    if defaulted:
        # torch 2.11 drops trailing default arguments before its in-place bookkeeping, which then indexes the
        # mutated ones by position: an IndexError whenever the call leaves them out
        raise ValueError(f"fastpath({name}): mutated arguments {defaulted} have defaults; make them required")
    nparams = len(defaults)
    nrequired = next((i for i, d in enumerate(defaults) if d is not _REQUIRED), nparams)  # defaults trail
    if nparams != len(op._opoverload._schema.arguments):
        raise ValueError(f"fastpath({name}): impl takes {nparams} arguments, the op's schema "
                         f"{len(op._opoverload._schema.arguments)}: is impl the function the op was made from?")
    fn = _autograd_function(name.replace("::", "_"), impl, setup_context, backward) if backward else None
    profiled_name = name  # the profiler shows the op's name for the direct call too

    def run_direct(args):
        if fn is not None:
            if torch.is_grad_enabled() and _any_requires_grad(*args):
                return fn.apply(*args)
            return impl(*args)
        out = impl(*args)
        if mutated and not torch.is_inference_mode_enabled():
            for i in mutated:  # as the op's ADInplaceOrView kernel does
                t = args[i]
                if t is not None and not t.is_inference():
                    torch.autograd.graph.increment_version(t)
        return out

    def dispatch(*args, **kwargs):
        if (torch.compiler.is_compiling() or kwargs or not enabled() or not args or type(args[0]) not in _PLAIN
                or _len_torch_dispatch_stack()):
            return op(*args, **kwargs)
        if len(args) < nparams:  # the op fills defaults for setup_context; so do we
            if len(args) < nrequired:
                return op(*args)  # the op's own error for a missing argument
            args = args + defaults[len(args):]
        if fn is None and torch.is_grad_enabled() and _any_requires_grad(*args):
            return op(*args)  # no autograd formula: keep the op's behaviour (an error at backward)
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(profiled_name):
                return run_direct(args)
        return run_direct(args)

    dispatch.__name__ = getattr(impl, "__name__", name)
    dispatch.__qualname__ = getattr(impl, "__qualname__", name)
    dispatch.__doc__ = impl.__doc__
    dispatch.__wrapped__ = impl
    dispatch.op = op
    setattr(op, _ATTR, dispatch)
    return dispatch


__all__ = ["ENV", "eager", "enabled", "fastpath", "use_eager_fastpath"]
