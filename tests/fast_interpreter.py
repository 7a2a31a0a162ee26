"""Triton's CPU interpreter, without its repeated patching of ``triton.language``.

Every launch patches the language's builtins for the interpreter (``_patch_lang``) and restores them afterwards;
so does every call of a ``@triton.jit`` helper inside a kernel, where the language is already patched: that pass
walks ``triton.language`` with ``inspect.getmembers`` and finds nothing left to patch (the first helper from
``triton.language.core``'s own library, e.g. ``tl.sum``, patches ``core`` for the rest of the launch). In kernels
that call helpers inside their loops that was a third of the CPU suite's interpreter time. Here a nested call whose
modules the running launch has patched already skips the walk; everything else is Triton's own code path.

The interpreter also looks up the numpy dtype of a Triton dtype (``_get_np_dtype``) for every value it makes or
casts, and builds its table of nineteen dtypes anew on each call, hashing every key: about a tenth of the time of
a kernel test. Here each scalar dtype's answer is kept by name after Triton's own function first gives it (the
table's keys compare by name); pointers and anything else still go to Triton's function.
"""

from __future__ import annotations

import inspect


class _AlreadyPatched:
    def restore(self) -> None:
        pass


def _keep_np_dtypes(interpreter, tl) -> None:
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "_keeps_answers", False):
        return
    scalar, block = tl.dtype, tl.block_type
    kept: dict = {}  # scalar dtype name -> numpy dtype

    def get_np_dtype(tt_dtype):
        t = tt_dtype.element_ty if type(tt_dtype) is block else tt_dtype
        if type(t) is not scalar:  # pointers (and blocks of them), anything unexpected: Triton's own answer
            return original(tt_dtype)
        np_dtype = kept.get(t.name)
        if np_dtype is None:
            np_dtype = kept[t.name] = original(t)
        return np_dtype

    get_np_dtype._keeps_answers = True
    interpreter._get_np_dtype = get_np_dtype


def install() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # no triton: nothing to speed up
        return
    _keep_np_dtypes(interpreter, tl)
    if getattr(interpreter._patch_lang, "_skips_nested", False):
        return
    original = interpreter._patch_lang
    active: list[set] = []  # the modules the running launch has patched

    known: dict = {}  # function -> the language modules its globals hold

    def langs_of(fn) -> frozenset:
        langs = known.get(fn)
        if langs is None:
            langs = known[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                          if inspect.ismodule(v) and v in (tl, tl.core))
        return langs

    def patch_lang(fn):
        langs = langs_of(fn)
        if active:  # a helper called inside a kernel: its modules stay patched until the launch ends
            if langs <= active[-1]:
                return _AlreadyPatched()
            active[-1].update(langs)
            return original(fn)
        scope = original(fn)
        active.append(set(langs))
        restore = scope.restore

        def restore_and_end():
            try:
                restore()
            finally:
                active.pop()

        scope.restore = restore_and_end
        return scope

    patch_lang._skips_nested = True
    interpreter._patch_lang = patch_lang
