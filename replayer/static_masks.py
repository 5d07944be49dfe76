"""The static runtime's attention masks (replayer/runtime.py), computed per step from positions.

allowed[query, key] booleans (1, n, max_seq) per layer type: causal, on sliding layers within the
window, padding keys never visible in prefill, and with use_bidirectional_attention == "vision" the
sliding layers' image blocks bidirectional. No (max_seq, max_seq) table is kept: it would be the one
thing whose memory grows with max_seq squared. `_prefill_masks` and `_decode_masks` are seams a
derived runtime overrides (tests/support/bug_zoo.py).
"""

from __future__ import annotations

import torch


class StaticMasks:
    """Part of StaticGemma4Runtime: the masks of a step (reads max_seq, window, types, bidir_vision)."""

    def _prefill_masks(self, input_pos, valid, block_ids) -> dict:
        """{layer type: allowed (1, n, S)} for the n queries at input_pos (n,) of the padded
        prompt; valid (S,): keys that are prompt, padding keys are never visible."""
        masks = {"full_attention": self._mask_rows("full_attention", input_pos) & valid[None, :]}
        sliding = self._mask_rows("sliding_attention", input_pos)
        if self.bidir_vision:
            # sliding layers: window AND (causal OR same image block); full layers stay causal
            q_block = block_ids[input_pos]
            same = (q_block[:, None] == block_ids[None, :]) & (q_block[:, None] >= 0)
            keys = torch.arange(self.max_seq, device=input_pos.device)
            window = keys[None, :] > input_pos[:, None] - self.window
            sliding = sliding | (same & window)
        masks["sliding_attention"] = sliding & valid[None, :]
        return {t: m[None] for t, m in masks.items()}  # (1, n, S)

    def _decode_masks(self, input_pos) -> dict:
        """{layer type: allowed (1, 1, S)} for one query at input_pos (1,)."""
        return {t: self._mask_rows(t, input_pos)[None] for t in self.types}

    def _mask_rows(self, layer_type: str, input_pos: torch.Tensor) -> torch.Tensor:
        """allowed[query, key] (n, max_seq) for the queries at input_pos (n,): causal, and on sliding
        layers within the window (key k visible from query q iff q - window < k <= q)."""
        keys = torch.arange(self.max_seq, device=input_pos.device)[None, :]
        q = input_pos[:, None]
        allowed = keys <= q
        if layer_type == "sliding_attention":
            allowed = allowed & (keys > q - self.window)
        return allowed
