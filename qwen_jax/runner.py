"""A single-stream runner over the functional model: jitted prompt pass (row buckets of 64) and 1-row verify +
commit steps. The offline CLI's `logits` and the peer-capture tests (greedy); serving and sampled generation go
through the engine."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax import model as M
from qwen_jax.config import ModelConfig

GRID = 64


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@functools.lru_cache(maxsize=None)
def _programs(cfg: ModelConfig, backend: M.Backend):
    """Jitted prefill / verify / commit for one (config, backend), shared by every Runner."""
    prefill = jax.jit(lambda p, s, b, all_logits: M.prefill(p, s, b, cfg, backend, all_logits=all_logits)[:2],
                      static_argnums=3, donate_argnums=1)
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, backend)[:2])
    commit = jax.jit(lambda s, k, w, path, n: M.commit(s, k, w, path, n, cfg, backend), donate_argnums=0)
    return prefill, verify, commit


class Runner:
    def __init__(self, params, cfg: ModelConfig, *, dtype=jnp.bfloat16, backend: M.Backend | None = None,
                 max_len: int = 4096, page_size: int = 64, kv_dtype=None):
        self.params, self.cfg = params, cfg
        self.backend = backend or M.Backend.default()
        self.max_len = max_len
        pages = math.ceil(max_len / page_size)
        # Slot 0 and page 0 are the dummies that padding rows point at.
        self.state = M.init_state(cfg.text, num_slots=2, num_pages=pages + 1, page_size=page_size, dtype=dtype,
                                  kv_dtype=kv_dtype)
        self.page_table = np.arange(1, pages + 1, dtype=np.int32)[None]
        self._prefill, self._verify, self._commit = _programs(cfg, self.backend)

    def _check_len(self, n: int) -> None:
        if n > self.max_len:
            raise ValueError(f"sequence of {n} tokens exceeds the context of {self.max_len} (raise --max-model-len)")

    def prefill(self, ids: list[int], start: int = 0, *, all_logits: bool = False) -> np.ndarray:
        """Prompt pass over ids at positions start..; returns logits ([T, V] or the last row's [V])."""
        n = len(ids)
        self._check_len(start + n)
        t = round_up(max(n, 1), GRID)
        toks = np.zeros((1, t), np.int32)
        toks[0, :n] = ids
        batch = M.make_prefill_batch(toks, [start], [n], [1], self.page_table)
        logits, self.state = self._prefill(self.params, self.state, batch, all_logits)
        out = np.asarray(logits[0])
        return out[:n] if all_logits else out

    def step(self, token: int, pos: int) -> np.ndarray:
        """One serial decode step: the token at absolute position pos; returns the next-token logits [V]."""
        self._check_len(pos + 1)
        w = M.make_window([[token]], [[-1]], [pos], [1], self.page_table)
        logits, kept = self._verify(self.params, self.state, w)
        self.state = self._commit(self.state, kept, w, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
        return np.asarray(logits[0, 0])

    def logits(self, ids: list[int]) -> np.ndarray:
        return self.prefill(ids, all_logits=True)

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation (argmax, lowest id on ties), stopping only at max_tokens or the context end."""
        if not ids:
            raise ValueError("the prompt is empty")
        logits = self.prefill(ids)
        out: list[int] = []
        pos = len(ids)
        for _ in range(max_tokens):
            tok = int(np.argmax(logits))
            out.append(tok)
            if pos + 1 > self.max_len - 1:
                break
            logits = self.step(tok, pos)
            pos += 1
        return out
