"""The trace format: the only package that knows HDF5 names. No torch, no transformers."""

from .errors import TraceCorruptError, TraceFileError, TraceToolError
from .header import Provenance, TraceHeader
from .layers import LayerInfo, layer_infos_from_config
from .reader import TraceReader
from .schema import KIND_NAMES, KINDS, SCHEMA_NAME, SCHEMA_VERSION
from .writer import TraceWriter

__all__ = [
    "KINDS",
    "KIND_NAMES",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "LayerInfo",
    "Provenance",
    "TraceCorruptError",
    "TraceFileError",
    "TraceHeader",
    "TraceReader",
    "TraceToolError",
    "TraceWriter",
    "layer_infos_from_config",
]
