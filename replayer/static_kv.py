"""The static runtime's KV cache (replayer/runtime.py): preallocated per-layer buffers and their writes
and reads.

Each layer that owns K/V holds `k_cache` and `v_cache` (1, kv_heads, max_seq, head_dim), buffers
of its LayerWeights (`layers.N.k_cache`); a KV-reusing layer has none and reads the storing layer's,
which already holds the current step's rows. `_write_kv` and `_read_kv` are the seams a derived
runtime overrides (replayer/functional.py passes the caches in and out instead; tests/support/bug_zoo.py).
"""

from __future__ import annotations

import torch

from gemma4_trace.traces.errors import TraceToolError


class StaticKV:
    """Part of StaticGemma4Runtime: the K/V caches of `layers` (reads infos, max_seq, dtype, name)."""

    def _allocate_kv(self) -> None:
        """Zero `k_cache`, `v_cache` buffers on every layer that owns K/V, in the embeddings' dtype and device."""
        dtype, device = self.dtype, self.embed.device
        for L, info in zip(self.layers, self.infos):
            if L.owns_kv:
                shape = (1, info.num_kv_heads, self.max_seq, info.head_dim)
                L.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
                L.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def _clear_kv(self) -> None:
        """Zero every cache: what a chunked prefill does not write must read as empty."""
        for L in self.layers:
            if L.owns_kv:
                L.k_cache.zero_()
                L.v_cache.zero_()

    def _check_cache(self, i: int, what: str, cache: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Raise naming layer i when a K/V buffer cannot hold its (1, kv_heads, n, head_dim) rows.

        Shapes are static, so this costs nothing in an exported graph.
        """
        info = self.infos[i]
        want = (1, info.num_kv_heads, self.max_seq, info.head_dim)
        got = tuple(cache.shape)
        bad = got != want or (rows is not None and (tuple(rows.shape[:2]) != want[:2] or rows.shape[3] != want[3]))
        if bad:
            src = f" (K/V of layer {info.kv_source})" if info.kv_source != i else ""
            rows_s = f" for rows {tuple(rows.shape)}" if rows is not None else ""
            raise TraceToolError(
                f"{self.name} runtime: layer {i} ({info.layer_type}) {what}{src}: cache buffer {got}{rows_s}, "
                f"expected (1, kv_heads {info.num_kv_heads}, max_seq {self.max_seq}, head_dim {info.head_dim})"
            )

    def _write_kv(self, i: int, k_t: torch.Tensor, v_t: torch.Tensor, input_pos: torch.Tensor, valid) -> None:
        """Write layer i's K/V rows (1, KV, n, D) into its cache.

        Prefill (valid (n,) bool given) writes padding rows as zeros: over the whole max_seq it
        rewrites the whole cache, a chunk writes its n rows at their positions; decode (valid
        None) writes one row per position.
        """
        L = self.layers[i]
        self._check_cache(i, "writes K/V", L.k_cache, k_t)
        self._check_cache(i, "writes K/V", L.v_cache, v_t)
        if valid is None:
            L.k_cache.index_copy_(2, input_pos, k_t)
            L.v_cache.index_copy_(2, input_pos, v_t)
        else:
            keep = valid[None, None, :, None]
            k_t, v_t = torch.where(keep, k_t, torch.zeros_like(k_t)), torch.where(keep, v_t, torch.zeros_like(v_t))
            if k_t.shape[2] == self.max_seq:
                L.k_cache.copy_(k_t)
                L.v_cache.copy_(v_t)
            else:
                L.k_cache.index_copy_(2, input_pos, k_t)
                L.v_cache.index_copy_(2, input_pos, v_t)

    def _read_kv(self, i: int, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V (1, KV, max_seq, D) layer i attends over at positions input_pos.

        A reusing layer reads the storing layer's cache, which already holds this step's rows.
        """
        src = self.layers[self.infos[i].kv_source]
        self._check_cache(i, "reads K/V", src.k_cache)
        self._check_cache(i, "reads K/V", src.v_cache)
        return src.k_cache, src.v_cache
