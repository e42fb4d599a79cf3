"""A lowering cache for Mosaic GPU kernel calls.

jax lowers a Pallas kernel again in every program that calls it, and Mosaic GPU's lowering of one of our kernels
takes ~0.4-0.7 s on a CPU core (layout inference, dialect lowering, serialization): the 27B's decode program holds
6 distinct qmm kernels and 16 attention layers, a server compiles ~10 decode programs, so tens of seconds of
start-up. Each lowering also serializes a module that differs from the last only in a per-process kernel counter
and source locations, so its hash differs and Mosaic GPU compiles the same kernel again for every call site. A
kernel's custom call depends only on the operand shapes and the static parameters, so `CachedKernel` lowers it once
a process (in a program of its own) and re-emits its attributes into every later program: the program is the
uncached one outside the kernel's bytes, and the kernel's module the same but for that counter and the locations
(`tests/test_qmm_mgpu.py::test_lowering_cache_same_program`); one hash, compiled once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.interpreters import mlir


def custom_calls(op) -> list:
    """Every `stablehlo.custom_call` operation nested in the MLIR operation op, in program order."""
    found = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    found.append(inner.operation)
                found += custom_calls(inner.operation)
    return found


class CachedKernel:
    """`kernel_call(*operands, interpret=False, **static)` (one Mosaic GPU kernel on the operands, in order) as a
    primitive whose CUDA lowering is cached per (operand avals, static parameters). out_avals(*avals, **static)
    gives the results' `jax.core.ShapedArray`s. enabled() is read at each lowering (False: lowered in place)."""

    def __init__(self, name: str, kernel_call: Callable, out_avals: Callable, *,
                 enabled: Callable[[], bool] = lambda: True):
        self.name, self.kernel_call, self.enabled = name, kernel_call, enabled
        self.lowered: dict[tuple, dict[str, str]] = {}
        self.primitive = jax.extend.core.Primitive(name)
        self.primitive.multiple_results = True
        self.primitive.def_abstract_eval(lambda *avals, **kw: list(out_avals(*avals, **kw)))
        self.primitive.def_impl(lambda *args, **kw: jax.jit(functools.partial(self.primitive.bind, **kw))(*args))
        mlir.register_lowering(self.primitive, self._lower, platform="cuda")

    def __call__(self, *operands, **static) -> list:
        return self.primitive.bind(*operands, **static)

    def _uncached(self, **static):
        def call(*operands):
            out = self.kernel_call(*operands, interpret=False, **static)
            return list(out) if isinstance(out, (tuple, list)) else [out]
        return call

    def _call_attributes(self, avals, static: dict) -> dict[str, str]:
        """The custom call the kernel lowers to for these operand avals, as {attribute: its text}; lowered in a
        program of its own, which must hold exactly one custom call on the program's operands in order."""
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        module = jax.jit(self._uncached(**static)).trace(*args).lower(
            lowering_platforms=("cuda",)).compiler_ir("stablehlo")
        calls = custom_calls(module.operation)
        if len(calls) != 1:
            raise RuntimeError(f"{self.name} lowering cache: expected one custom call, found {len(calls)}")
        call = calls[0]
        owner = call.parent.regions[0].blocks[0]
        if [str(v.get_name()) for v in call.operands] != [str(owner.arguments[i].get_name())
                                                          for i in range(len(args))]:
            raise RuntimeError(f"{self.name} lowering cache: the custom call does not take the program's operands "
                               "in order")
        return {name: str(call.attributes[name]) for name in call.attributes}

    def _lower(self, ctx, *operands, **static):
        if not self.enabled() or getattr(ctx.module_context.axis_context, "num_devices", None) != 1:
            # cache off (read here, at lowering), or a program over several devices (Mosaic GPU's lowering reads
            # the mesh): lowered in place, uncached
            return mlir.lower_fun(self._uncached(**static), multiple_results=True)(ctx, *operands)
        key = (tuple((a.shape, str(a.dtype)) for a in ctx.avals_in), tuple(sorted(static.items())))
        attrs = self.lowered.get(key)
        if attrs is None:
            attrs = self.lowered[key] = self._call_attributes(ctx.avals_in, static)
        op = mlir.ir.Operation.create(
            "stablehlo.custom_call",
            results=[mlir.aval_to_ir_type(ctx.module_context, aval) for aval in ctx.avals_out],
            operands=list(operands), attributes={name: mlir.ir.Attribute.parse(text) for name, text in attrs.items()})
        return op.results
