"""Trust of the graph files `trace diff --node-data OUT --graph FILE` reads to place the overlay:
a `.pt2` is read from its archive's JSON parts alone (nothing in it is unpickled or run), within
bounds; every damaged or hostile archive is one line, exit 2, and no overlay written.
docs/robustness.md, "Threat model"."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import pytest

from tests.support.cli import invoke, one_line_error

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "traces" / "golden" / "short.h5"


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """The embedded model's decode step as `trace export-pt2` writes it."""
    out = tmp_path_factory.mktemp("pt2")
    r = invoke("export-pt2", "--max-seq", 8, "-o", out)
    assert r.exit_code == 0, r.output
    return out / "decode.pt2"


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of the archive src with change(name, bytes) -> bytes | None (None: left out) per entry."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for info in a.infolist():
            data = change(info.filename, a.read(info))
            if data is not None:
                b.writestr(info.filename, data)
    return dst


class Marker:
    """Unpickling this touches `path`: proof that code in the archive ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def diff(graph: Path, nd: Path):
    return invoke("diff", GOLDEN, GOLDEN, "--node-data", nd, "--graph", graph)


@pytest.mark.parametrize("where", ["sample inputs", "a constant"])
def test_a_program_whose_pickles_would_run_code_is_read_without_running_them(program, tmp_path, where):
    """The sample inputs (a legacy pickle here) and a constant marked `use_pickle` are what
    torch.export.load unpickles: the overlay is made from the graph's JSON and the marker file
    is never created."""
    marker = tmp_path / "ran"
    evil = pickle.dumps(Marker(marker))
    constant = ""

    def change(name, data):
        nonlocal constant
        if where == "sample inputs":
            return evil if name.endswith("sample_inputs/model.pt") else data
        if name.endswith("model_constants_config.json"):  # the first constant, marked as a pickle
            cfg = json.loads(data)
            entry = next(iter(cfg["config"].values()))
            entry["use_pickle"], constant = True, entry["path_name"]
            return json.dumps(cfg).encode()
        return data

    graph = rewrite(program, tmp_path / "decode.pt2", change)
    if where == "a constant":  # its data file, now a pickle (the config is written before it in the archive)
        graph = rewrite(graph, tmp_path / "evil.pt2", lambda n, b: evil if n.endswith(f"constants/{constant}") else b)
    nd = tmp_path / "nd.json"
    r = diff(graph, nd)
    assert not marker.exists(), "code in the .pt2 ran"
    assert r.exit_code == 0, r.output
    results = json.loads(nd.read_text())["graph"]["results"]
    assert len(results) == 50 and all(v["value"] == 0 for v in results.values())


def names(edit):
    """A change of the outputs' names entry: edit(list) -> a JSON value."""
    return lambda n, b: json.dumps(edit(json.loads(b))).encode() if "/extra/" in n else b


def graph(edit):
    """A change of the serialized graph entry: edit(bytes) -> bytes."""
    return lambda n, b: edit(b) if n.endswith("models/model.json") else b


HOSTILE = {
    "not a zip": lambda p, d: d.write_bytes(b"PK\x03\x04" + b"\0" * 100),
    "truncated": lambda p, d: d.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "no graph": lambda p, d: rewrite(p, d, lambda n, b: None if n.endswith("model.json") else b),
    "no outputs' names": lambda p, d: rewrite(p, d, lambda n, b: None if "/extra/" in n else b),
    "names not a list": lambda p, d: rewrite(p, d, names(lambda v: {"a": 1})),
    "one name short": lambda p, d: rewrite(p, d, names(lambda v: v[:-1])),
    "names not strings": lambda p, d: rewrite(p, d, names(lambda v: [[1]] * len(v))),
    "an unknown output": lambda p, d: rewrite(p, d, names(lambda v: ["L99.nothing"] * len(v))),
    "graph not JSON": lambda p, d: rewrite(p, d, graph(lambda b: b"\xff{")),
    "graph nested deep": lambda p, d: rewrite(p, d, graph(lambda b: b"[" * 200_000 + b"]" * 200_000)),
    "specs without names": lambda p, d: rewrite(p, d, graph(lambda b: b.replace(b'{"name"', b'{"nam"'))),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_damaged_or_hostile_program_is_one_line(program, tmp_path, case):
    graph = tmp_path / "decode.pt2"
    HOSTILE[case](program, graph)
    nd = tmp_path / "nd.json"
    one_line_error(diff(graph, nd), "decode.pt2", out=nd)


def test_a_program_over_the_bounds_is_refused_before_it_is_read(program, tmp_path, monkeypatch):
    """Many entries, or a graph entry larger than the bound (as its header says, or as it inflates)."""
    from gemma4_trace.replayer import node_data

    nd = tmp_path / "nd.json"
    many = tmp_path / "many.pt2"
    with zipfile.ZipFile(many, "w") as z:
        for i in range(node_data.PT2_MAX_ENTRIES + 1):
            z.writestr(f"decode/data/x{i}", b"")
    one_line_error(diff(many, nd), "over 65536 files", out=nd)
    monkeypatch.setattr(node_data, "PT2_MAX_JSON", 1000)  # the real graph (about 1 MiB) is then over the bound
    one_line_error(diff(program, nd), "model.json", out=nd)
    lying = tmp_path / "lying.pt2"  # a header that says 10 bytes for an entry that inflates to 1 MiB
    with zipfile.ZipFile(program) as z:
        size = next(i for i in z.infolist() if i.filename.endswith("models/model.json")).file_size
    assert size > 1000
    raw = program.read_bytes().replace(size.to_bytes(4, "little"), (10).to_bytes(4, "little"))  # both headers
    lying.write_bytes(raw)
    one_line_error(diff(lying, nd), "lying.pt2", out=nd)
