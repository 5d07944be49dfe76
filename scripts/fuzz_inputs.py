"""Fuzz the inputs that are not traces: GGUF files, recipes and sweep prompt files (docs/robustness.md).

Each case is a seeded mutation of a valid input, run through the command that reads it, in-process
through click's CliRunner with GEMMA4_TRACE_DEBUG=1 (a bug of ours escapes as an exception):

- `gguf`: the tiny model exported by `trace export-gguf`, its header region changed (one to three
  fields of 1, 2, 4 or 8 bytes set to edge values or random bytes), truncated, or given a tail; run
  by `trace replay GOLDEN --weights-from FILE` and (every other case, with llama-cpp-python
  installed) `trace replay GOLDEN --gguf FILE`, llama.cpp in its confined child;
- `mmproj`: the embedded model's vision tower as the project writes its mmproj
  (replayer/runtimes/llamacpp/gguf_mmproj.py), mutated as `gguf` is; run by `trace replay
  IMAGE_GOLDEN --runtime llama.cpp --mmproj FILE` (with llama-cpp-python installed; else not run);
- `recipe`: a valid recipe with its text mutated (keys, values, types, nesting, long or odd
  strings, bytes); run by `trace replay GOLDEN --runtime static-w8 --recipe FILE`;
- `prompts`: a small JSON-lines prompt set with lines mutated (wrong types, control characters,
  invalid UTF-8, long lines, odd ids, images outside the folder); run by `trace sweep FILE
  --runtime static --max-new-tokens 1`;
- `config`: the embedded model's folder with its config.json mutated (a key of any depth set to an
  edge value, removed, or the file truncated, nested or its bytes changed); run by `trace record
  --model FOLDER --input-ids 2,3 --max-new-tokens 1`;
- `pt2`: the embedded model's decode step as `trace export-pt2` writes it, its graph or outputs'
  names JSON mutated as `config` is, or the archive's bytes changed or cut; run by `trace diff
  GOLDEN GOLDEN --node-data OUT --graph FILE`;
- `tflite`: the embedded model's model.tflite as `trace export-litert` writes it (with the
  [litert] extra; else not run), one to three of its 4-byte words that hold small integers (the
  flatbuffer's offsets, lengths and indices) set to edge values, other values or random bytes, or
  its bytes changed or cut; run by `trace diff GOLDEN GOLDEN --node-data OUT --graph FILE`;
- `records`: a finished sweep's folder (two prompts, `--runtime static --max-new-tokens 1`) with
  one prompt's resume record mutated as `config` is; run by the same `trace sweep` again, which
  resumes from the record or runs the prompt anew;
- `onnx`: the embedded model's step graphs as `trace export-onnx --max-seq 16` writes them (with the
  [onnx] extra; else not run), one graph's structure (its first 64 KiB: the nodes, before the
  weights) given edge varints or random bytes, or the file cut or given a tail; run by `trace
  replay GOLDEN --onnx FOLDER`;
- `onnxmap`: the built-in `export` name map as a TOML file, a line removed, its value or key
  changed, two kinds on one tensor, patterns and indices at their edges, nesting or random bytes;
  run by `trace replay GOLDEN --onnx FOLDER --onnx-map FILE` on the valid folder;
- `ir`: the embedded model's step graphs as `trace export-openvino --max-seq 16` writes them (with
  the [openvino] extra; else not run), one .xml's attributes (shapes, element types, a constant's
  offset and size in the .bin) set to edge values, a document type or entity declared, its bytes
  changed or cut, or its .bin cut; run by `trace replay GOLDEN --ir FOLDER`;
- `tflitedir`: the folder `tflite` exports (model.tflite and its two embedders), one of its files
  mutated as `tflite` mutates model.tflite, or cut; run by `trace replay GOLDEN --tflite FOLDER`
  (LiteRT's interpreter in its child);
- `pte`: the embedded model's programs as `trace export-pte --max-seq 16` writes them (with the
  [executorch] extra; else not run), one .pte (a flatbuffer and its data) mutated as `tflite` is, or
  cut; run by `trace replay GOLDEN --pte FOLDER` (ExecuTorch's loader and runtime in its child).

The first four run by default; `config`, `pt2`, `tflite`, `records`, `onnx`, `onnxmap`, `ir`, `tflitedir`
and `pte` with `--only`.

A failure is an exception other than SystemExit, an exit code outside 0/1/2, exit 2 without
exactly one `error: ...` line, 'internal error', a traceback, or a case past `--timeout`.

    python scripts/fuzz_inputs.py --cases 300 --seed 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

EDGE = [0, 1, 2, 3, 7, 8, 255, 256, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1]
CLASSES = ("gguf", "mmproj", "recipe", "prompts", "config", "pt2", "tflite", "records", "onnx", "onnxmap", "ir")
CLASSES += ("tflitedir", "pte")  # the user's own litert-torch folder and ExecuTorch programs
DEFAULT = CLASSES[:4]  # without --only; the others with --only (a config or records case may load the model)
CACHE = "GEMMA4_TRACE_CACHE"
SWEEP_PROMPTS = '{"id": "story", "text": "Tell me a story."}\n{"id": "ids", "input_ids": [2, 3, 4]}\n'


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout


# ------------------------------------------------------------------ GGUF
def gguf_case(rng: random.Random, good: bytes, header_end: int) -> tuple[bytes, str]:
    data = bytearray(good)
    how = rng.choice(["fields", "fields", "fields", "truncate", "tail", "count"])
    if how == "truncate":
        n = rng.randrange(0, len(data))
        return bytes(data[:n]), f"truncated to {n} bytes"
    if how == "tail":
        n = rng.choice([1, 31, 32, 4096, 1 << 20])
        return bytes(data) + os.urandom(n), f"{n} bytes appended"
    if how == "count":
        at = rng.choice([8, 16])  # the tensor count, the key count
        v = rng.choice(EDGE)
        struct.pack_into("<Q", data, at, v)
        return bytes(data), f"{'tensor' if at == 8 else 'key'} count {v}"
    what = []
    for _ in range(rng.randint(1, 3)):
        width = rng.choice([1, 2, 4, 8])
        at = rng.randrange(24, header_end - width)
        if rng.random() < 0.7:
            v = rng.choice(EDGE) % (1 << (8 * width))
            data[at : at + width] = v.to_bytes(width, "little")
            what.append(f"{width} bytes at {at} = {v}")
        else:
            data[at : at + width] = os.urandom(width)
            what.append(f"{width} random bytes at {at}")
    return bytes(data), "; ".join(what)


# ------------------------------------------------------------------ recipes
RECIPE = 'runtime = "static-w8"\n\n[units]\n"layer.1" = "static-w4g32"\n"layer.2.mlp" = "float"\n'
ODD = ["", "\x00", "\x1b[31m", "\n", "é", "\ud800", "a" * 70000, "layer.99999999999", "..", "1e400", "[[x]]"]


def recipe_case(rng: random.Random) -> tuple[bytes, str]:
    lines = RECIPE.splitlines()
    how = rng.choice(["valid", "value", "key", "runtime", "nest", "bytes", "table", "many", "array"])
    if how == "valid":  # a recipe that runs: units and precisions drawn from the valid ones
        part = ["", ".qkv", ".o", ".mlp", ".ple"]
        prec = ["float", "static-w8", "static-w4g32", "static-w8a8"]
        lines = lines[:3] + [f'"layer.{rng.randrange(8)}{rng.choice(part)}" = "{rng.choice(prec)}"' for _ in range(3)]
        lines = list(dict.fromkeys(lines))  # a unit named twice would be invalid TOML
    elif how == "value":
        i = rng.choice([3, 4])
        key = lines[i].split("=")[0]
        lines[i] = (
            key + "= " + rng.choice(["1", "true", "[1, 2]", "{a = 1}", json.dumps(rng.choice(ODD)), '"w8"', "nan"])
        )
    elif how == "key":
        lines[3] = json.dumps(rng.choice(ODD)) + ' = "float"'
    elif how == "runtime":
        lines[0] = "runtime = " + rng.choice(
            ["1", '"static"', '"llama.cpp:Q9_9"', '"static-w8a8"', json.dumps(rng.choice(ODD)), '["static-w8"]']
        )
    elif how == "nest":
        depth = rng.choice([10, 100, 1000, 5000])
        lines.append("x = " + "[" * depth + "]" * depth)
    elif how == "table":
        lines.append("[" + ".".join(["a"] * rng.choice([2, 50, 5000])) + "]")
    elif how == "many":
        lines += [f'"layer.{i}" = "float"' for i in range(rng.choice([100, 20000]))]
    elif how == "array":
        lines.append("[[units]]")
    text = "\n".join(lines) + "\n"
    if how == "bytes":
        return changed_bytes(rng, text.encode()), "random bytes"
    return text.encode("utf-8", "surrogatepass"), how


# ------------------------------------------------------------------ prompt files
PROMPTS = [{"id": "a", "text": "Hello!"}, {"id": "b", "input_ids": [2, 100, 101]}]


def prompts_case(rng: random.Random) -> tuple[bytes, str]:
    rows: list = [dict(p) for p in PROMPTS]
    how = rng.choice(["type", "id", "text", "ids", "image", "line", "extra", "chat"])
    r = rows[rng.randrange(2)]
    if how == "type":
        k = rng.choice(["id", "text", "input_ids", "image", "chat"])
        r[k] = rng.choice([1, 1.5, None, True, [], {}, ["x"], [[1]], "x"])
    elif how == "id":
        r["id"] = rng.choice(ODD + ["a/b", "../x", "a" * 300, "con", "a\u2028b", "a b"])
    elif how == "text":
        r["text"] = rng.choice(ODD + ["x" * rng.choice([10_000, 1_000_000])])
    elif how == "ids":
        r["input_ids"] = rng.choice([[], [-1], [2**40], [2] * 100_000, [1.5], ["2"]])
        r.pop("text", None)
    elif how == "image":
        r["image"] = rng.choice(["/etc/passwd", "../x.png", "missing.png", "", ".", "/dev/zero"])
    elif how == "extra":
        r[rng.choice(["txt", "", "\x00"])] = 1
    elif how == "chat":
        r["chat"] = rng.choice(["yes", 2, None])
    text = "\n".join(json.dumps(x) for x in rows) + "\n"
    if how == "line":
        return changed_bytes(rng, text.encode()), "random bytes"
    return text.encode("utf-8", "surrogatepass"), how


# ------------------------------------------------------------------ JSON documents (config.json, a .pt2's parts)
VALUES = [None, True, -1, 0, 1, 3.5, 2**31, 2**63, 10**400, "x", "", [], {}, [1, "a"], {"a": []}, "\u0000"]


def json_mutation(rng: random.Random, doc) -> tuple[object, str]:
    """doc with one mutation at a random depth: a value replaced or removed, or a subtree nested deep."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and rng.random() < 0.75:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    if not path:
        return rng.choice(VALUES), "the whole document replaced"
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    how = rng.choice(["value", "value", "value", "remove", "deep"])
    if how == "remove":
        del parent[path[-1]]
    elif how == "deep":
        depth = rng.choice([100, 10_000, 100_000])
        parent[path[-1]] = json.loads("[" * 50 + "]" * 50) if depth == 100 else {"deep": depth}
    else:
        parent[path[-1]] = rng.choice(VALUES)
    return doc, f"{how} at {'/'.join(map(str, path))[:80]}"


def json_bytes(rng: random.Random, doc) -> bytes:
    if isinstance(doc, dict) and isinstance(doc.get("deep"), int):  # a deep nesting, written by hand
        return b"[" * doc["deep"] + b"]" * doc["deep"]
    return json.dumps(doc).encode()


def changed_bytes(rng: random.Random, data: bytes) -> bytes:
    """data with one to four of its bytes set at random."""
    raw = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return bytes(raw)


def bytes_mutation(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if rng.random() < 0.3:
        n = rng.randrange(len(data))
        return data[:n], f"cut to {n} bytes"
    return changed_bytes(rng, data), "random bytes"


def config_case(rng: random.Random, good: bytes) -> tuple[bytes, str]:
    if rng.random() < 0.2:
        return bytes_mutation(rng, good)
    doc, what = json_mutation(rng, json.loads(good))
    return json_bytes(rng, doc), what


def pt2_case(rng: random.Random, good: Path, out: Path) -> str:
    """Write a mutation of the archive `good` to `out`; what it is."""
    import zipfile

    if rng.random() < 0.3:
        data, what = bytes_mutation(rng, good.read_bytes())
        out.write_bytes(data)
        return what
    target = rng.choice(["models/model.json", "extra/gemma4_trace_outputs.json"])
    with zipfile.ZipFile(good) as a, zipfile.ZipFile(out, "w") as b:
        for info in a.infolist():
            data = a.read(info)
            if info.filename.endswith(target):
                doc, what = json_mutation(rng, json.loads(data))
                data = json_bytes(rng, doc)
            b.writestr(info.filename, data)
    return f"{target}: {what}"


def tflite_case(rng: random.Random, good: bytes) -> tuple[bytes, str]:
    """good with one to three of its aligned words that hold a small integer (a flatbuffer offset,
    length or index, rarely a weight's bits) changed, or its bytes changed or cut."""
    if rng.random() < 0.25:
        return bytes_mutation(rng, good)
    data, what = bytearray(good), []
    words = [i for i in (rng.randrange(0, len(good) // 4) * 4 for _ in range(4000)) if 0 < _word(good, i) < len(good)]
    for at in rng.sample(words, min(len(words), rng.randint(1, 3))):
        old = _word(good, at)
        v = rng.choice([rng.choice(EDGE) % 2**32, old + rng.choice([-8, -4, -1, 1, 4, 8]) & 0xFFFFFFFF, len(good)])
        if rng.random() < 0.2:
            v = int.from_bytes(os.urandom(4), "little")
        struct.pack_into("<I", data, at, v)
        what.append(f"word at {at}: {old} -> {v}")
    return bytes(data), "; ".join(what)


def _word(data: bytes, at: int) -> int:
    return struct.unpack_from("<I", data, at)[0]


# ------------------------------------------------------------------ the user's own ONNX graph, its map, an IR
def onnx_case(rng: random.Random, good: bytes) -> tuple[bytes, str]:
    """good (a serialized ONNX model) with its structure changed: its first 64 KiB (the graph's
    nodes, names and shapes come before the weights) given edge varints or random bytes; or cut, or
    given a tail."""
    how = rng.choice(["varint", "varint", "bytes", "cut", "tail"])
    if how == "cut":
        n = rng.randrange(len(good))
        return good[:n], f"cut to {n} bytes"
    if how == "tail":
        return good + os.urandom(rng.choice([1, 9, 4096])), "a tail"
    data, what, head = bytearray(good), [], min(len(good), 64 << 10)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(head - 10)
        if how == "varint":  # a field's length or value as a protobuf varint at its edge
            v = rng.choice(EDGE + [len(good), len(good) + 1])
            raw = bytearray()
            while True:
                raw.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
                v >>= 7
                if not v:
                    break
            data[at : at + len(raw)] = raw
            what.append(f"varint at {at}")
        else:
            data[at] = rng.randrange(256)
            what.append(f"byte at {at}")
    return bytes(data), "; ".join(what)


FIELD_ODD = ["65537", '"last"', '"first"', '"model/*"', '"L{layer:02}.*"']
MAP_ODD = ['""', '"*"', '"L{layer:99}.q"', '"{cache}"', '"{nope}"', '"a" ', "1", "-1", "2e9", "true", "[]", "{}"]


def onnxmap_case(rng: random.Random, good: str) -> tuple[bytes, str]:
    """The map `good` (TOML text) with one change: a line removed, a value, key or entry's field
    changed, two kinds on one tensor, a header changed, nesting, many entries, or random bytes."""
    lines = good.splitlines()
    kinds = [i for i, ln in enumerate(lines) if "= {" in ln]
    i = rng.choice(kinds)
    key = lines[i].split("=")[0].strip()
    how = rng.choice(["remove", "value", "field", "same", "key", "header", "nest", "many", "bytes"])
    if how == "remove":
        del lines[i]
    elif how == "value":
        lines[i] = f"{key} = {{ value = {rng.choice(MAP_ODD)} }}"
    elif how == "field":
        field = rng.choice(["node", "op", "input", "output", "pick", "fed_by", "after", "value", "other"])
        lines[i] = f"{key} = {{ {field} = {rng.choice(MAP_ODD + FIELD_ODD)} }}"
    elif how == "same":  # two kinds on one tensor
        lines[i] = lines[i].split("=")[0] + "=" + lines[rng.choice(kinds)].split("=", 1)[1]
    elif how == "key":
        lines[i] = f"{rng.choice(['logits', 'token', 'nope', 'vision.q', json.dumps(rng.choice(ODD))])}" + (
            " =" + lines[i].split("=", 1)[1]
        )
    elif how == "header":
        j = rng.choice([n for n, ln in enumerate(lines) if ln.startswith(("format", "layout"))])
        lines[j] = lines[j].split("=")[0] + "= " + rng.choice(MAP_ODD + ['"kv-cache"', "2", '"steps"'])
    elif how == "nest":
        depth = rng.choice([10, 1000, 5000])
        lines.append("x = " + "[" * depth + "]" * depth)
    elif how == "many":
        lines += [f'k{n} = {{ value = "v{n}" }}' for n in range(rng.choice([100, 5000]))]
    text = "\n".join(lines) + "\n"
    if how == "bytes":
        return changed_bytes(rng, text.encode()), "random bytes"
    return text.encode("utf-8", "surrogatepass"), f"{how} ({key})"


IR_ATTRS = ("shape", "element_type", "offset", "size", "id", "from-layer", "to-port", "axis")


def ir_case(rng: random.Random, xml: bytes) -> tuple[bytes, str]:
    """An IR's .xml with one to three attributes (shapes, element types, a constant's offset and size in
    the .bin, ids and edges) set to edge values, a document type with an entity declared, or its bytes
    changed or cut."""
    import re

    how = rng.choice(["attr", "attr", "attr", "doctype", "bytes", "cut"])
    if how == "cut":
        n = rng.randrange(len(xml))
        return xml[:n], f"cut to {n} bytes"
    if how == "bytes":
        return bytes_mutation(rng, xml)[0], "random bytes"
    if how == "doctype":  # "billion laughs": refused before expansion
        head = b'<?xml version="1.0"?><!DOCTYPE net [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;">]>'
        return head + xml.split(b"?>", 1)[-1], "a document type and entities"
    data, what = xml, []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(IR_ATTRS)
        found = [m for m in re.finditer(rb"\b" + name.encode() + rb'="([^"]*)"', data)]
        if not found:
            continue
        m = rng.choice(found)
        v = rng.choice([str(rng.choice(EDGE)), "-1", "", "f64", "u1", "1,2,3,4,5,6,7,8,9", "?", "1e400", "x"])
        data = data[: m.start(1)] + v.encode() + data[m.end(1) :]
        what.append(f"{name}={v}")
    return data, "; ".join(what) or "unchanged"


# ------------------------------------------------------------------ the run
def judge(res, timed_out: bool) -> str | None:
    """Why a command's result is a failure, or None."""
    if timed_out:
        return "timeout"
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        return f"exception {type(res.exception).__name__}: {str(res.exception)[:200]}"
    if res.exit_code not in (0, 1, 2):
        return f"exit code {res.exit_code}"
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    if "internal error" in res.output or "Traceback" in res.output:
        return "internal error or traceback: " + res.output[-300:]
    if res.exit_code == 2 and len(err) != 1:
        return f"exit 2 with {len(err)} error lines"
    return None


def run(cases: int, seed: int, classes=DEFAULT, timeout: float = 60.0, say=print, builds_cache=None) -> dict:
    from click.testing import CliRunner

    from gemma4_trace.cli import main
    from gemma4_trace.recorder.golden import golden_path
    from gemma4_trace.replayer.runtimes.llamacpp import gguf_reader as GR

    ref, image_ref = str(golden_path("short")), str(golden_path("image"))
    work = Path(tempfile.mkdtemp(prefix="fuzz-inputs-"))
    # set for each command only (CliRunner restores the environment): a caller's process (a pytest
    # worker) must not keep printing tracebacks afterwards
    env = {"GEMMA4_TRACE_DEBUG": "1", CACHE: os.environ.get(CACHE, str(work / "cache"))}
    runner = CliRunner(env=env)
    good = work / "good.gguf"
    res = runner.invoke(main, ["export-gguf", "-o", str(good)])
    assert res.exit_code == 0, res.output
    header = GR.read_header(good)
    header_end = min(t.offset for t in header.tensors.values())
    llama = importlib.util.find_spec("llama_cpp") is not None
    classes = tuple(c for c in classes if llama or c != "mmproj")  # mtmd reads it
    if "mmproj" in classes:
        from gemma4_trace.hf.model import load_model
        from gemma4_trace.replayer.runtimes.llamacpp import gguf_mmproj as GM

        good_mmproj = work / "good-mmproj.gguf"
        GM.write(load_model(), good_mmproj)
        mmproj_end = min(t.offset for t in GR.read_header(good_mmproj).tensors.values())
        # the valid pair runs (and the text GGUF is converted before any case, whose stderr holds one line)
        args = ["replay", image_ref, "--runtime", "llama.cpp", "--mmproj", str(good_mmproj), "-o", str(work / "w.h5")]
        res = runner.invoke(main, args)
        assert res.exit_code == 0, res.output
    if "config" in classes:
        from gemma4_trace.hf.model import embedded_model_dir

        model = work / "model"
        shutil.copytree(embedded_model_dir(), model)
        good_config = (model / "config.json").read_bytes()
    if "pt2" in classes:
        # GOLDEN's 15 positions fit (a graph holding fewer is refused before anything is read)
        res = runner.invoke(main, ["export-pt2", "--max-seq", "16", "-o", str(work / "pt2")])
        assert res.exit_code == 0, res.output
    litert = importlib.util.find_spec("ai_edge_litert") is not None
    classes = tuple(c for c in classes if litert or c not in ("tflite", "tflitedir"))  # ai-edge-litert reads them
    builds = CliRunner(env={**env, CACHE: str(builds_cache or env[CACHE])})  # exports from a suite's cache, if given
    if {"tflite", "tflitedir"} & set(classes):
        res = builds.invoke(main, ["export-litert", "--max-seq", "16", "-o", str(work / "tflite")])
        assert res.exit_code == 0, res.output
        good_tflite = (work / "tflite" / "model.tflite").read_bytes()
    needs = {"onnx": ("onnx", "onnxruntime"), "onnxmap": ("onnx", "onnxruntime"), "ir": ("openvino",)}
    needs["pte"] = ("executorch",)
    classes = tuple(c for c in classes if all(importlib.util.find_spec(m) for m in needs.get(c, ())))
    if {"onnx", "onnxmap"} & set(classes):  # GOLDEN's 16 positions: the default --max-seq of its replay
        res = builds.invoke(main, ["export-onnx", "--max-seq", "16", "-o", str(work / "onnx")])
        assert res.exit_code == 0, res.output
        from gemma4_trace.replayer.runtimes.onnx_map import EXPORT as good_map
    if "ir" in classes:
        res = builds.invoke(main, ["export-openvino", "--max-seq", "16", "-o", str(work / "ir")])
        assert res.exit_code == 0, res.output
    if "pte" in classes:  # GOLDEN's 16 positions, as onnx
        res = builds.invoke(main, ["export-pte", "--max-seq", "16", "-o", str(work / "pte")])
        assert res.exit_code == 0, res.output
    own = {"onnx": "onnx", "ir": "ir", "tflitedir": "tflite", "pte": "pte"}  # a class's folder and option
    for cls in sorted(set(own) & set(classes)):  # the valid files replay
        args = ["replay", ref, f"--{own[cls]}", str(work / own[cls]), "-o", str(work / f"{cls}.h5")]
        res = runner.invoke(main, args)
        assert res.exit_code == 0, res.output
    if "records" in classes:
        sweep_args = ["--runtime", "static", "--max-new-tokens", "1", "-o"]
        (work / "prompts.jsonl").write_text(SWEEP_PROMPTS)
        res = runner.invoke(main, ["sweep", str(work / "prompts.jsonl"), *sweep_args, str(work / "sweep")])
        assert res.exit_code in (0, 1), res.output
    rng = random.Random(seed)
    counts = {c: {"cases": 0, "exit": {0: 0, 1: 0, 2: 0}, "failures": []} for c in classes}
    old = signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    try:
        for n in range(cases):
            cls = classes[n % len(classes)]
            case_rng = random.Random(rng.getrandbits(64))
            folder = work / f"case{n}"
            folder.mkdir()
            if cls == "gguf":
                data, what = gguf_case(case_rng, good.read_bytes(), header_end)
                path = folder / "in.gguf"
                how = ["--gguf"] if llama and n % 2 else ["--weights-from"]  # llama.cpp reads it, or gguf's dequantizer
                args = ["replay", ref, *how, str(path), "-o", str(folder / "o.h5")]
            elif cls == "mmproj":
                data, what = gguf_case(case_rng, good_mmproj.read_bytes(), mmproj_end)
                path = folder / "mmproj.gguf"
                args = ["replay", image_ref, "--runtime", "llama.cpp", "--mmproj", str(path)]
                args += ["-o", str(folder / "o.h5")]
            elif cls == "recipe":
                data, what = recipe_case(case_rng)
                path = folder / "r.toml"
                args = ["replay", ref, "--runtime", "static-w8", "--recipe", str(path), "-o", str(folder / "o.h5")]
            elif cls == "prompts":
                data, what = prompts_case(case_rng)
                path = folder / "p.jsonl"
                args = ["sweep", str(path), "--runtime", "static", "--max-new-tokens", "1", "-o", str(folder / "s")]
            elif cls == "config":
                data, what = config_case(case_rng, good_config)
                path = model / "config.json"  # the one folder, its config rewritten each case
                args = ["record", "--model", str(model), "--input-ids", "2,3", "--max-new-tokens", "1"]
                args += ["-o", str(folder / "o.h5")]
            elif cls == "tflite":
                data, what = tflite_case(case_rng, good_tflite)
                path = folder / "model.tflite"
                args = ["diff", ref, ref, "--node-data", str(folder / "nd.json"), "--graph", str(path)]
            elif cls == "records":
                shutil.copytree(work / "sweep", folder / "s")
                path = folder / "s" / "prompts" / f"{case_rng.choice(['story', 'ids'])}.json"
                data, what = config_case(case_rng, path.read_bytes())  # a resume record: JSON, mutated as a config
                args = ["sweep", str(work / "prompts.jsonl"), *sweep_args, str(folder / "s")]
            elif cls in ("onnx", "ir"):
                shutil.copytree(work / cls, folder / cls)
                step, ext = case_rng.choice(["prefill", "decode"]), "onnx" if cls == "onnx" else "xml"
                if cls == "ir" and case_rng.random() < 0.15:
                    path = folder / "ir" / f"{step}.bin"
                    data = path.read_bytes()
                    data, what = data[: case_rng.randrange(len(data))], f"{step}.bin cut"
                else:
                    path = folder / cls / f"{step}.{ext}"
                    data, what = (onnx_case if cls == "onnx" else ir_case)(case_rng, path.read_bytes())
                    what = f"{step}.{ext}: {what}"
                args = ["replay", ref, "--" + cls, str(folder / cls), "-o", str(folder / "o.h5")]
            elif cls in ("tflitedir", "pte"):
                shutil.copytree(work / own[cls], folder / "in")
                name = case_rng.choice(sorted(p.name for p in (folder / "in").iterdir() if p.suffix == f".{own[cls]}"))
                path = folder / "in" / name
                data = path.read_bytes()
                if case_rng.random() < 0.15:
                    data, what = data[: case_rng.randrange(len(data))], f"{name} cut"
                else:
                    data, what = tflite_case(case_rng, data)
                    what = f"{name}: {what}"
                args = ["replay", ref, f"--{own[cls]}", str(folder / "in"), "-o", str(folder / "o.h5")]
            elif cls == "onnxmap":
                data, what = onnxmap_case(case_rng, good_map)
                path = folder / "map.toml"
                args = ["replay", ref, "--onnx", str(work / "onnx"), "--onnx-map", str(path)]
                args += ["-o", str(folder / "o.h5")]
            else:
                path = folder / "decode.pt2"
                what = pt2_case(case_rng, work / "pt2" / "decode.pt2", path)
                data = path.read_bytes()
                args = ["diff", ref, ref, "--node-data", str(folder / "nd.json"), "--graph", str(path)]
            path.write_bytes(data)
            timed_out = False
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                res = runner.invoke(main, args, catch_exceptions=True)
            except Timeout:
                timed_out, res = True, None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            why = judge(res, timed_out) if res is not None or timed_out else None
            c = counts[cls]
            c["cases"] += 1
            if res is not None and res.exit_code in c["exit"]:
                c["exit"][res.exit_code] += 1
            if why is not None:
                c["failures"].append(f"case {n} ({what}): {why}")
                say(f"FAIL {cls} case {n} ({what}): {why}")
    finally:
        signal.signal(signal.SIGALRM, old)
        shutil.rmtree(work, ignore_errors=True)
    counts["seconds"] = time.perf_counter() - t0
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=90)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=CLASSES, default=None)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    counts = run(a.cases, a.seed, (a.only,) if a.only else DEFAULT, a.timeout)
    failed = 0
    for cls in CLASSES:
        if cls in counts:
            c = counts[cls]
            failed += len(c["failures"])
            ex = "  ".join(f"exit {k}: {v}" for k, v in c["exit"].items())
            print(f"{cls:8} {c['cases']:4} cases  {ex}  failures: {len(c['failures'])}")
    print(f"{a.cases} cases in {counts['seconds']:.1f} s; failures: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
