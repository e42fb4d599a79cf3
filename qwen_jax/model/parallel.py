"""Tensor parallelism: the text model's layers split by heads over the devices of a one-axis mesh.

Each device holds 1/N of every layer's heads and of the MLP's intermediate columns: the in-projections (GDN's
q|k|v, z, b, a; attention's q|gate, k, v; the MLP's gate|up) split along their outputs, the output projections
(GDN's out, attention's o, the MLP's down) along their inputs, the GDN conv taps, A_log and dt_bias with their
channels and heads, the state pools (KV pages, GDN states, conv windows) by head, and an untied lm_head by
vocabulary rows (each device's logits gathered after it). The embedding (and a tied lm_head) and the norms are
whole on every device. The model's entry points (`forward.prefill`, `verify`, `step`,
`commit`) run their body under `jax.shard_map` with the config's head counts divided by N (`local_config`), so
every kernel sees the shapes of a model 1/N as wide; each output projection's partial sums are gathered and added
in device order (`reduce`), which makes every device hold the same residual stream.

Exactness. The sum of the partials runs in fp32 in a fixed order (device 0 first) and rounds once, elementwise: a
row's bits depend on its own partials only, never on the rows beside it or on how the collective cut the message,
so concurrent = solo and drafted = serial hold under N devices as on one. The bits differ from one device's (the
output projections' reductions are split), so a reply under N devices may differ from the one-device reply where
two tokens are nearly tied; tests/test_parallel.py compares them numerically.

Layout. A fused in-projection's parts are each split in N, and device j's slice is its parts' j-th pieces in
order (`_permutation`), so a device's slice is itself the fused projection of a model 1/N as wide (with its
`Fused.sizes`); GDN's q|k|v part is split by head group as q, k and v. The conv taps follow the same channel
order. A value head reads key head h // (Hv/Hk), and a query head KV head h // (Hq/Hkv), so contiguous head
groups keep both pairings on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.qweight import QuantizedWeight

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A one-axis mesh over the first `size` devices. Static under jit (hashable)."""
    mesh: Mesh

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    @staticmethod
    def over(size: int, devices=None) -> "TensorParallel":
        """The first `size` of `devices` (default: jax.devices()); a ValueError naming --tensor-parallel-size when there
        are fewer."""
        devices = jax.devices() if devices is None else list(devices)
        if size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
        if len(devices) < size:
            hint = (" (on a CPU host, JAX_NUM_CPU_DEVICES=N makes N devices)"
                    if devices and devices[0].platform == "cpu" else "")
            raise ValueError(f"--tensor-parallel-size {size} needs {size} devices; jax sees {len(devices)}{hint}")
        return TensorParallel(Mesh(np.array(devices[:size]), (AXIS,)))


def check(cfg, size: int) -> None:
    """A ValueError naming --tensor-parallel-size where the text model's heads or columns do not split in `size`."""
    t = cfg.text
    counts = {"attention heads": t.num_heads, "KV heads": t.num_kv_heads, "GDN key heads": t.linear_num_key_heads,
              "GDN value heads": t.linear_num_value_heads, "MLP columns": t.intermediate_size}
    if not t.tie_word_embeddings:
        counts["vocabulary rows (the lm_head)"] = t.vocab_size
    for what, n in counts.items():
        if n % size:
            raise ValueError(f"--tensor-parallel-size {size}: the model's {n} {what} do not split in {size}")
    q = cfg.quantization
    if q is not None:
        # the output projections split along their inputs, which must stay whole quantization groups
        for what, k in (("MLP columns", t.intermediate_size), ("GDN value channels", t.value_dim),
                        ("attention channels", t.num_heads * t.head_dim)):
            if (k // size) % q.group_size:
                raise ValueError(f"--tensor-parallel-size {size}: {k // size} {what} a device is not a whole number of "
                                 f"{q.group_size}-wide quantization groups")


def local_config(cfg, size: int):
    """The config of the model each device runs: head counts and the MLP's width divided by `size`."""
    t = cfg.text
    text = dataclasses.replace(t, num_heads=t.num_heads // size, num_kv_heads=t.num_kv_heads // size,
                               linear_num_key_heads=t.linear_num_key_heads // size,
                               linear_num_value_heads=t.linear_num_value_heads // size,
                               intermediate_size=t.intermediate_size // size)
    return dataclasses.replace(cfg, text=text)


# --- the params' layout -------------------------------------------------------------------------------------------

def _permutation(parts: tuple[int, ...], size: int) -> np.ndarray:
    """Row order putting device j's pieces of every part (each part cut in `size` equal pieces) together, j = 0 ..
    size - 1, the parts in order within a device."""
    starts = np.cumsum((0,) + parts[:-1])
    return np.concatenate([np.arange(s + j * (n // size), s + (j + 1) * (n // size))
                           for j in range(size) for s, n in zip(starts, parts)])


def _rows(w, idx: np.ndarray):
    """A weight (packed or dense [N, K]) with its output rows in the order idx."""
    if isinstance(w, QuantizedWeight):
        if w.scales_t is not None or w.lanes:
            raise ValueError("tensor parallel lays out weights before their decode layout (qmm.decode_layout)")
        return dataclasses.replace(w, words=w.words[idx], scales=w.scales[idx], biases=w.biases[idx])
    return w[idx]


def _split_fused(f, parts: tuple[int, ...], size: int, name: str):
    from qwen_jax.model.ops import Fused
    if not isinstance(f, Fused) or sum(parts) != sum(f.sizes):
        raise ValueError(f"--tensor-parallel-size: {name} must be one fused projection (its parts in one format)")
    return Fused(_rows(f.weight, _permutation(parts, size)), tuple(n // size for n in f.sizes))


def shard_layout(params: dict, cfg, size: int) -> dict:
    """The text params in the tensor-parallel layout for `size` devices (still whole arrays; `place` splits them):
    every fused in-projection's rows and the conv taps' channels reordered so device j's slice is contiguous."""
    check(cfg, size)
    if size == 1:
        return params
    t = cfg.text
    kd, vd, hv = t.key_dim, t.value_dim, t.linear_num_value_heads
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        mlp = dict(layer["mlp"])
        mlp["gate_up"] = _split_fused(mlp["gate_up"], (t.intermediate_size,) * 2, size, "the MLP's gate|up")
        layer["mlp"] = mlp
        if "gdn" in layer:
            g = dict(layer["gdn"])
            g["in_proj"] = _split_fused(g["in_proj"], (kd, kd, vd, vd, hv, hv), size, "the GDN in-projection")
            g["conv"] = g["conv"][_permutation((kd, kd, vd), size)]
            layer["gdn"] = g
        else:
            a = dict(layer["attn"])
            a["qkv"] = _split_fused(a["qkv"], (t.num_heads * 2 * t.head_dim,) + (t.num_kv_heads * t.head_dim,) * 2,
                                    size, "the attention qkv projection")
            layer["attn"] = a
        layers.append(layer)
    return dict(params, layers=tuple(layers))


def _weight_specs(w, out: bool):
    """Specs of a weight split along its outputs (out) or its inputs."""
    from qwen_jax.model.ops import Fused
    if isinstance(w, Fused):
        return Fused(_weight_specs(w.weight, out), w.sizes)
    if isinstance(w, QuantizedWeight):
        n, k = (P(AXIS, None), P(None, AXIS)) if out else (P(None, AXIS), P(AXIS, None))
        opt = lambda a, spec: None if a is None else spec  # noqa: E731
        return dataclasses.replace(w, words=n, scales=n, biases=n, scales_t=opt(w.scales_t, k),
                                   biases_t=opt(w.biases_t, k),
                                   row_scale=opt(w.row_scale, P(None, AXIS) if out else P()))
    return P(AXIS, None) if out else P(None, AXIS)


def whole(tree):
    """Specs of a tree whose arrays are whole on every device."""
    return jax.tree.map(lambda _: P(), tree)


def param_specs(params: dict) -> dict:
    """PartitionSpecs of the text params in the tensor-parallel layout (a tree of the params' structure)."""
    layers = []
    for layer in params["layers"]:
        s = {"input_norm": P(), "post_norm": P(),
             "mlp": {"gate_up": _weight_specs(layer["mlp"]["gate_up"], True),
                     "down": _weight_specs(layer["mlp"]["down"], False)}}
        if "gdn" in layer:
            g = layer["gdn"]
            s["gdn"] = {"in_proj": _weight_specs(g["in_proj"], True), "out": _weight_specs(g["out"], False),
                        "conv": P(AXIS, None), "dt_bias": P(AXIS), "A_log": P(AXIS), "norm": P()}
        else:
            a = layer["attn"]
            s["attn"] = {"qkv": _weight_specs(a["qkv"], True), "o": _weight_specs(a["o"], False),
                         "q_norm": P(), "k_norm": P()}
        layers.append(s)
    head = params["lm_head"]
    return {"embed": whole(params["embed"]), "norm": P(),
            "lm_head": None if head is None else _weight_specs(head, True),  # by vocabulary rows (`check`)
            "layers": tuple(layers)}


def head_logits(logits, vocab: int):
    """The whole vocabulary's logits from each device's slice of them (inside the shards), where the lm_head is split
    by rows (its local width below the vocabulary); else logits as they are."""
    if logits.shape[-1] == vocab:
        return logits
    return jax.lax.all_gather(logits, AXIS, axis=logits.ndim - 1, tiled=True)


def state_specs(state):
    """The pools split by head: KV pages [Hkv, ...], GDN states [N, Hv, dk, dv], conv windows [N, K-1, C]."""
    from qwen_jax.model.forward import ModelState
    return ModelState(tuple(jax.tree.map(lambda _: P(AXIS), pool) for pool in state.kv),
                      tuple(P(None, AXIS) for _ in state.rec), tuple(P(None, None, AXIS) for _ in state.conv))


# What commit replays, per layer: GDN's {m [S, R, C], k, v [S, R, H, d], g, beta [S, R, Hv]} and attention's
# {k, v [S, R, Hkv, d]}: every leaf split along axis 2.
KEPT = P(None, None, AXIS)


def place(tree, specs, tp: TensorParallel):
    """device_put of tree's arrays split by specs (a prefix tree of PartitionSpecs) over tp's mesh."""
    shardings = jax.tree.map(lambda s: NamedSharding(tp.mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    return jax.device_put(tree, shardings)


def prepare(params: dict, cfg, backend, layout=None) -> dict:
    """The text params as a backend's programs take them: as they are without tensor parallelism; else in its
    layout (`shard_layout`), passed through `layout` (e.g. the decode kernel's `qmm.decode_layout`, which works on
    whole weights), and split over its mesh."""
    tp = backend.parallel
    if tp is None:
        return params if layout is None else layout(params)
    laid = shard_layout(params, cfg, tp.size)
    laid = laid if layout is None else layout(laid)
    return place(laid, param_specs(laid), tp)


def place_state(state, backend):
    """Model state pools as a backend's programs take them: split by head over its mesh, if it has one."""
    return state if backend.parallel is None else place(state, state_specs(state), backend.parallel)


def replicate(tree, tp: TensorParallel):
    """tree's arrays whole on every device of tp's mesh."""
    return jax.device_put(tree, NamedSharding(tp.mesh, P()))


# --- inside the shards ----------------------------------------------------------------------------------------------

def reduce(y: jax.Array) -> jax.Array:
    """The sum over the devices of an output projection's partial rows y, in fp32, device 0 first, rounded once to
    y's dtype: elementwise, so a row's bits are its own partials' alone (called inside `run`'s shard_map)."""
    parts = jax.lax.all_gather(y, AXIS)
    total = parts[0].astype(jnp.float32)
    for i in range(1, parts.shape[0]):
        total = total + parts[i].astype(jnp.float32)
    return total.astype(y.dtype)


def run(fn, tp: TensorParallel, in_specs: tuple, out_specs, *args):
    """fn(*args) under shard_map over tp's mesh (fn closes over the local config and the inner backend)."""
    return jax.shard_map(fn, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
