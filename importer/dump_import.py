"""`trace import`: build a candidate trace from a folder of dumped tensors (docs/import.md).

Many NPU toolchains cannot run Python inside the runtime but can dump intermediate tensors
to files. A map (TOML, mapfile.py) says which file holds which canonical kind at which step
and layer (an encoder tower's kind: all its rows, made in the prefill, in one file per layer),
and how the file's layout maps to ours; files.py reads the files with numpy only
(no torch) and this module checks each file's layout against what the reference justifies,
converts it to canonical rows and writes them with TraceWriter (atomic output). The header
(inputs, provenance, per-layer metadata) comes from the reference trace.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass

import numpy as np

from gemma4_trace.traces import limits as LIM
from gemma4_trace.traces import rows as R
from gemma4_trace.traces import schema as S
from gemma4_trace.traces.atomic import check_output_path
from gemma4_trace.traces.reader import TraceReader
from gemma4_trace.traces.writer import TraceWriter

from . import files as F
from .mapfile import Entry, fail, load_map, row_axes

ADDITIVE_ALLOWED_ABOVE = -1.0  # additive masks: 0 where allowed, a large negative number (or -inf) where not


# ---------------------------------------------------------------- to canonical rows
@dataclass
class Layout:
    """Where a file's rows are: checked from its shape alone, before any of its data is read."""

    dropped: tuple[int, ...]  # the size-1 axes '_'
    order: list[int]  # the kept axes, permuted to (pos?, *row axes)
    rows: slice | None  # this step's rows on the pos axis (None: the file has no pos axis)
    pos_rows: int  # size of the pos axis (0 when none)


def layout(shape: tuple, dtype: str, e: Entry, fields: dict, src: Source, what: str) -> Layout:
    """Check a stored shape and dtype against the map and what the reference justifies for the kind
    (src.expect: the exact row shape; src.limit: the values one row may hold)."""
    spec = S.KIND_BY_NAME[e.kind]
    if e.dtype is not None and dtype != e.dtype:
        fail(f"{what}: dtype {dtype}, but the map says {e.dtype}")
    if e.shape is not None:
        want = tuple(fields[x] if isinstance(x, str) else x for x in e.shape)
        if tuple(shape) != want:
            fail(f"{what}: shape {list(shape)}, but the map says {list(want)}")
    if len(shape) != len(e.axes):
        fail(f"{what}: has {len(shape)} axes {list(shape)}, but the map names {len(e.axes)}: {list(e.axes)}")
    floating = dtype.startswith(("float", "bfloat"))
    if spec.dtype == "float" and not floating:
        fail(f"{what}: dtype {dtype}; {e.kind} needs floating-point data")
    if spec.dtype == "int" and not dtype.startswith(("int", "uint")):
        fail(f"{what}: dtype {dtype}; {e.kind} needs integer data")
    if e.kind == "mask" and e.values == "additive" and not floating:
        fail(f"{what}: dtype {dtype}; an additive mask needs floating-point data")
    for name, size in zip(e.axes, shape):
        if name == "_" and size != 1:
            fail(f"{what}: axis '_' (dropped) has size {size}, expected 1 (shape {list(shape)})")
    keep = [i for i, a in enumerate(e.axes) if a != "_"]
    names = [e.axes[i] for i in keep]
    size = dict(zip(names, (shape[i] for i in keep)))
    canon = list(row_axes(e.kind))
    row = [size[a] for a in canon]
    rows, pos_rows = None, 0
    if "pos" in names:
        start, stop, n = fields["start"], fields["stop"], fields["n"]
        if e.per_position:  # one position per file: the pos axis holds that row (rows as for a step of 1)
            start, stop, n = fields["position"], fields["position"] + 1, 1
        if spec.by_step:  # logits/token at the step's last position
            a = {"step": n - 1, "padded": n - 1, "absolute": stop - 1}[e.rows]
            b = a + 1
        else:
            a, b = {"step": (0, n), "padded": (0, n), "absolute": (start, stop)}[e.rows]
        pos_rows = size["pos"]
        if (e.rows == "step" and pos_rows != n) or pos_rows < b:
            fail(f"{what}: {pos_rows} rows on axis 'pos', expected {_rows_needed(spec, e.rows, n, b)}")
        rows = slice(a, b)
    if src.expect is not None and tuple(row) != tuple(src.expect):
        fail(f"{what}: rows of shape {row} after the map's layout, expected {list(src.expect)} for {e.kind}")
    if math.prod(row) > src.limit:
        fail(
            f"{what}: rows of shape {row} after the map's layout; the reference's model allows at most "
            f"{src.limit} values in a {e.kind} row"
        )
    order = [names.index(x) for x in (["pos"] if rows is not None else []) + canon]
    return Layout(tuple(i for i in range(len(shape)) if i not in keep), order, rows, pos_rows)


def _rows_needed(spec: S.Kind, rows: str, n: int, b: int) -> str:
    """The rows a file's 'pos' axis must hold, in words (b: the end of the rows taken)."""
    if spec.encoder:
        whose = f"one per {R.row_word(spec)} of REF's {spec.tower} tower"
        return f"{n} ({whose})" if rows == "step" else f">= {n} ({whose}, then padding)"
    return {
        "step": f"{n} (the rows fed at this step)",
        "padded": f">= {b} (padded)",
        "absolute": f">= {b} (indexed by absolute position)",
    }[rows]


def take(arr: np.ndarray, lay: Layout, dtype: str, e: Entry) -> np.ndarray:
    """The step's canonical rows of a (possibly memory-mapped) array: only those rows are read."""
    spec = S.KIND_BY_NAME[e.kind]
    arr = arr.squeeze(axis=lay.dropped).transpose(lay.order) if lay.dropped else arr.transpose(lay.order)
    if lay.rows is not None:
        arr = arr[lay.rows]
        if spec.by_step:
            arr = arr[0]
    elif spec.by_position:
        arr = arr[None]
    arr = F.bf16_to_f32(arr) if dtype == "bfloat16" else np.asarray(arr).astype(np.dtype(dtype))
    if e.kind == "mask":
        arr = arr > ADDITIVE_ALLOWED_ABOVE if e.values == "additive" else arr != 0
    return np.ascontiguousarray(arr)


# ---------------------------------------------------------------- the import
@dataclass
class Source:
    entry: Entry
    layer: int | None
    expect: tuple | None  # canonical row shape (None: not checked, e.g. mask widths)
    limit: int  # values one row may hold (limits.row_limits: what REF's model config justifies)
    files: dict | None = None  # step -> [(relative name, fields)], once found present
    count: int | None = None  # an encoder kind: the rows REF's tower declares (all made in the prefill)


def _sources(entries: list[Entry], ref: TraceReader, where: str) -> list[Source]:
    limits = LIM.row_limits(ref.model_config, ref.layers, ref.towers)
    out, seen = [], {}
    for e in entries:
        spec = S.KIND_BY_NAME[e.kind]
        count = R.row_count(spec, ref.n_positions, ref.n_steps, ref.towers) if spec.encoder else None
        if spec.encoder and count is None:
            fail(f"{where}: kind {e.kind}: REF records no {spec.tower} tower (its towers: {_towers(ref)})")
        for i in _layers_of(e, spec, ref, where):
            if (e.kind, i) in seen:
                fail(f"{where}: kind {e.kind}{'' if i is None else f' layer {i}'} is mapped twice")
            seen[(e.kind, i)] = True
            out.append(Source(e, i, _expected_row(spec, i, ref), limits[e.kind], count=count))
    return out


def _towers(ref: TraceReader) -> str:
    return ", ".join([*ref.towers, S.TEXT])


def _layers_of(e: Entry, spec: S.Kind, ref: TraceReader, where: str) -> list[int | None]:
    """The layers an entry maps (its `layers`, or every layer of its tower that has the kind), checked."""
    if not S.layered(e.kind):
        return [None]
    if spec.encoder:
        n = ref.towers[spec.tower].layers
        owners, has = list(range(n)), f"the {spec.tower} tower has {n} layers"
    else:
        n, has = len(ref.layers), f"the model has {len(ref.layers)} layers"
        owners = [i for i, li in enumerate(ref.layers) if e.kind not in ("k", "v") or li.kv_role != "reuses"]
    layers = e.layers if e.layers is not None else owners
    for i in layers:
        if i >= n:
            fail(f"{where}: kind {e.kind} names layer {i}; {has}")
        if i not in owners:
            fail(
                f"{where}: kind {e.kind} names layer {i}, which reuses layer "
                f"{ref.layers[i].kv_source}'s K/V and writes none"
            )
    return layers


def _expected_row(spec: S.Kind, layer: int | None, ref: TraceReader) -> tuple | None:
    kind = spec.key
    if kind == "mask":
        return None  # any key width: columns past it read as "not allowed"
    if spec.encoder and spec.name in ("q", "k", "v"):
        info = ref.towers[spec.tower]
        return (info.heads, info.head_dim)
    if kind in ("q", "k", "v"):
        li = ref.layers[layer]
        return (li.num_heads if kind == "q" else li.num_kv_heads, li.head_dim)
    if ref.has(kind, layer):
        return tuple(ref.dataset(kind, layer).shape[1:])
    return None


def _pattern_regex(e: Entry) -> re.Pattern:
    """The file pattern as a regular expression over names in the folder: each number field a run of
    digits (the map check puts a non-digit between them), {kind} the entry's kind."""
    out, seen = [], set()
    for lit, name, _spec, _conv in string.Formatter().parse(e.file):
        out.append(re.escape(lit))
        if name == "kind":
            out.append(re.escape(e.kind))
        elif name in seen:
            out.append(r"\d+")
        elif name is not None:
            seen.add(name)
            out.append(f"(?P<{name}>\\d+)")
    return re.compile("".join(out))


def _layers_found(folder: F.DumpFolder, entries: list[Entry]) -> list[dict]:
    """For each entry, layer (None: its pattern has no {layer}) -> a name in the folder that matches:
    one pass over the folder's listing, so the search costs what the folder holds, not what REF's
    positions and layers could name. An encoder kind's file of a step other than the prefill is refused."""
    regexes = [_pattern_regex(e) for e in entries]
    encoder = [S.KIND_BY_NAME[e.kind].encoder for e in entries]
    found: list[dict] = [{} for _ in entries]
    for name in sorted(folder.names):
        for i, rx in enumerate(regexes):
            m = rx.fullmatch(name)
            if not m:
                continue
            if encoder[i] and int(m.groupdict().get("step") or 0) != 0:
                fail(
                    f"{folder.shown(name)}: a file of kind {entries[i].kind} at step {int(m['step'])}; an encoder "
                    "tower's rows are all made in the prefill, so its files are step 0's only"
                )
            found[i].setdefault(int(m["layer"]) if "layer" in rx.groupindex else None, name)
    return found


class _Import:
    """The state one import shares between its parts: the dump folder, the map, REF and the positions
    of each step."""

    def __init__(self, folder: F.DumpFolder, m: dict, map_path, ref: TraceReader):
        self.folder, self.m, self.map_path, self.ref = folder, m, map_path, ref
        self.sources = _sources(m["entries"], ref, f"map {map_path}")
        self.n_steps = m["steps"] or ref.n_steps
        if self.n_steps > ref.max_new_tokens:
            fail(f"map {map_path}: steps {self.n_steps} exceeds REF's max_new_tokens {ref.max_new_tokens}")
        T = ref.prompt_len
        self.positions = [(0, T)] + [(T + s - 1, T + s) for s in range(1, self.n_steps)]
        self.whole_rows = LIM.ROW_SLACK * (T + ref.max_new_tokens)  # pos rows of a file read whole (npz)

    def fields_of(self, step: int, layer, kind: str, pos: int | None = None, count: int | None = None) -> dict:
        """A file's pattern fields; an encoder kind's (`count` rows) are its rows: start 0, stop and n count."""
        a, b = self.positions[step] if count is None else (0, count)
        return dict(
            step=step,
            layer=layer if layer is not None else 0,
            kind=kind,
            start=a,
            stop=b,
            n=b - a,
            position=a if pos is None else pos,
        )

    def candidates(self, src: Source):
        """(step, relative name, fields) of every file the source needs, in order (an encoder kind: the
        prefill's file alone)."""
        for step, (a, b) in enumerate(self.positions[:1] if src.count is not None else self.positions):
            for p in range(a, b) if src.entry.per_position else [None]:
                f = self.fields_of(step, src.layer, src.entry.kind, p, src.count)
                yield step, src.entry.file.format(**f), f

    # ------------------------------------------------------------ which files
    def resolve(self) -> tuple[list[Source], list[Source]]:
        """(present, absent): a (kind, layer) is imported when its files exist for every step, absent
        when none exist; some but not all is an error."""
        found = _layers_found(self.folder, self.m["entries"])
        entry_index = {id(e): i for i, e in enumerate(self.m["entries"])}
        present, absent = [], []
        for src in self.sources:
            has_layer = "layer" in {name for _l, name, _s, _c in string.Formatter().parse(src.entry.file)}
            example = found[entry_index[id(src.entry)]].get((src.layer or 0) if has_layer else None)
            if example is None:
                absent.append(src)
                continue
            self._list_files(src, example)
            present.append(src)
        if not present:
            _step, first, _f = next(self.candidates(self.sources[0]))
            fail(
                f"dump folder {self.folder.path}: no file matches any pattern of map {self.map_path} "
                f"(e.g. {self.folder.shown(first)})"
            )
        return present, absent

    def _list_files(self, src: Source, example: str) -> None:
        """Fill src.files with every file the source needs; fail at the first one missing."""
        folder = self.folder
        src.files = {}
        for step, rel, f in self.candidates(src):
            if rel not in folder.names:
                other = (
                    "other steps of it exist"
                    if src.files
                    else f"files matching its pattern exist (e.g. {folder.shown(example)})"
                )
                fail(
                    f"{folder.shown(rel)}: missing (kind {src.entry.kind}"
                    f"{'' if src.layer is None else f' layer {src.layer}'}, step {step}); {other}"
                )
            src.files.setdefault(step, []).append((rel, f))

    # ------------------------------------------------------------ one file
    def rows_of(self, src: Source, rel: str, f: dict) -> tuple[np.ndarray, str]:
        """One file's canonical rows and its dtype, its layout checked before its data is read."""
        e, shown = src.entry, self.folder.shown(rel)
        key = e.key.format(**f) if e.key else None
        check = self._checker(src, f)
        with self.folder.open(rel) as fh:
            if e.format == "raw":
                shape = tuple(f[x] if isinstance(x, str) else x for x in e.shape)
                arr, dtype, lay = F.read_raw(fh, shown, e, shape, check)
            elif e.format == "npy":
                arr, dtype, lay = F.read_npy(fh, shown, check)
            elif e.format == "npz":
                arr, dtype, lay = F.read_npz(fh, shown, key, check)
            else:
                arr, dtype, lay = F.read_safetensors(fh, shown, key, check)
            return take(arr, lay, dtype, e), dtype

    def _checker(self, src: Source, f: dict):
        """The layout check a reader calls with a file's header facts (whole: the data is inflated whole)."""
        whole_rows, of = self.whole_rows, "REF's positions"
        if src.count is not None and LIM.ROW_SLACK * src.count > whole_rows:
            whole_rows, of = LIM.ROW_SLACK * src.count, "its tower's rows"

        def check(shape, dtype, what, whole):
            lay = layout(shape, dtype, src.entry, f, src, what)
            if whole and lay.pos_rows > whole_rows:
                fail(
                    f"{what}: {lay.pos_rows} rows on axis 'pos'; an .npz member is inflated whole, so it may "
                    f"hold at most {whole_rows} (4x {of}); store a longer buffer as .npy or raw"
                )
            return lay

        return check

    # ------------------------------------------------------------ header
    def token_source(self, present: list[Source], ref_tokens: list[int]) -> str:
        """Where the candidate's tokens come from, in words."""
        mapped = {s.entry.kind for s in present}
        if self.m["mode"] == "free-running" and not mapped & {"token", "logits"}:
            fail(f"map {self.map_path}: a free-running dump needs token or logits files (its tokens are its own)")
        if "token" in mapped:
            return "dump"
        if "logits" in mapped:
            return "argmax of the dumped logits"
        if self.n_steps > len(ref_tokens):
            fail(f"map {self.map_path}: steps {self.n_steps} but REF has {len(ref_tokens)} tokens to copy")
        return "REF (no token or logits in the dump)"

    def provenance(self) -> dict:
        """REF's provenance with the dump's runtime, mode, device and dtype and this package's versions."""
        from importlib.metadata import version

        import h5py

        m = self.m
        prov = dict(self.ref.provenance)
        prov.update(
            runtime=m["runtime"],
            mode=m["mode"],
            creator_version=version("gemma4-trace"),
            device=m["device"],
            dtype=m["dtype"] or prov["dtype"],
            torch_version="n/a (import)",
            transformers_version="n/a (import)",
        )
        prov["h5py_version"] = h5py.__version__
        return prov

    # ------------------------------------------------------------ the steps
    def write_step(self, w: TraceWriter, step: int, present: list[Source], ref_tokens: list[int]) -> int:
        """Write one step's rows and token; return the token."""
        a, b = self.positions[step]
        w.begin_step(range(a, b))
        got = {}
        for src in present:
            if step not in src.files:  # an encoder kind after the prefill
                continue
            rows, src_dtype = self._step_rows(src, step)
            if src.entry.kind in ("logits", "token"):
                got[src.entry.kind] = (rows, src_dtype)
                continue
            spec = S.KIND_BY_NAME[src.entry.kind]
            try:
                w.add(spec.name, rows, layer=src.layer, source_dtype=src_dtype, tower=spec.tower)
            except ValueError as ex:  # a row shape that changed between steps
                fail(f"{self.folder.shown(src.files[step][0][0])}: {ex}")
        if "logits" in got:
            w.add("logits", got["logits"][0], source_dtype=got["logits"][1])
        if "token" in got:
            token = int(np.asarray(got["token"][0]).reshape(-1)[0])
        elif "logits" in got:
            token = int(np.argmax(got["logits"][0]))
        else:
            token = ref_tokens[step]
        w.add("token", token)
        w.end_step()
        return token

    def _step_rows(self, src: Source, step: int) -> tuple[np.ndarray, str | None]:
        """A source's rows at one step (per-position files joined) and the dtype of its last file."""
        blocks, src_dtype = [], None
        for rel, f in src.files[step]:
            block, src_dtype = self.rows_of(src, rel, f)
            blocks.append(block)
        return (np.concatenate(blocks) if src.entry.per_position else blocks[0]), src_dtype


def import_dump(dump_dir, reference, map_path, output, *, force: bool = False) -> str:
    """Write OUTPUT from the dump; return a one-line summary."""
    folder = F.DumpFolder(dump_dir)
    check_output_path(output, force, inputs=(reference, map_path))  # never over an input, even with --force
    m = load_map(map_path)
    with TraceReader(reference) as ref:
        imp = _Import(folder, m, map_path, ref)
        present, absent = imp.resolve()
        read = sorted({folder.shown(rel) for src in present for fs in src.files.values() for rel, _f in fs})
        check_output_path(output, force, inputs=(reference, map_path, *read))  # no dump file either
        ref_tokens = [int(t) for t in ref.tokens()]
        token_from = imp.token_source(present, ref_tokens)
        prov = imp.provenance()
        with TraceWriter(output, force=force) as w:
            w.write_header(ref.header().with_provenance(prov))
            tokens = [imp.write_step(w, step, present, ref_tokens) for step in range(imp.n_steps)]
    return _summary(output, folder.path, imp.n_steps, present, absent, token_from, tokens, ref_tokens)


def _summary(output, dump, n_steps: int, present, absent, token_from: str, tokens, ref_tokens) -> str:
    kinds = sorted({s.entry.kind for s in present}, key=S.ALL_KIND_KEYS.index)
    miss = sorted({s.entry.kind for s in absent} - set(kinds), key=S.ALL_KIND_KEYS.index)
    agree = sum(x == y for x, y in zip(tokens, ref_tokens))
    return (
        f"wrote {output}: {n_steps} steps from {dump} ({len(present)} tensors: {', '.join(kinds)}"
        + (f"; absent: {', '.join(miss)}" if miss else "")
        + f"), tokens from {token_from}, {agree}/{len(tokens)} agree with the reference"
    )
