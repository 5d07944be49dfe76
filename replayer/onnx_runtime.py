"""`--runtime onnx`: the static runtime's prefill and decode steps exported to ONNX, run by
onnxruntime on CPU (extra `gemma4-trace[onnx]`).

Each step is one ONNX graph with static shapes (max_seq). The graphs are pure functions: the
KV caches of the layers that own K/V are inputs, and the updated caches come back as outputs
(the host keeps them between steps, as an NPU runtime's host code would). Every canonical
kind the static runtime reports through its probe becomes an extra graph output, named
`<kind>` or `L07.<kind>`, so a replay sees what the exported graph computed, with
onnxruntime's kernels. The vision tower is not exported: its soft tokens are computed on the
host by HF, as in the static runtime, and fed to the prefill graph.

    trace export-onnx [--model DIR] --max-seq 32 -o DIR    # writes prefill.onnx, decode.onnx
    trace replay REF.h5 --runtime onnx -o RUN.h5

The exported graphs are kept in the artifact cache (replayer/artifacts.py), keyed by the model's
content hash, max_seq, the exporter's versions and this code's; a later replay of the same model
runs the cached graphs after checking their hashes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gemma4_trace.traces.errors import TraceToolError, install_hint

from .artifacts import MANIFEST, check_output_folder, copy_all_or_none
from .native_child import ORT_SESSION, Engine
from .runtime import StaticGemma4Runtime

OPSET = 18
FORMAT = 1  # bump when the graphs' inputs or outputs change meaning (the cache key holds it)
PREFILL_INPUTS = ("ids", "ple_ids", "mm_embeds", "mm_slots", "block_ids", "n_valid")
DECODE_INPUTS = ("token", "input_pos")


def _import_ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise TraceToolError(f"--runtime onnx needs onnxruntime: {install_hint('onnx')} ({e})") from None
    return onnxruntime


class _ListProbe:
    """Collects the probe's reports while the graph is traced: each becomes a graph output."""

    def __init__(self):
        self.names: list[str] = []
        self.values: list[torch.Tensor] = []

    def tensor(self, kind, value, layer=None):
        self.names.append(kind if layer is None else f"L{layer:02d}.{kind}")
        self.values.append(value)


class _FunctionalKV(StaticGemma4Runtime):
    """The static runtime with its KV caches passed in and returned (no in-place buffer writes)."""

    def owners(self) -> list[int]:
        return [i for i, info in enumerate(self.infos) if info.kv_role != "reuses"]

    def _write_kv(self, i, k_t, v_t, input_pos, valid):
        kc, vc = self._kv[i]
        if valid is None:
            kc, vc = kc.index_copy(2, input_pos, k_t), vc.index_copy(2, input_pos, v_t)
        elif k_t.shape[2] < kc.shape[2]:  # a prefill chunk (ExecuTorch): its rows at input_pos, padding rows zero
            keep = valid[None, None, :, None]
            kc = kc.index_copy(2, input_pos, torch.where(keep, k_t, torch.zeros_like(k_t)))
            vc = vc.index_copy(2, input_pos, torch.where(keep, v_t, torch.zeros_like(v_t)))
        else:  # prefill rewrites the whole cache; padding rows are zero
            keep = valid[None, None, :, None]
            kc, vc = torch.where(keep, k_t, torch.zeros_like(k_t)), torch.where(keep, v_t, torch.zeros_like(v_t))
        self._kv[i] = (kc, vc)

    def _read_kv(self, i, input_pos):
        return self._kv[self.infos[i].kv_source]


class _Graph(nn.Module):
    """One step as a function: (step inputs..., caches...) -> (logits, caches..., reported kinds...)."""

    def __init__(self, rt: _FunctionalKV, prefill: bool):
        super().__init__()
        self.rt, self.prefill, self.names = rt, prefill, None

    def forward(self, *args):
        rt = self.rt
        n = len(PREFILL_INPUTS if self.prefill else DECODE_INPUTS)
        step, caches = args[:n], args[n:]
        rt._kv = {i: (caches[2 * j], caches[2 * j + 1]) for j, i in enumerate(rt.owners())}
        probe = _ListProbe()
        logits = rt.prefill_step(*step, probe=probe) if self.prefill else rt.decode_step(*step, probe=probe)
        kv = [t for i in rt.owners() for t in rt._kv[i]]
        self.names = probe.names
        return (logits, *kv, *probe.values)


def _cache_names(rt: _FunctionalKV) -> list[str]:
    return [f"L{i:02d}.{c}_cache" for i in rt.owners() for c in ("k", "v")]


def export_onnx(loaded, max_seq: int, out_dir) -> tuple[Path, Path]:
    """Write prefill.onnx and decode.onnx for `loaded` at `max_seq`; return their paths."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401  (torch's ONNX exporter needs it)
    except ImportError as e:
        raise TraceToolError(f"exporting ONNX needs onnx and onnxscript: {install_hint('onnx')} ({e})") from None
    out = Path(out_dir)
    if not out.is_dir():
        raise TraceToolError(f"output folder {out} does not exist")
    rt = _FunctionalKV(loaded, max_seq)
    caches = [
        torch.zeros(1, rt.infos[i].num_kv_heads, max_seq, rt.infos[i].head_dim, dtype=rt.dtype)
        for i in rt.owners()
        for _ in ("k", "v")
    ]
    dev = rt.embed.device
    steps = {
        "prefill": (True, rt.prepare_prefill([0], {}), PREFILL_INPUTS),
        "decode": (
            False,
            (torch.zeros(1, 1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev)),
            DECODE_INPUTS,
        ),
    }
    # protobuf caps a file at 2 GiB: a real checkpoint's weights go to <graph>.onnx.data beside it
    weights = sum(b.numel() * b.element_size() for b in rt.buffers())
    external = weights > 1 << 30
    paths = []
    for name, (prefill, example, inputs) in steps.items():
        g = _Graph(rt, prefill).eval()
        with torch.no_grad(), _quiet():
            g(*example, *caches)  # learn the reported kinds' names (the order is fixed by the code)
            outputs = ["logits", *(f"{c}_out" for c in _cache_names(rt)), *g.names]
            path = out / f"{name}.onnx"
            try:
                torch.onnx.export(
                    g,
                    (*example, *caches),
                    str(path),
                    input_names=[*inputs, *_cache_names(rt)],
                    output_names=outputs,
                    opset_version=OPSET,
                    dynamo=True,
                    external_data=external,
                    verbose=False,
                    optimize=False,
                )  # onnxruntime optimizes at load; 2x faster export
            except Exception as e:  # noqa: BLE001 - the exporter fails in many ways; one line for the user
                raise TraceToolError(
                    f"ONNX export of the {name} step failed: {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''}"
                ) from None
        paths.append(path)
    return paths[0], paths[1]


@contextlib.contextmanager
def _quiet():
    """The exporter prints pages of warnings and progress for a successful export: keep them off the console."""
    logging.disable(logging.WARNING)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def cache_key(loaded, max_seq: int) -> dict:
    """What the exported graphs depend on: the checkpoint's bytes, the shapes, the exporter's
    versions and the code that is exported (a change to it exports again)."""
    import hashlib
    from importlib.metadata import version

    from .artifacts import model_hash

    here = Path(__file__).resolve().parent
    code = hashlib.sha256(b"".join((here / f).read_bytes() for f in ("runtime.py", "onnx_runtime.py"))).hexdigest()
    return {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "dtype": str(loaded.dtype),
        "max_seq": int(max_seq),
        "opset": OPSET,
        "torch": torch.__version__,
        "onnx": version("onnx"),
        "onnxscript": version("onnxscript"),
        "code": code[:16],
    }


def exported(loaded, max_seq: int, cache=None, enabled=None):
    """The artifact (replayer/artifacts.py) holding prefill.onnx and decode.onnx for `loaded` at
    `max_seq`: the cached graphs after their hash check, else exported now (one line on stderr)."""
    from .artifacts import artifact_folder

    return artifact_folder(
        "onnx",
        cache_key(loaded, max_seq),
        lambda folder: export_onnx(loaded, max_seq, folder),
        cache=cache,
        enabled=enabled,
        what=f"exporting ONNX (prefill and decode, max_seq {max_seq}) for {loaded.name}",
    )


class OnnxRuntime:
    """The exported graphs run by onnxruntime on CPU; the host keeps the caches."""

    def __init__(self, loaded, max_seq: int):
        ort = _import_ort()
        self.name = f"onnx (onnxruntime {ort.__version__}, CPU)"
        self.max_seq = max_seq
        # the sessions run in a child process (replayer/native_child.py): a crash in onnxruntime is one line
        self.engine = Engine(f"onnx (onnxruntime {ort.__version__})", "onnxruntime")
        try:
            self.host = _FunctionalKV(loaded, max_seq)  # prepares prefill inputs (vision tower on the host)
            art = exported(loaded, max_seq)
            try:
                meta = self.engine.load({g: art.path / f"{g}.onnx" for g in GRAPHS}, ORT_SESSION)
            finally:
                art.close()  # a session holds its graph in memory; a temporary folder (cache off) goes now
        except BaseException:
            self.engine.close()
            raise
        self.outputs = {g: outs for g, (_, outs) in meta.items()}
        self.artifact_note = art.note
        self.caches = {
            n: np.zeros(
                (1, self.host.infos[int(n[1:3])].num_kv_heads, max_seq, self.host.infos[int(n[1:3])].head_dim),
                dtype=np.float32,
            )
            for n in _cache_names(self.host)
        }
        self.T = 0
        self.decodes = 0  # decode steps since the prefill: the phase a crash names

    def _run(self, graph: str, feeds: dict, probe, rows: slice):
        if graph == "prefill":
            self.decodes, phase = 0, "prefill"
        else:
            self.decodes += 1
            phase = f"decode step {self.decodes}"
        feeds = {**feeds, **self.caches}
        names = self.outputs[graph]
        outs = dict(zip(names, self.engine.run(graph, feeds, phase)))
        for n in self.caches:
            self.caches[n] = outs[f"{n}_out"]
        if probe is not None:
            for n in names:
                if n == "logits" or n.endswith("_cache_out"):
                    continue
                layer, _, kind = n.rpartition(".")
                probe.tensor(kind, torch.from_numpy(outs[n][rows]), layer=int(layer[1:]) if layer else None)
        return torch.from_numpy(outs["logits"])

    def prefill(self, input_ids, extra_inputs, probe):
        args = self.host.prepare_prefill(input_ids, extra_inputs)
        self.T = len(input_ids)
        feeds = {n: a.cpu().numpy() for n, a in zip(PREFILL_INPUTS, args)}
        return self._run("prefill", feeds, probe, slice(0, self.T))

    def decode(self, token_id, position, probe):
        tok = self.host.pad_id if int(token_id) in self.host.mm_token_ids else int(token_id)
        feeds = {"token": np.array([[tok]], dtype=np.int64), "input_pos": np.array([position], dtype=np.int64)}
        return self._run("decode", feeds, probe, slice(0, 1))


def make_onnx(loaded, max_seq: int):
    if loaded.dtype != "float32":
        raise TraceToolError(f"--runtime onnx runs float32 graphs; REF was recorded in {loaded.dtype}")
    return OnnxRuntime(loaded, max_seq)


GRAPHS = ("prefill", "decode")


def export_command(model_dir, max_seq: int, out_dir, force: bool = False) -> str:
    """`trace export-onnx`: write prefill.onnx and decode.onnx into out_dir, both or neither (the
    artifact cache's graphs, exported into it first when absent); return a summary line. Output
    paths are checked before the model loads."""
    from gemma4_trace.hf.model import load_model

    out = Path(out_dir)
    targets = [out / f"{g}.onnx" for g in GRAPHS]
    check_output_folder(out, [t.name for t in targets] + [t.name + ".data" for t in targets], force, ".onnx")
    loaded = load_model(model_dir)
    art = exported(loaded, max_seq)
    try:  # the graphs (and external weights, if any), all placed or none
        copy_all_or_none([f for f in sorted(art.path.iterdir()) if f.name != MANIFEST], out, ".onnx")
    finally:
        art.close()
    sizes = ", ".join(f"{t} ({t.stat().st_size / 2**20:.1f} MiB)" for t in targets)
    return (
        f"wrote {sizes}: {loaded.name}, max_seq {max_seq}, opset {OPSET}, canonical kinds as extra outputs "
        f"({'from the artifact cache' if art.note == 'cached' else art.note})"
    )
