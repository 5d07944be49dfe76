"""`--runtime executorch`, `executorch-int8` and `executorch-int8-reference`: the static runtime's
prefill and decode steps lowered to ExecuTorch's XNNPACK backend and run by `executorch.runtime`
on CPU (extra `gemma4-trace[executorch]`).

The programs are the ONNX runtime's graphs (replayer/onnx_runtime.py): pure functions of the step
inputs and the K/V caches of the layers that own K/V, returning the logits, the updated caches and
every canonical kind the static runtime reports, as extra outputs. The host keeps the caches
between steps. The prefill program is the static runtime's prefill chunk (`prefill_chunk_step`):
N prompt rows from a start position (an input), shapes (N, max_seq), run once per chunk of the
static runtime's plan (replayer/runtime.py: chunk_plan) and its rows stitched by position into
the probe; N follows `--prefill-chunk` as the static runtime's does (resolve_prefill_chunk: by
default the whole padded max_seq, one run, below max_seq 1024).

    executorch                  float32, every op XNNPACK takes is delegated to it
    executorch-int8             PT2E with XNNPACKQuantizer: symmetric int8, per-channel weights,
                                static per-tensor activations calibrated on REF's prompt (prefill on
                                the prompt, decode on the prompt's tokens fed one at a time), lowered
    executorch-int8-reference   the same converted PT2E program (after convert_pt2e, before
                                lowering) run by PyTorch: its quantize/dequantize pairs simulate
                                the int8 arithmetic; `trace diff REF INT8 --baseline INT8_REFERENCE`
                                shows the error XNNPACK's int8 kernels add beyond the quantization

The .pte programs are kept in the artifact cache (replayer/artifacts.py), keyed by the model's
content hash, the runtime, max_seq, the prefill chunk, the calibration prompt (int8) and the
executorch/torch versions; so are the converted int8 programs before lowering (torch.export's
.pt2), which executorch-int8 lowers and executorch-int8-reference runs: whichever of the two
replays comes second does not quantize again.

    trace export-pte [--model DIR] [--runtime executorch|executorch-int8] --max-seq 32 [--prefill-chunk N] -o DIR
"""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path

import torch

from gemma4_trace.traces.errors import TraceToolError, install_hint

from .native_child import Engine
from .onnx_runtime import DECODE_INPUTS, PREFILL_INPUTS, _FunctionalKV, _Graph, _ListProbe, _quiet
from .runtime import _ChunkProbe, chunk_plan, resolve_prefill_chunk

MODES = ("executorch", "executorch-int8", "executorch-int8-reference")
PROGRAMS = ("prefill", "decode")
PT2E = "executorch-int8-pt2e"  # the artifact-cache entry of the converted (not yet lowered) int8 programs
FORMAT = 2  # bump when the programs' inputs or outputs change meaning (the cache key holds it)
PREFILL_CHUNK_INPUTS = (*PREFILL_INPUTS, "start")
INT8_SCHEME = (
    "PT2E XNNPACKQuantizer: symmetric int8, per-channel weights, static per-tensor activations "
    "calibrated on REF's prompt"
)


def _versions() -> dict:
    try:
        from executorch import version as et_version
        from executorch.runtime import Runtime  # noqa: F401  (the pybindings: the part that may fail to load)
    except ImportError as e:
        raise TraceToolError(f"--runtime executorch needs executorch: {install_hint('executorch')} ({e})") from None
    return {"executorch": et_version.__version__, "torch": torch.__version__}


def _zero_caches(rt: _FunctionalKV) -> list[torch.Tensor]:
    return [
        torch.zeros(1, rt.infos[i].num_kv_heads, rt.max_seq, rt.infos[i].head_dim, dtype=rt.dtype)
        for i in rt.owners()
        for _ in ("k", "v")
    ]


class _PrefillChunk(_Graph):
    """The prefill program: (PREFILL_CHUNK_INPUTS..., caches...) -> (logits, caches..., reported
    kinds...). The step inputs are prefill_chunk_step's N rows of prepare_prefill's tensors, the
    whole block_ids and n_valid, and `start` () long, the position of the first row; N = max_seq
    is the whole padded prompt in one run."""

    def __init__(self, rt: _FunctionalKV):
        super().__init__(rt, prefill=True)

    def forward(self, *args):
        rt, n = self.rt, len(PREFILL_CHUNK_INPUTS)
        (*rows, start), caches = args[:n], args[n:]
        rt._kv = {i: (caches[2 * j], caches[2 * j + 1]) for j, i in enumerate(rt.owners())}
        probe = _ListProbe()
        input_pos = start + torch.arange(rows[0].shape[1], device=start.device)
        logits = rt.prefill_chunk_step(*rows, input_pos, probe=probe)
        self.names = probe.names
        return (logits, *(t for i in rt.owners() for t in rt._kv[i]), *probe.values)


def _graph(rt: _FunctionalKV, name: str) -> _Graph:
    return (_PrefillChunk(rt) if name == "prefill" else _Graph(rt, prefill=False)).eval()


def _chunk_args(rt: _FunctionalKV, args: tuple, c0: int) -> tuple:
    """prepare_prefill's tensors -> the prefill program's step inputs for its rows from position c0."""
    ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid = args
    rows = slice(c0, c0 + (rt.prefill_chunk or rt.max_seq))
    return (ids[:, rows], ple_ids[:, rows], mm_embeds[:, rows], mm_slots[:, rows], block_ids, n_valid, torch.tensor(c0))


def _plan(rt: _FunctionalKV, args: tuple, T: int) -> list[tuple[int, slice]]:
    """The prefill program's runs for a T-token prompt: [(first position, its rows that are reported)]."""
    N = rt.prefill_chunk or rt.max_seq
    return chunk_plan(T, N, rt.max_seq, args[4].cpu() if rt.bidir_vision else None)


def _examples(rt: _FunctionalKV) -> dict:
    """Example step inputs per program (shapes and dtypes only: every shape is fixed by max_seq
    and the host's prefill_chunk)."""
    z = torch.zeros(1, dtype=torch.long)
    return {"prefill": _chunk_args(rt, rt.prepare_prefill([0], {}), 0), "decode": (z.reshape(1, 1), z)}


def _calibration(rt: _FunctionalKV, prompt, extra) -> dict:
    """Calibration inputs per program from REF's prompt: the prompt's prefill chunks (caches from
    the float prefill program, chunk by chunk), and its tokens fed one at a time to decode (caches
    from the float decode graph), as a replay runs them.

    The prefill rows past the prompt hold the prompt's tokens again, not padding: the observers see
    every row a program computes, and a pad row (a zero embedding, whose input norm scales by
    1/sqrt(eps)) would set activation ranges that round the prompt's rows to zero. Those rows stay
    outside n_valid, so they write no cache and the replay never reports them."""
    caches = _zero_caches(rt)
    n = len(caches)
    args, g, pre = rt.prepare_prefill(list(prompt), extra or {}), _graph(rt, "prefill"), []
    T = len(prompt)
    ids, ple_ids = args[0].clone(), args[1].clone()
    again = torch.arange(ids.shape[1] - T) % T
    ids[:, T:], ple_ids[:, T:] = ids[:, again], ple_ids[:, again]
    args = (ids, ple_ids, *args[2:])
    with torch.no_grad():
        for c0, _ in _plan(rt, args, len(prompt)):
            pre.append((*_chunk_args(rt, args, c0), *caches))
            caches = list(g(*pre[-1])[1 : 1 + n])
    caches = _zero_caches(rt)
    g, dec = _graph(rt, "decode"), []
    mm = set(rt.mm_token_ids)
    with torch.no_grad():
        for pos, tok in enumerate(prompt):
            args = (torch.tensor([[rt.pad_id if int(tok) in mm else int(tok)]]), torch.tensor([pos]))
            dec.append((*args, *caches))
            caches = list(g(*args, *caches)[1 : 1 + n])
    return {"prefill": pre, "decode": dec}


def _export(rt: _FunctionalKV, name: str) -> torch.export.ExportedProgram:
    g = _graph(rt, name)
    with torch.no_grad(), _quiet():
        return torch.export.export(g, (*_examples(rt)[name], *_zero_caches(rt)), strict=False)


def _quantized(rt: _FunctionalKV, calibration: dict) -> dict:
    """name -> the converted PT2E program (quantize/dequantize pairs around int8 weights), exported."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    out = {}
    for name in PROGRAMS:
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
        with torch.no_grad(), _quiet():
            m = prepare_pt2e(_export(rt, name).module(), quantizer)
            for args in calibration[name]:
                m(*args)
            example = (*_examples(rt)[name], *_zero_caches(rt))
            out[name] = torch.export.export(convert_pt2e(m), example, strict=False)
    return out


def converted_programs(loaded, max_seq: int, prompt, extra, host: _FunctionalKV):
    """The artifact-cache entry holding the converted PT2E programs (prefill.pt2, decode.pt2,
    torch.export's format): what executorch-int8 lowers and executorch-int8-reference runs, so
    the second of the two replays of one REF does not quantize again."""
    from .artifacts import artifact_folder

    def build(folder: Path) -> None:
        try:
            programs = _quantized(host, _calibration(host, prompt, extra))
        except Exception as e:  # noqa: BLE001 - quantization and export fail in many ways; one line for the user
            raise TraceToolError(
                f"quantizing the programs (PT2E) failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}"
            ) from None
        for name in PROGRAMS:
            torch.export.save(programs[name], Path(folder) / f"{name}.pt2")

    return artifact_folder(
        "executorch",
        artifact_key(loaded, PT2E, max_seq, prompt, extra, host.prefill_chunk),
        build,
        what="quantizing the prefill and decode programs (PT2E, calibrated on the prompt)",
    )


def _load_converted(loaded, max_seq: int, prompt, extra, host: _FunctionalKV) -> dict:
    """name -> the converted ExportedProgram, from the artifact cache (built there first if needed)."""
    art = converted_programs(loaded, max_seq, prompt, extra, host)
    try:
        with _quiet():
            return {n: torch.export.load(art.path / f"{n}.pt2") for n in PROGRAMS}
    finally:
        art.close()


def _lower(program: torch.export.ExportedProgram) -> bytes:
    """An ExportedProgram -> the .pte bytes of its XNNPACK lowering."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad(), _quiet():
        return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer


def write_programs(rt: _FunctionalKV, out_dir, quantized: dict | None = None) -> list[Path]:
    """Write prefill.pte and decode.pte into out_dir: the float programs, or the converted
    `quantized` ones (executorch-int8); the prefill program takes rt.prefill_chunk rows (None: the
    whole max_seq)."""
    paths = []
    for name in PROGRAMS:
        try:
            data = _lower(quantized[name] if quantized else _export(rt, name))
        except Exception as e:  # noqa: BLE001 - export and lowering fail in many ways; one line for the user
            raise TraceToolError(
                f"lowering the {name} program to XNNPACK failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}"
            ) from None
        path = Path(out_dir) / f"{name}.pte"
        path.write_bytes(data)
        paths.append(path)
    return paths


def _prompt_digest(prompt, extra) -> str:
    h = hashlib.sha256(json.dumps([int(t) for t in prompt]).encode())
    for k in sorted(extra or {}):
        t = torch.as_tensor(extra[k])
        h.update(k.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def artifact_key(loaded, mode: str, max_seq: int, prompt=None, extra=None, prefill_chunk: int | None = None) -> dict:
    """What the programs depend on; prefill_chunk as resolve_prefill_chunk gives it (None: whole max_seq)."""
    from .artifacts import model_hash

    key = {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "runtime": mode,
        "max_seq": int(max_seq),
        "prefill_chunk": None if prefill_chunk is None else int(prefill_chunk),
    }
    key.update(_versions())
    if mode in ("executorch-int8", PT2E):
        key["calibration"] = _prompt_digest(prompt, extra)
    return key


def cached_programs(loaded, mode: str, max_seq: int, prompt=None, extra=None, host=None, prefill_chunk=None):
    """The artifact-cache entry (replayer/artifacts.py) holding prefill.pte and decode.pte; the
    prefill program takes host.prefill_chunk rows (without a host: prefill_chunk)."""
    from .artifacts import artifact_folder

    rt = host or _FunctionalKV(loaded, max_seq, prefill_chunk)
    what = "float32" if mode == "executorch" else "int8 (PT2E, calibrated on the prompt)"
    rows = f"{rt.prefill_chunk}-row chunk" if rt.prefill_chunk else f"max_seq {max_seq}"

    def build(folder: Path) -> None:
        quantized = _load_converted(loaded, max_seq, prompt, extra, rt) if mode == "executorch-int8" else None
        write_programs(rt, folder, quantized)

    return artifact_folder(
        "executorch",
        artifact_key(loaded, mode, max_seq, prompt, extra, rt.prefill_chunk),
        build,
        what=f"lowering the prefill ({rows}) and decode programs to ExecuTorch XNNPACK, {what}",
    )


def _in_child(engine: Engine, name: str, args: list, phase: str) -> list[torch.Tensor]:
    """Program `name` run by the ExecuTorch child on args (tensors in, tensors out)."""
    return [torch.from_numpy(a) for a in engine.run(name, [t.numpy() for t in args], phase)]


class ExecuTorchRuntime:
    """The lowered programs run by executorch.runtime (or, for the reference, the converted PT2E
    programs by PyTorch); the host keeps the caches. int8 programs are built at the first prefill,
    from its prompt (the calibration data)."""

    def __init__(self, loaded, max_seq: int, mode: str):
        # the lowered programs run in a child process (replayer/native_child.py), started first: its
        # imports (torch, executorch) overlap this process's; a crash in ExecuTorch is then one line
        self.engine = None if mode == "executorch-int8-reference" else Engine(mode, "executorch")
        versions = _versions()
        self.mode, self.loaded, self.max_seq = mode, loaded, max_seq
        if mode == "executorch":
            self.name = f"executorch (ExecuTorch {versions['executorch']}, XNNPACK, float32)"
        elif mode == "executorch-int8":
            self.name = f"executorch-int8 (ExecuTorch {versions['executorch']}, XNNPACK; {INT8_SCHEME})"
        else:
            self.name = (
                f"executorch-int8-reference (PyTorch {versions['torch']} on the converted PT2E program; {INT8_SCHEME})"
            )
        self.host = _FunctionalKV(loaded, max_seq)  # prepares prefill inputs (vision tower on the host)
        self.n_caches = 2 * len(self.host.owners())
        self.names = self._output_names()
        self.steps = None  # name -> callable(list of tensors) -> list of tensors
        self.note = ""
        self.prefill_chunk = resolve_prefill_chunk(None, max_seq)  # replay sets --prefill-chunk's; built at prefill

    def _output_names(self) -> dict:
        """The reported kinds' names of each program's extra outputs, in order (one eager run)."""
        names = {}
        for name in PROGRAMS:
            g = _graph(self.host, name)
            with torch.no_grad():
                g(*_examples(self.host)[name], *_zero_caches(self.host))
            names[name] = g.names
        return names

    def _load(self, prompt=None, extra=None) -> None:
        """self.steps: name -> callable(list of tensors, phase) -> list of tensors."""
        if self.mode == "executorch-int8-reference":  # PyTorch, in this process
            progs = _load_converted(self.loaded, self.max_seq, prompt, extra, self.host)
            mods = {n: progs[n].module() for n in PROGRAMS}
            self.steps = {n: (lambda args, phase, m=mods[n]: list(m(*args))) for n in PROGRAMS}
            return
        engine = self.engine
        engine.label = f"{self.mode} (ExecuTorch {_versions()['executorch']}, XNNPACK)"  # how errors name it
        try:
            art = cached_programs(self.loaded, self.mode, self.max_seq, prompt, extra, host=self.host)
            self.note = art.note
            try:
                engine.load({n: art.path / f"{n}.pte" for n in PROGRAMS})
            finally:
                art.close()  # the program is read into memory; a temporary (cache off) folder can go
        except BaseException:
            engine.close()
            raise
        self.steps = {n: partial(_in_child, engine, n) for n in PROGRAMS}

    def _run(self, name: str, args: tuple, probe, rows: slice):
        if name == "prefill":
            self.decodes, phase = 0, "prefill"
        else:
            self.decodes += 1  # prefill comes first and sets it
            phase = f"decode step {self.decodes}"
        outs = self.steps[name]([*args, *self.caches], phase)
        n, names = self.n_caches, self.names[name]
        if len(outs) != 1 + n + len(names):
            raise TraceToolError(
                f"the {name} program returned {len(outs)} outputs; expected {1 + n + len(names)} "
                "(logits, caches, reported kinds)"
            )
        self.caches = [t.clone() for t in outs[1 : 1 + n]]  # outputs may live in the program's planned memory
        if probe is not None:
            for full, value in zip(names, outs[1 + n :]):
                layer, _, kind = full.rpartition(".")
                probe.tensor(kind, value[rows].clone(), layer=int(layer[1:]) if layer else None)
        return outs[0].clone()

    @property
    def prefill_chunk(self) -> int | None:
        """Rows per run of the prefill program (None: the whole max_seq); the host's, which the
        programs are exported from. Setting another drops programs built for the old one."""
        return self.host.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, rows: int | None) -> None:
        if rows != self.host.prefill_chunk:
            self.host.prefill_chunk, self.steps = rows, None

    def prefill(self, input_ids, extra_inputs, probe):
        """The prefill program once per chunk of the plan (_plan), the caches carried from one run
        to the next; each run's new rows go to the probe, stitched by position (_ChunkProbe)."""
        ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        if self.steps is None:
            self._load(ids, extra_inputs)
        args = self.host.prepare_prefill(ids, extra_inputs)
        self.caches = _zero_caches(self.host)
        chunks = _ChunkProbe(probe) if probe is not None else None
        for c0, rows in _plan(self.host, args, len(ids)):
            logits = self._run("prefill", _chunk_args(self.host, args, c0), chunks, rows)
        if chunks is not None:
            chunks.flush()
        return logits  # the last run holds position T - 1

    def decode(self, token_id, position, probe):
        tok = self.host.pad_id if int(token_id) in self.host.mm_token_ids else int(token_id)
        args = (torch.tensor([[tok]], dtype=torch.long), torch.tensor([position], dtype=torch.long))
        return self._run("decode", args, probe, slice(0, 1))


def _check(loaded, mode: str) -> None:
    if loaded.dtype != "float32":
        raise TraceToolError(f"--runtime {mode} runs float32 programs; REF was recorded in {loaded.dtype}")
    if str(getattr(loaded, "device", "cpu")) != "cpu":
        raise TraceToolError(f"--runtime {mode} runs on the CPU; drop --device")


def make_executorch(loaded, max_seq: int):
    _check(loaded, "executorch")
    return ExecuTorchRuntime(loaded, max_seq, "executorch")


def make_executorch_int8(loaded, max_seq: int):
    _check(loaded, "executorch-int8")
    return ExecuTorchRuntime(loaded, max_seq, "executorch-int8")


def make_executorch_int8_reference(loaded, max_seq: int):
    _check(loaded, "executorch-int8-reference")
    return ExecuTorchRuntime(loaded, max_seq, "executorch-int8-reference")


def export_command(
    model_dir, mode: str, max_seq: int, out_dir, force: bool = False, calibration_ref=None, prefill_chunk=None
) -> str:
    """`trace export-pte`: write prefill.pte and decode.pte into out_dir, both or neither (the
    artifact cache's files); return a summary line. int8 calibrates on calibration_ref's prompt.
    prefill_chunk: --prefill-chunk N, resolved as a replay resolves it (resolve_prefill_chunk)."""
    from gemma4_trace.hf.model import load_model

    from .artifacts import check_output_folder, copy_all_or_none

    if mode not in MODES[:2]:
        raise TraceToolError(f"--runtime {mode!r}: export-pte writes executorch or executorch-int8 programs")
    if mode == "executorch-int8" and calibration_ref is None:
        raise TraceToolError("--runtime executorch-int8 calibrates on a trace's prompt: give --calibrate REF.h5")
    chunk = resolve_prefill_chunk(prefill_chunk, max_seq)
    _versions()
    out = Path(out_dir)
    targets = [out / f"{n}.pte" for n in PROGRAMS]
    check_output_folder(out, [t.name for t in targets], force, ".pte")
    prompt, extra = None, None
    if calibration_ref is not None:
        from .replay import read_reference

        ref = read_reference(calibration_ref)
        prompt, extra = ref.prompt_ids, ref.extra
    loaded = load_model(model_dir)
    _check(loaded, mode)
    art = cached_programs(loaded, mode, max_seq, prompt, extra, prefill_chunk=chunk)
    try:
        copy_all_or_none([art.path / t.name for t in targets], out, ".pte")
    finally:
        art.close()
    sizes = ", ".join(f"{t} ({t.stat().st_size / 2**20:.1f} MiB)" for t in targets)
    return (
        f"wrote {sizes}: {loaded.name}, {mode}, max_seq {max_seq}{f', prefill chunk {chunk}' if chunk else ''}, "
        "XNNPACK, canonical kinds as extra outputs "
        f"({art.note})"
    )


__all__ = ["DECODE_INPUTS", "PREFILL_INPUTS", "MODES", "ExecuTorchRuntime", "export_command"]
