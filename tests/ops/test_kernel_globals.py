"""Every Triton kernel reads only the globals the GPU compiler accepts.

The CPU interpreter runs a kernel as Python, so a kernel that reads a plain module-level number passes every CPU
test; compiled for a GPU, Triton refuses it ("Cannot access global variable ... from within @jit'ed function").
This walks the source of every ``@triton.jit`` function in ``mamba_parallel.ops`` and checks each global it reads
against what the compiler allows: modules, other jit functions, ``tl.constexpr`` values, triton.language objects and
dtypes, and Python builtins.
"""

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import triton.language as tl

import mamba_parallel.ops


def _python_fn(obj):
    """The plain function behind a jit function, an autotuner or heuristics wrapper (interpreted or compiled)."""
    seen = 0
    while not isinstance(obj, types.FunctionType) and seen < 8:
        obj = getattr(obj, "fn", None)
        seen += 1
    return obj if isinstance(obj, types.FunctionType) else None


def _is_kernel(obj) -> bool:
    return type(obj).__module__.startswith("triton.runtime") and _python_fn(obj) is not None


def kernels():
    found = {}
    for info in pkgutil.walk_packages(mamba_parallel.ops.__path__, "mamba_parallel.ops."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = _python_fn(obj) if _is_kernel(obj) else None
            if fn is not None and fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = fn
    return found


def _local_names(tree: ast.FunctionDef) -> set:
    names = {a.arg for a in tree.args.args + tree.args.kwonlyargs}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
    return names


def _allowed(value) -> bool:
    return (isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype)) or _is_kernel(value)
            or getattr(value, "__triton_builtin__", False)
            or getattr(value, "__module__", "").startswith("triton.language"))


def test_the_walk_finds_the_kernels():
    found = kernels()
    assert len(found) > 40
    for op in ("ssd", "selective_scan", "mamba3", "conv1d"):
        assert any(f".{op}." in name for name in found), op


def test_kernels_read_only_globals_the_compiler_accepts():
    bad = []
    for name, fn in kernels().items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        local = _local_names(tree)
        body = [node for stmt in tree.body for node in ast.walk(stmt)]  # not the decorators nor the defaults
        for node in body:
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id in local:
                continue
            if node.id in fn.__globals__:
                if not _allowed(fn.__globals__[node.id]):
                    bad.append(f"{name}: {node.id} = {fn.__globals__[node.id]!r}")
            elif not hasattr(builtins, node.id):
                bad.append(f"{name}: {node.id} is not defined")
    assert not bad, "globals Triton's GPU compiler refuses (make them tl.constexpr or literals):\n" + "\n".join(bad)


def test_the_check_refuses_a_plain_number():
    assert not _allowed(6.28) and not _allowed((1, 2))
    assert _allowed(tl.constexpr(6.28)) and _allowed(tl) and _allowed(tl.float32) and _allowed(tl.exp)
