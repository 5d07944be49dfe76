"""The static runtime's building blocks, plain functions: Gemma 4's RMSNorm, RoPE and activations,
the chunked prefill's plan, and what the runtime allocates for a max_seq. Plug-ins may use them
(docs/runtime-api.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemma4_trace.hf.memory import config_dims
from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces.errors import TraceToolError

SUPPORTED_ROPE = ("default", "proportional")

# chunked prefill: the default chunk, used once max_seq reaches CHUNK_FROM (a prefill over the
# whole max_seq holds max_seq x max_seq scores per head, 256 MiB per head at 8192)
DEFAULT_PREFILL_CHUNK = 256
CHUNK_FROM = 1024


def resolve_prefill_chunk(chunk: int | None, max_seq: int) -> int | None:
    """--prefill-chunk N -> the rows per prefill step (None: one step over the whole max_seq).

    Not given: DEFAULT_PREFILL_CHUNK when max_seq >= CHUNK_FROM, else the whole max_seq.
    0 or N >= max_seq: the whole max_seq.
    """
    if chunk is None:
        chunk = DEFAULT_PREFILL_CHUNK if max_seq >= CHUNK_FROM else 0
    if chunk < 0:
        raise TraceToolError(f"--prefill-chunk must be >= 0, got {chunk}")
    return None if chunk == 0 or chunk >= max_seq else chunk


def memory_estimate(cfg, max_seq: int, dtype_bytes: int, prefill_chunk: int | None = None) -> int:
    """What the runtime allocates beyond the weights for `max_seq` (a config dict or an HF config):
    all layers' KV caches, RoPE tables, and one prefill chunk (its masks, attention scores over
    max_seq keys, activations) of the size resolve_prefill_chunk gives."""
    d, s = config_dims(cfg), int(max_seq)
    chunk = resolve_prefill_chunk(prefill_chunk, s) or s  # rows of one prefill pass
    caches = d["L"] * 2 * d["kv"] * s * d["hd"] * dtype_bytes
    masks = 4 * chunk * s  # a step's masks, computed from positions, and their temporaries
    rope = 4 * s * d["hd"] * (4 + dtype_bytes)
    scores = 3 * d["heads"] * chunk * s * max(dtype_bytes, 4)
    activations = chunk * (4 * d["H"] + 3 * d["I"] + d["L"] * d["ple"]) * max(dtype_bytes, 4)
    return caches + masks + rope + scores + activations


def check_fits(loaded, max_seq: int) -> None:
    """Refuse a static runtime that cannot fit in memory before it allocates (one line)."""
    dtype_bytes = 2 if "16" in str(getattr(loaded, "dtype", "float32")) else 4
    LIM.check_fits(
        memory_estimate(loaded.text_config, max_seq, dtype_bytes), f"the static runtime for max_seq {max_seq}"
    )


# ----------------------------------------------------------------------------- math
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm: float32 compute, times `weight` (not 1 + weight); no scale if weight is None."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (1, n, heads, D); cos/sin (1, n, D)
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


def rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) for one layer type's rope_parameters."""
    rope_type = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    factor = float(params.get("factor", 1.0) or 1.0)
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "proportional":
        # frequencies use the FULL head_dim as denominator and are zero past the rotated part
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        inv = torch.cat([rotated, torch.zeros(head_dim // 2 - angles)])
        return inv / factor
    raise TraceToolError(f"rope_type {rope_type!r} is not supported by the static runtime (only {SUPPORTED_ROPE})")


ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


# ----------------------------------------------------------------------------- chunked prefill
def chunk_plan(T: int, N: int, S: int, block_ids: torch.Tensor | None = None) -> list[tuple[int, slice]]:
    """[(first position c0, rows of the chunk that are new prompt rows)] for a T-token prompt in
    chunks of N rows over max_seq S.

    Every chunk is a full (N, S) step: the last one starts at S - N when it would run past S
    (its leading rows are then recomputed, and only its new rows reported). With bidirectional
    vision masks a query sees later keys of its own image, so an image is never split: a chunk
    that would end inside one stops before it, and the next chunk recomputes it whole.
    """
    plan, s = [], 0
    while s < T:
        c0 = min(s, S - N)
        stop = min(c0 + N, T)
        if block_ids is not None and stop < T and block_ids[stop] >= 0 and block_ids[stop] == block_ids[stop - 1]:
            first = int((block_ids == block_ids[stop]).nonzero()[0])
            if first <= s:
                n_img = int((block_ids == block_ids[stop]).sum())
                raise TraceToolError(
                    f"--prefill-chunk {N} is shorter than an image of {n_img} soft tokens; use a chunk >= {n_img}"
                )
            stop = first
        plan.append((c0, slice(s - c0, stop - c0)))
        s = stop
    return plan


class ChunkProbe:
    """Collects a chunked prefill's reports per (kind, layer) and hands each on once, whole.

    The trace writer takes one block of rows per kind and step; chunks report slices of it.
    """

    def __init__(self, probe):
        self.probe, self.parts = probe, {}

    def tensor(self, kind: str, value, layer: int | None = None):
        self.parts.setdefault((kind, layer), []).append(value)
        return None

    def flush(self) -> None:
        for (kind, layer), parts in self.parts.items():
            self.probe.tensor(kind, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0), layer=layer)


def image_blocks(mm_token_type_ids):
    """Each position's image (0, 1, ...) or -1 for text, from mm_token_type_ids (1 or 2: vision), as
    HF's get_block_sequence_ids_for_mask numbers them."""
    import numpy as np

    vision = (mm_token_type_ids == 1) | (mm_token_type_ids == 2)
    starts = vision & ~np.concatenate([[False], vision[:-1]])
    return np.where(vision, np.cumsum(starts) - 1, -1)


class ClippedLinear(nn.Module):
    """A (possibly clipped) linear's weight and clamp bounds, as views of the HF module's tensors
    (Gemma 4's encoders' Gemma4ClippableLinear: the static vision and audio ports)."""

    def __init__(self, hf):
        super().__init__()
        self.register_buffer("weight", hf.linear.weight.detach(), persistent=False)
        self.clipped = bool(getattr(hf, "use_clipped_linears", False))
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, getattr(hf, name).detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = F.linear(x, self.weight)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y
