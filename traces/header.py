"""What a trace says about its run before any tensor: the typed header the writer takes whole.

`TraceHeader` holds the provenance, the prompt, the model's per-layer metadata and the encoder
towers recorded;
`TraceWriter.write_header(header)` writes it, `TraceReader.header()` reads it back (so a
trace's header is copied, with changes, by `dataclasses.replace` or `with_provenance`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import schema as S
from .layers import LayerInfo, TowerInfo


@dataclass(frozen=True)
class Provenance:
    """Who made the trace, how, from which model: the root attributes schema.PROVENANCE_KEYS names."""

    creator_version: str
    torch_version: str
    transformers_version: str
    h5py_version: str
    dtype: str
    device: str
    runtime: str
    mode: str  # one of schema.MODES
    model_name: str
    model_config: dict | str  # the model config, or its JSON text (as a trace stores it)
    model_config_sha256: str

    def __post_init__(self) -> None:
        if self.mode not in S.MODES:
            raise ValueError(f"mode {self.mode!r} not in {S.MODES}")

    @classmethod
    def from_dict(cls, d: Mapping) -> Provenance:
        """From a mapping with every key of schema.PROVENANCE_KEYS (others are ignored)."""
        missing = [k for k in S.PROVENANCE_KEYS if k not in d]
        if missing:
            raise ValueError(f"provenance lacks {missing}")
        return cls(**{k: d[k] for k in S.PROVENANCE_KEYS})

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in S.PROVENANCE_KEYS}

    def attrs(self) -> dict[str, str]:
        """The root attributes' texts: a config given as a dict becomes sorted JSON."""
        return {k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v) for k, v in self.to_dict().items()}

    def replace(self, **changes) -> Provenance:
        return dataclasses.replace(self, **changes)


# the fields are the schema's names, in the schema's order (an internal invariant)
assert tuple(f.name for f in dataclasses.fields(Provenance)) == S.PROVENANCE_KEYS


@dataclass(frozen=True, eq=False)
class TraceHeader:
    """Everything a trace holds besides its steps and tensors."""

    provenance: Provenance
    prompt_ids: np.ndarray  # (T,) int64: raw prompt ids, image tokens kept
    layers: tuple[LayerInfo, ...]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    prompt_text: str = ""
    chat_template_applied: bool = False
    extra_inputs: Mapping[str, np.ndarray] = field(default_factory=dict)  # model inputs besides ids
    towers: tuple[TowerInfo, ...] = ()  # encoder towers recorded (schema version 2); () for a text-only trace
    max_seq: int | None = None  # a replay's runtime positions (its KV cache); None in a recording

    def __post_init__(self) -> None:
        if not isinstance(self.provenance, Provenance):
            raise TypeError(f"provenance must be a Provenance, got {type(self.provenance).__name__}")
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "prompt_ids", np.asarray(self.prompt_ids, dtype=np.int64).reshape(-1))
        set_(self, "layers", tuple(self.layers))
        set_(self, "max_new_tokens", int(self.max_new_tokens))
        if self.max_seq is not None:
            set_(self, "max_seq", int(self.max_seq))
        set_(self, "eos_token_ids", tuple(sorted(set(int(e) for e in self.eos_token_ids))))
        set_(self, "extra_inputs", dict(self.extra_inputs or {}))
        unknown = [t.name for t in self.towers if t.name not in S.ENCODER_TOWERS]
        if unknown:
            raise ValueError(f"no encoder tower {unknown[0]!r} (known: {', '.join(S.ENCODER_TOWERS)})")
        set_(self, "towers", tuple(sorted(self.towers, key=lambda t: S.ENCODER_TOWERS.index(t.name))))
        if len({t.name for t in self.towers}) != len(self.towers):
            raise ValueError("a trace header names each encoder tower once")
        if not self.layers:
            raise ValueError("a trace header needs the model's layers")

    def with_provenance(self, provenance: Provenance | Mapping) -> TraceHeader:
        """This header with another provenance (a Provenance, or a mapping of its keys)."""
        p = provenance if isinstance(provenance, Provenance) else Provenance.from_dict(provenance)
        return dataclasses.replace(self, provenance=p)
