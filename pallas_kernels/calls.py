"""`pallas_call` with each distinct kernel traced and lowered once per program.

A 27B program calls the same handful of kernels hundreds of times (64 layers x a few projections, norms, the GDN
step): `pl.pallas_call` traces the kernel body and lowers it to Triton IR at every call site, so lowering a
decode program took seconds per 16 layers and the jax-side work dominated a warm start (the persistent
compilation cache skips XLA's compile, not jax's lowering). Here each distinct call -- the kernel function and
its bound parameters, every `pallas_call` option, the operands' shapes and dtypes -- becomes one `jax.jit`
function, kept in a module-level table: inside an outer trace the call is a `pjit` of an already traced jaxpr,
and jax lowers a given jaxpr once per module (a private function the other call sites call; XLA inlines the
calls before optimizing, so the compiled program is the one the direct calls gave).

The key holds the objects themselves (never their ids), so a hit always means an equal kernel. A call whose
parameters cannot be hashed (an array bound into the kernel, say) is not cached: it goes straight to
`pl.pallas_call`, as before.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Any, Callable

import jax
from jax.experimental import pallas as pl

_JITTED: dict[Any, Callable] = {}


class _Unhashable(Exception):
    pass


def _key(v: Any) -> Any:
    """A hashable, equality-faithful stand-in for v (partials and containers taken apart); _Unhashable if none."""
    if isinstance(v, functools.partial):
        return ("partial", _key(v.func), _key(v.args), _key(v.keywords))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_key(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted((k, _key(x)) for k, x in v.items()))
    if isinstance(v, types.FunctionType):
        # A kernel body or a BlockSpec's index map: the code plus what it closes over (a lambda written at one
        # place in the source is a new object at every call, the same function every time).
        cells = tuple(_key(c.cell_contents) for c in v.__closure__ or ())
        return ("function", v.__code__, cells, _key(v.__defaults__ or ()), _key(v.__kwdefaults__ or {}))
    if callable(v) and isinstance(getattr(v, "__wrapped__", None), types.FunctionType):
        return (type(v), _key(v.__wrapped__))  # a wrapper of a function (a BlockSpec's index map)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v),) + tuple((f.name, _key(getattr(v, f.name))) for f in dataclasses.fields(v))
    try:
        hash(v)
    except TypeError:
        raise _Unhashable from None
    return (type(v), v)  # typed: 1, 1.0 and True are equal in Python but trace to different constants


_ENABLED = [True]


@contextlib.contextmanager
def sharing(enabled: bool):
    """Turn the sharing on or off inside the block (tests count a program's launches with it off: one Triton
    custom call a launch in the lowered text, before XLA inlines the shared functions)."""
    before, _ENABLED[0] = _ENABLED[0], enabled
    try:
        yield
    finally:
        _ENABLED[0] = before


def pallas_call(kernel: Callable, **options) -> Callable:
    """`pl.pallas_call(kernel, **options)`, returning a function of the operands that reuses one jitted (so
    traced and lowered once) function for every equal call: same kernel and parameters, same options, same
    operand shapes and dtypes."""
    def call(*operands):
        if not _ENABLED[0]:
            return pl.pallas_call(kernel, **options)(*operands)
        try:
            # (jit itself retraces for other operand types; the shapes here only keep one table entry a shape)
            key = (_key(kernel), _key(options), tuple((tuple(o.shape), str(o.dtype)) for o in operands))
        except _Unhashable:
            return pl.pallas_call(kernel, **options)(*operands)
        fn = _JITTED.get(key)
        if fn is None:
            fn = _JITTED[key] = jax.jit(lambda *ops: pl.pallas_call(kernel, **options)(*ops))
        return fn(*operands)
    return call


def cached_calls() -> int:
    """How many distinct kernel calls the table holds (tests)."""
    return len(_JITTED)


@contextlib.contextmanager
def triton_modules(render: Callable):
    """Within the block, each Triton module Pallas lowers (jax's Pallas-to-Triton lowering, whichever GPU it
    targets) goes through render(module) as it is made, and the results are appended to the list this yields:
    what the tests and tools read of the IR a call hands XLA."""
    from jax._src.pallas.triton import lowering

    seen: list = []
    original = lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(render(result.module))
        return result

    lowering.lower_jaxpr_to_triton_module = keep
    try:
        yield seen
    finally:
        lowering.lower_jaxpr_to_triton_module = original
