"""The capture procedure shared by the HF and mlx-lm reference scripts (no framework imports here).

A backend supplies three callables over host arrays:
  full(ids)          -> float32 [T, V]   one call, no cache (the stored `logits`)
  new_cache()        -> opaque cache
  run(ids, cache)    -> float32 [T, V]   one call that extends `cache` by len(ids) tokens

Per prompt, the npz gets (T prompt ids, N = NEW_TOKENS):
  {p}.prompt_ids   int32 [T]        the prompt (same as prompts.json)
  {p}.logits       float32 [T, V]   full(prompt): logits at every prompt position, one call
  {p}.gen_ids      int32 [N]        greedy continuation (argmax, first index on ties; EOS ignored, runs to N)
  {p}.gen_logits   float32 [N, V]   the logits each gen_ids[i] was taken from: row 0 is the last row of
                                    run(prompt, cache), rows i >= 1 come from run([gen_ids[i-1]], cache)
  {p}.gen_margin   float32 [N]      top-1 minus top-2 of each gen_logits row (small = fragile greedy step)
and one `meta` key: a JSON string (tool versions, dtype, precision, the self-consistency figures below).
"""

import json
from collections.abc import Callable
from typing import Any

import numpy as np

NEW_TOKENS = 24


def _margin(row: np.ndarray) -> float:
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])


def capture_prompt(
    ids: list[int],
    full: Callable[[list[int]], np.ndarray],
    new_cache: Callable[[], Any],
    run: Callable[[list[int], Any], np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    logits = full(ids)

    cache = new_cache()
    prefill = run(ids, cache)
    step_row = prefill[-1]
    gen_ids, gen_logits = [], []
    for i in range(NEW_TOKENS):
        token = int(np.argmax(step_row))
        gen_ids.append(token)
        gen_logits.append(step_row)
        if i + 1 < NEW_TOKENS:
            step_row = run([token], cache)[-1]
    gen_logits_arr = np.stack(gen_logits).astype(np.float32)

    # Self-consistency of the peer tool, recorded (not asserted) so a reader sees each path's noise floor.
    stepwise_cache = new_cache()
    stepwise = np.concatenate([run([t], stepwise_cache) for t in ids], axis=0)
    full_with_gen = full(ids + gen_ids[:-1])
    checks = {
        "prefill_cached_vs_full_max_abs": float(np.max(np.abs(prefill - logits))),
        "prompt_stepwise_cached_vs_full_max_abs": float(np.max(np.abs(stepwise - logits))),
        "gen_cached_vs_full_max_abs": float(np.max(np.abs(full_with_gen[len(ids) - 1 :] - gen_logits_arr))),
        "logits_abs_max": float(np.max(np.abs(logits))),
        "logits_std": float(np.std(logits)),
        "distinct_gen_ids": len(set(gen_ids)),
    }
    arrays = {
        "prompt_ids": np.asarray(ids, dtype=np.int32),
        "logits": logits.astype(np.float32),
        "gen_ids": np.asarray(gen_ids, dtype=np.int32),
        "gen_logits": gen_logits_arr,
        "gen_margin": np.asarray([_margin(r) for r in gen_logits_arr], dtype=np.float32),
    }
    return arrays, checks


def capture_all(
    prompts: dict, backend: dict[str, Callable], meta: dict, out_path: str, only: list[str] | None = None
) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    meta = dict(meta, new_tokens=NEW_TOKENS, eos="ignored: greedy runs to new_tokens", checks={})
    for name, prompt in prompts.items():
        if only is not None and name not in only:
            continue
        per_prompt, checks = capture_prompt(prompt["ids"], backend["full"], backend["new_cache"], backend["run"])
        for key, value in per_prompt.items():
            arrays[f"{name}.{key}"] = value
        meta["checks"][name] = checks
        print(f"  {name}: T={len(prompt['ids'])} " + " ".join(f"{k}={v:.3g}" for k, v in checks.items()))
    arrays["meta"] = np.asarray(json.dumps(meta, sort_keys=True))
    if out_path:
        np.savez_compressed(out_path, **arrays)
    return arrays


def load_prompts(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
