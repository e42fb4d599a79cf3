"""Programmatic dependent launch (PDL) between a decode round's kernels: a kernel launched with it may start while
the kernel before it in the stream still runs, and waits (`griddepcontrol.wait`: that kernel done, its writes
visible) only where it first needs what that kernel wrote.

Why: every decode projection (`qmm_mgpu`, 257 launches a one-stream 27B round) pays ~3-4 µs of start and drain on
top of its steady weight stream (BENCHMARKS.md, qmm, session 18), and its weights depend on nothing the kernel
before it writes. With `qmm_mgpu.PDL_STEPS` > 0 its CTAs, once resident, ask L2 for their first weight blocks and
only then wait; its x and its outputs are touched after the wait. Session 19 measured a form that waited before
any copy and changed nothing in the round.

The kernel before it has to let it start: a dependent grid is launched only once every CTA of the running grid has
executed `griddepcontrol.launch_dependents` (or exited). So the Triton kernels that come right before a decode
projection (the norms, the residual add with its norm, the GDN step with its norm, the MLP's activation) execute
it first thing, through `program_id`, when `TRIGGER` is on. It changes nothing for a kernel launched without PDL
(the Triton kernels XLA launches, the other Mosaic GPU kernels), and no value: it is a scheduling hint.

Both are off. Session 36 timed them on an H100 (`tools/gpu/run.sh hundred-forty-fifth`, `hundred-forty-sixth`): the
same bits, but the one-stream round 4-6 % slower (121.5 forwards/s plain, 116.8 at 4 steps, 114.5 at 8). One H200
timing (`hundred-forty-sixth`) decides whether they stay or go.
"""

from __future__ import annotations

import jax
import jax.extend
from jax.experimental import pallas as pl
from jax.interpreters import mlir

# Whether the Triton kernels that precede a decode projection let a dependent launch start at once (read when a
# kernel is built: pass it in as a bound parameter, so `calls.pallas_call`'s table keys on it).
TRIGGER = False

_TRIGGER_PTX = "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;"

# The trigger as a primitive: x -> x (an int32 scalar), whose Triton lowering passes x through the instruction's
# inline asm, not pure (so the compiler neither drops it nor moves it past the uses of its result). Elsewhere
# (interpret mode) it is the identity.
_trigger_p = jax.extend.core.Primitive("pdl_launch_dependents")
_trigger_p.def_impl(lambda x: x)
_trigger_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(_trigger_p, lambda ctx, x: [x])


def _register_triton_rule() -> None:
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering

    @lowering.register_lowering(_trigger_p)
    def _rule(ctx, x):
        return tt_dialect.elementwise_inline_asm([ir.IntegerType.get_signless(32)], _TRIGGER_PTX,
                                                 constraints="=r,r", pure=False, packed_element=1, args=[x])


_register_triton_rule()


def program_id(axis: int, trigger: bool) -> jax.Array:
    """Inside a Pallas Triton kernel: `pl.program_id(axis)`, having executed `griddepcontrol.launch_dependents`
    when trigger (every thread, before anything that reads the id). The id comes through the instruction, so a
    kernel whose indices read it cannot lose it."""
    pid = pl.program_id(axis)
    return _trigger_p.bind(pid) if trigger else pid


def trigger_for(interpret: bool) -> bool:
    """The trigger a kernel built now takes: `TRIGGER`, never in interpret mode (which has no grid dependencies)."""
    return bool(TRIGGER) and not interpret
