"""Every global name a function of the package reads is defined in its module (or is a builtin).

Benchmark routines and GPU-only paths do not run on the CPU CI, so a name lost in a refactor (a helper
moved to another module without its import) would only fail on the GPU; this reads the bytecode of
every function, method and kernel body in the package instead of running it.
"""
import builtins
import dis
import importlib
import pkgutil
import types

import pytest

import fp8attn


def _modules():
    names = ["fp8attn"]
    for info in pkgutil.walk_packages(fp8attn.__path__, "fp8attn."):
        if not info.name.endswith(".__main__"):  # importing it runs the CLI
            names.append(info.name)
    return sorted(names)


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions(module):
    """Code objects of the functions, methods and (Triton/Gluon) kernels defined in ``module``."""
    seen = set()

    def visit(obj, depth=0):
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        fn = getattr(obj, "fn", None)  # triton.JITFunction / gluon kernels wrap the Python function
        if isinstance(fn, types.FunctionType):
            obj = fn
        if isinstance(obj, types.FunctionType):
            if obj.__code__.co_filename == module.__file__:  # not generated (dataclass reprs) or imported
                yield from _code_objects(obj.__code__)
        elif isinstance(obj, type) and obj.__module__ == module.__name__:
            for v in vars(obj).values():
                yield from visit(getattr(v, "__func__", v), depth + 1)
        elif isinstance(obj, (staticmethod, classmethod)):
            yield from visit(obj.__func__, depth + 1)

    for value in list(vars(module).values()):
        yield from visit(value)


@pytest.mark.parametrize("name", _modules())
def test_global_names_are_defined(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # an optional dependency (e.g. transformers) is absent
        pytest.skip(f"{name}: {e}")
    missing = set()
    for code in _functions(module):
        for ins in dis.get_instructions(code):
            if ins.opname == "LOAD_GLOBAL":
                n = ins.argval
                if n not in vars(module) and not hasattr(builtins, n):
                    missing.add(f"{code.co_name}: {n}")
    assert not missing, f"{name} reads undefined globals: {sorted(missing)}"
