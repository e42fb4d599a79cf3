"""Pallas GPU kernels for qwen-jax, each beside a plain-jnp `reference()` with the same signature."""

import dataclasses as _dataclasses


def replace_fields(tiles, spec: str, what: str):
    """`tiles` (a dataclass of tile settings) with the fields named in spec "field=value,..." replaced: the
    benchmarks' A/B syntax, booleans as 0/1, strings as written, everything else as an int. Unknown fields and
    values that do not parse are a ValueError naming them (`what` says whose)."""
    fields = {f.name: f.type for f in _dataclasses.fields(tiles)}
    changes = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value:
            raise ValueError(f"{what}: {item!r} is not field=value with a field of {sorted(fields)}")
        kind = fields[name]
        try:
            changes[name] = value if kind == "str" else (bool(int(value)) if kind == "bool" else int(value))
        except ValueError:
            raise ValueError(f"{what}: {name}={value!r} is not a {kind}") from None
    return _dataclasses.replace(tiles, **changes)
