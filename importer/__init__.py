"""`trace import`: a candidate trace from a folder of dumped tensors (docs/import.md). numpy and
h5py only (no torch): it runs where an NPU toolchain runs."""

from .dump_import import import_dump

__all__ = ["import_dump"]
