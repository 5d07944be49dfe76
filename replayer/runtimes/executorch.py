"""`--runtime executorch`, `executorch-int8` and `executorch-int8-reference`: the static runtime's
prefill and decode steps lowered to ExecuTorch's XNNPACK backend and run by `executorch.runtime`
on CPU (extra `gemma4-trace[executorch]`).

The programs are the step graphs of replayer/functional.py: pure functions of the step inputs and
the K/V caches of the layers that own K/V, returning the logits, the updated caches and every
canonical kind the static runtime reports, as extra outputs. The host keeps the caches between
steps. The prefill program is the chunked prefill graph (`prefill_chunk_step`): N prompt rows from
a start position (an input), shapes (N, max_seq), run once per chunk of the static runtime's plan
(replayer/runtime.py: chunk_plan) and its rows stitched by position into the probe; N follows
`--prefill-chunk` as the static runtime's does (resolve_prefill_chunk: by default the whole padded
max_seq, one run, below max_seq 1024).

    executorch                  float32, every op XNNPACK takes is delegated to it
    executorch-int8             PT2E with XNNPACKQuantizer: symmetric int8, per-channel weights,
                                static per-tensor activations calibrated on REF's prompt (prefill on
                                the prompt, decode on the prompt's tokens fed one at a time), lowered
    executorch-int8-reference   the same converted PT2E program (after convert_pt2e, before
                                lowering) run by PyTorch: its quantize/dequantize pairs simulate
                                the int8 arithmetic; `trace diff REF INT8 --baseline INT8_REFERENCE`
                                shows the error XNNPACK's int8 kernels add beyond the quantization

The .pte programs are kept in the artifact cache (replayer/artifacts.py), keyed by the model's
content hash, the runtime, max_seq, the prefill chunk, the calibration prompt (int8), the
executorch/torch versions and the lowered code; so are the converted int8 programs before lowering
(torch.export's .pt2), which executorch-int8 lowers and executorch-int8-reference runs: whichever
of the two replays comes second does not quantize again. A replay that keeps some kinds
(`--kinds`: RuntimeChoice.capture) runs programs exported with only those kinds as outputs (keyed
by them too); int8 quantizes that narrowed program, calibrated on the same inputs.

    trace export-pte [--model DIR] [--runtime executorch|executorch-int8] --max-seq 32 [--prefill-chunk N] -o DIR
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import partial
from pathlib import Path

import torch

from gemma4_trace.traces.errors import TraceToolError, install_hint

from .. import functional as F
from ..artifacts import (
    artifact_folder,
    check_output_folder,
    code_digest,
    copy_all_or_none,
    model_folder_files,
    model_hash,
)
from ..child import ChildRuntime
from ..ops import ChunkProbe, resolve_prefill_chunk
from ..runtime import SOURCES as STATIC_SOURCES
from .executorch_engine import ENGINE as EXECUTORCH_ENGINE

MODES = ("executorch", "executorch-int8", "executorch-int8-reference")
PROGRAMS = F.STEPS
PT2E = "executorch-int8-pt2e"  # the artifact-cache entry of the converted (not yet lowered) int8 programs
FORMAT = 2  # bump when the programs' inputs or outputs change meaning (the cache key holds it)
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


def _graph(rt: F.FunctionalKV, name: str, kinds=None) -> F.StepGraph:
    return F.graph(rt, name, chunked=True, kinds=kinds)  # the prefill program always takes a chunk of rows


def _calibration(rt: F.FunctionalKV, prompt, extra) -> dict:
    """Calibration inputs per program from REF's prompt: the prompt's prefill chunks (caches from
    the float prefill program, chunk by chunk), and its tokens fed one at a time to decode (caches
    from the float decode graph), as a replay runs them.

    The prefill rows past the prompt hold the prompt's tokens again, not padding: the observers see
    every row a program computes, and a pad row (a zero embedding, whose input norm scales by
    1/sqrt(eps)) would set activation ranges that round the prompt's rows to zero. Those rows stay
    outside n_valid, so they write no cache and the replay never reports them."""
    caches = F.zero_caches(rt)
    n = len(caches)
    args, g, pre = rt.prepare_prefill(list(prompt), extra or {}), _graph(rt, "prefill"), []
    T = len(prompt)
    ids, ple_ids = args[0].clone(), args[1].clone()
    again = torch.arange(ids.shape[1] - T) % T
    ids[:, T:], ple_ids[:, T:] = ids[:, again], ple_ids[:, again]
    args = (ids, ple_ids, *args[2:])
    with torch.no_grad():
        for c0, _ in F.prefill_plan(rt, args, len(prompt)):
            pre.append((*F.chunk_inputs(rt, args, c0), *caches))
            caches = list(g(*pre[-1])[1 : 1 + n])
    caches = F.zero_caches(rt)
    g, dec = _graph(rt, "decode"), []
    mm = set(rt.mm_token_ids)
    with torch.no_grad():
        for pos, tok in enumerate(prompt):
            args = (torch.tensor([[rt.pad_id if int(tok) in mm else int(tok)]]), torch.tensor([pos]))
            dec.append((*args, *caches))
            caches = list(g(*args, *caches)[1 : 1 + n])
    return {"prefill": pre, "decode": dec}


def _quantized(rt: F.FunctionalKV, calibration: dict, kinds=None) -> dict:
    """name -> the converted PT2E program (quantize/dequantize pairs around int8 weights), exported
    (with `kinds` as extra outputs; None: every kind)."""
    out = {}
    for name in PROGRAMS:
        example = (*F.step_inputs(rt, name, chunked=True), *F.zero_caches(rt))
        out[name] = _pt2e(F.export_step(rt, name, chunked=True, kinds=kinds), calibration[name], example)
    return out


def _pt2e(program: torch.export.ExportedProgram, calibration, example: tuple) -> torch.export.ExportedProgram:
    """`program` quantized by PT2E with XNNPACKQuantizer (INT8_SCHEME), its observers fed each of
    `calibration` (argument tuples), converted and exported again on `example`."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    with torch.no_grad(), F.quiet():
        m = prepare_pt2e(_integer_scalars_kept(program.module()), quantizer)
        for args in calibration:
            m(*args)
        return torch.export.export(convert_pt2e(m), example, strict=False)


INT_SCALAR_OPS = {
    torch.ops.aten.add.Tensor: torch.ops.aten.add.Scalar,
    torch.ops.aten.mul.Tensor: torch.ops.aten.mul.Scalar,
}


def _integer_scalars_kept(m: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`integer tensor + scalar` (and `*`) moved to the ops' Scalar overloads, which XNNPACKQuantizer's
    transform_for_annotation leaves alone: it turns the scalar operand of every aten.add.Tensor and
    aten.mul.Tensor into a float32 tensor, so integer index arithmetic silently becomes float32 (the
    vision port's pooling cells, `(max + 1) // k`, then fail in one_hot). An upstream bug, pinned by
    tests/runtimes/test_executorch.py and written up in docs/upstream/executorch-xnnpack-int-scalars.md."""
    for n in m.graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or n.target not in INT_SCALAR_OPS or val is None or val.dtype.is_floating_point:
            continue
        if len(n.args) == 2 and isinstance(n.args[0], torch.fx.Node) and not isinstance(n.args[1], torch.fx.Node):
            n.target = INT_SCALAR_OPS[n.target]
    m.recompile()
    return m


def _one_line(what: str, e: Exception) -> TraceToolError:
    return TraceToolError(f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def converted_programs(loaded, max_seq: int, prompt, extra, host: F.FunctionalKV, kinds=None):
    """The artifact-cache entry holding the converted PT2E programs (prefill.pt2, decode.pt2,
    torch.export's format): what executorch-int8 lowers and executorch-int8-reference runs, so
    the second of the two replays of one REF does not quantize again."""

    def build(folder: Path) -> None:
        try:
            programs = _quantized(host, _calibration(host, prompt, extra), kinds)
        except Exception as e:  # noqa: BLE001 - quantization and export fail in many ways; one line for the user
            raise _one_line("quantizing the programs (PT2E)", e) from None
        for name in PROGRAMS:
            torch.export.save(programs[name], Path(folder) / f"{name}.pt2")

    return artifact_folder(
        "executorch",
        artifact_key(loaded, PT2E, max_seq, prompt, extra, host.prefill_chunk, kinds),
        build,
        what=f"quantizing the prefill and decode programs (PT2E, calibrated on the prompt{F.capture_note(kinds)})",
    )


def _read_from(art, read):
    """read(art) of an artifact (built first where it was missing), then the artifact released."""
    try:
        return read(art)
    finally:
        art.close()


def _programs_in(art) -> dict:
    """name -> the ExportedProgram of the converted programs' artifact `art` (the tool's own, hash-checked)."""
    with F.quiet():
        return {n: torch.export.load(art.path / f"{n}.pt2") for n in PROGRAMS}


def _lower(program: torch.export.ExportedProgram) -> bytes:
    """An ExportedProgram -> the .pte bytes of its XNNPACK lowering."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad(), F.quiet():
        return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer


def write_programs(rt: F.FunctionalKV, out_dir, quantized: dict | None = None, kinds=None) -> list[Path]:
    """Write prefill.pte and decode.pte into out_dir: the float programs (with `kinds` as extra
    outputs; None: every kind), or the converted `quantized` ones (executorch-int8); the prefill
    program takes rt.prefill_chunk rows (None: the whole max_seq)."""
    paths = []
    for name in PROGRAMS:
        try:
            data = _lower(quantized[name] if quantized else F.export_step(rt, name, chunked=True, kinds=kinds))
        except Exception as e:  # noqa: BLE001 - export and lowering fail in many ways; one line for the user
            raise _one_line(f"lowering the {name} program to XNNPACK", e) from None
        path = Path(out_dir) / f"{name}.pte"
        path.write_bytes(data)
        paths.append(path)
    return paths


TOWER_INPUTS = {"vision": ("pixel_values", "image_position_ids"), "audio": ("input_features", "input_features_mask")}


def _tower_key(loaded, mode: str, tower: str, inputs: tuple) -> dict:
    """What an encoder tower's program depends on: the model, the tower, its inputs' shape ((images,
    patches) or (clips, mel frames, bins)) and, for the int8 modes, the inputs themselves (their
    calibration data)."""
    key = {**artifact_key(loaded, "executorch", 1), "runtime": mode, "graph": tower}
    key[F.SHAPE_KEY[tower]] = list(inputs[0].shape[:2] if tower == "vision" else inputs[0].shape)
    del key["max_seq"], key["prefill_chunk"]
    if mode != "executorch":
        key["calibration"] = _prompt_digest([], dict(zip(TOWER_INPUTS[tower], inputs)))
    return key


def tower_inputs(tower: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tower program's inputs as it takes them: (pixels float32, positions int64) or (features
    float32, mask bool)."""
    return a.float().contiguous(), (b.long() if tower == "vision" else b.bool()).contiguous()


def _tower_graph(loaded, tower: str, inputs: tuple):
    """The port of the encoder `tower` as a graph (replayer/functional.py's VisionGraph, AudioGraph),
    its output names set by a run on `inputs` (tower_inputs')."""
    g = F.tower_graph(F.FunctionalKV(loaded, 1), tower)  # no text caches needed
    with torch.no_grad(), F.quiet():
        g(*inputs)
    return g


def converted_tower(loaded, tower: str, inputs: tuple):
    """The artifact holding <tower>.pt2 (the tower's graph PT2E-quantized as the step programs are,
    calibrated on the replay's own `inputs`: pixels and positions, or features and mask) and
    <tower>.json (its outputs' names): what executorch-int8 lowers and executorch-int8-reference runs."""

    def build(folder: Path) -> None:
        g = _tower_graph(loaded, tower, inputs)
        try:
            with torch.no_grad(), F.quiet():
                calibration = F.calibration_inputs(g, inputs)
                program = _pt2e(torch.export.export(g, inputs, strict=False), [calibration], inputs)
        except Exception as e:  # noqa: BLE001 - quantization and export fail in many ways; one line for the user
            raise _one_line(f"quantizing the {tower} program (PT2E)", e) from None
        torch.export.save(program, folder / f"{tower}.pt2")
        (folder / f"{tower}.json").write_text(json.dumps(g.names))

    return artifact_folder(
        "executorch", _tower_key(loaded, PT2E, tower, inputs), build,
        what=f"quantizing the {tower} program ({F.shape_words(tower, inputs[0].shape)}; PT2E, calibrated on them)",
    )  # fmt: skip


def _tower_in(art, tower: str) -> tuple[list[str], torch.export.ExportedProgram]:
    """(output names, the program) of the converted tower artifact `art` (the tool's own, hash-checked)."""
    with F.quiet():
        return json.loads((art.path / f"{tower}.json").read_text()), torch.export.load(art.path / f"{tower}.pt2")


def _buffers_persistent(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` with its non-persistent buffers made persistent (moved from its constants to its
    state dict). XNNPACK's lowering of a conv1d (the audio port's depthwise conv) writes the weight it
    reshapes into the state dict, then refuses it there as a non-persistent buffer (SpecViolationError)."""
    specs = program.graph_signature.input_specs
    for i, spec in enumerate(specs):
        if spec.kind == torch.export.graph_signature.InputKind.BUFFER and spec.persistent is False:
            program.state_dict[spec.target] = program.constants.pop(spec.target)
            specs[i] = dataclasses.replace(spec, persistent=True)
    return program


def tower_program(loaded, mode: str, tower: str, inputs: tuple):
    """The artifact holding <tower>.pte (and <tower>.json, its outputs' names): the port of the encoder
    `tower` for inputs of the shape of `inputs` (tower_inputs'), lowered to XNNPACK: in float32
    (executorch), or the converted int8 program calibrated on those inputs (executorch-int8)."""

    def build(folder: Path, *converted) -> None:
        if mode == "executorch":
            g = _tower_graph(loaded, tower, inputs)
            names, program = g.names, None
        else:
            names, program = _tower_in(converted[0], tower)
        try:
            with torch.no_grad(), F.quiet():
                data = _lower(_buffers_persistent(program or torch.export.export(g, inputs, strict=False)))
        except Exception as e:  # noqa: BLE001 - export and lowering fail in many ways; one line for the user
            raise _one_line(f"lowering the {tower} program to XNNPACK", e) from None
        (folder / f"{tower}.pte").write_bytes(data)
        (folder / f"{tower}.json").write_text(json.dumps(names))

    what = "float32" if mode == "executorch" else "int8 (PT2E, calibrated on them)"
    return artifact_folder(
        "executorch", _tower_key(loaded, mode, tower, inputs), build,
        needs=None if mode == "executorch" else lambda: (converted_tower(loaded, tower, inputs),),
        what=f"lowering the {tower} program ({F.shape_words(tower, inputs[0].shape)}) to XNNPACK, {what}",
    )  # fmt: skip


def _prompt_digest(prompt, extra) -> str:
    h = hashlib.sha256(json.dumps([int(t) for t in prompt]).encode())
    for k in sorted(extra or {}):
        t = torch.as_tensor(extra[k])
        h.update(k.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def artifact_key(
    loaded, mode: str, max_seq: int, prompt=None, extra=None, prefill_chunk: int | None = None, kinds=None
) -> dict:
    """What the programs depend on; prefill_chunk as resolve_prefill_chunk gives it (None: whole
    max_seq); kinds: a narrowed capture's (None: every kind, not in the key)."""
    key = {
        "format": FORMAT,
        "model": model_hash(loaded.model_dir),
        "runtime": mode,
        "max_seq": int(max_seq),
        "prefill_chunk": None if prefill_chunk is None else int(prefill_chunk),
        "code": code_digest(*STATIC_SOURCES, "functional.py", "runtimes/executorch.py"),
    }
    key.update(_versions())
    if mode in ("executorch-int8", PT2E):
        key["calibration"] = _prompt_digest(prompt, extra)
    key.update(F.capture_key(kinds))
    return key


def cached_programs(
    loaded, mode: str, max_seq: int, prompt=None, extra=None, host=None, prefill_chunk=None, kinds=None
):
    """The artifact-cache entry (replayer/artifacts.py) holding prefill.pte and decode.pte; the
    prefill program takes host.prefill_chunk rows (without a host: prefill_chunk); kinds: the
    extra outputs (None: every kind)."""
    rt = host or F.FunctionalKV(loaded, max_seq, prefill_chunk)
    what = "float32" if mode == "executorch" else "int8 (PT2E, calibrated on the prompt)"
    rows = f"{rt.prefill_chunk}-row chunk" if rt.prefill_chunk else f"max_seq {max_seq}"

    def build(folder: Path, *converted) -> None:
        write_programs(rt, folder, _programs_in(converted[0]) if converted else None, kinds)

    int8 = mode == "executorch-int8"
    return artifact_folder(
        "executorch",
        artifact_key(loaded, mode, max_seq, prompt, extra, rt.prefill_chunk, kinds),
        build,
        needs=(lambda: (converted_programs(loaded, max_seq, prompt, extra, rt, kinds),)) if int8 else None,
        what=f"lowering the prefill ({rows}) and decode programs to ExecuTorch XNNPACK, {what}{F.capture_note(kinds)}",
    )


def _in_child(child, name: str, args: list, phase: str) -> list[torch.Tensor]:
    """Program `name` run by the ExecuTorch child on args (tensors in, tensors out)."""
    return [torch.from_numpy(a) for a in child.call("run", name, [t.numpy() for t in args], phase=phase)[1]]


class ExecuTorchRuntime(ChildRuntime):
    """The lowered programs run by executorch.runtime in the child process (or, for the reference, the
    converted PT2E programs by PyTorch in this one); the host keeps the caches. The programs are built
    at the first prefill: int8's from its prompt (the calibration data)."""

    supports_prefill_chunk = True  # the driver sets prefill_chunk (--prefill-chunk)

    def __init__(self, loaded, max_seq: int, mode: str, kinds=None):
        versions = _versions()
        if mode != "executorch-int8-reference":
            # started first: its imports (torch, executorch) overlap this process's
            self.start(f"{mode} (ExecuTorch {versions['executorch']}, XNNPACK)", EXECUTORCH_ENGINE)
        self.mode, self.loaded, self.max_seq, self.kinds = mode, loaded, max_seq, kinds
        if mode == "executorch":
            self.name = f"executorch (ExecuTorch {versions['executorch']}, XNNPACK, float32)"
        elif mode == "executorch-int8":
            self.name = f"executorch-int8 (ExecuTorch {versions['executorch']}, XNNPACK; {INT8_SCHEME})"
        else:
            self.name = (
                f"executorch-int8-reference (PyTorch {versions['torch']} on the converted PT2E program; {INT8_SCHEME})"
            )
        self.host = F.FunctionalKV(loaded, max_seq)  # prepares prefill inputs
        self.towers = {}  # tower -> (its key, output names, run) of its program loaded for the last inputs
        if self.host.multimodal:
            self.host.encode_images = self.encode_images
        if self.host.audio_tower is not None:
            self.host.encode_audio = self.encode_audio
        self.n_caches = 2 * len(self.host.owners())
        self.names = {name: F.output_names(self.host, name, chunked=True, kinds=kinds) for name in PROGRAMS}
        self.steps = None  # name -> callable(list of tensors, phase) -> list of tensors
        self.note = ""
        self.prefill_chunk = resolve_prefill_chunk(None, max_seq)  # replay sets --prefill-chunk's; built at prefill

    def _load(self, prompt=None, extra=None) -> None:
        # int8 calibrates its step programs on the soft tokens of the host's float ports of the towers,
        # whichever of the two int8 modes builds them first (they share the converted programs)
        own = {k: self.host.__dict__.pop(k) for k in ("encode_images", "encode_audio") if k in self.host.__dict__}
        try:
            self._load_steps(prompt, extra)
        finally:
            self.host.__dict__.update(own)

    def _load_steps(self, prompt=None, extra=None) -> None:
        if self.mode == "executorch-int8-reference":  # PyTorch, in this process
            art = converted_programs(self.loaded, self.max_seq, prompt, extra, self.host, self.kinds)
            progs = _read_from(art, _programs_in)
            mods = {n: progs[n].module() for n in PROGRAMS}
            self.steps = {n: (lambda args, phase, m=mods[n]: list(m(*args))) for n in PROGRAMS}
            return
        try:
            art = cached_programs(self.loaded, self.mode, self.max_seq, prompt, extra, host=self.host, kinds=self.kinds)
            self.note = art.note
            try:
                self.child.call("load", {n: str(art.path / f"{n}.pte") for n in PROGRAMS}, {}, phase="loading")
            finally:
                art.close()  # the program is read into memory; a temporary (cache off) folder can go
        except BaseException:
            self.close()
            raise
        self.steps = {n: partial(_in_child, self.child, n) for n in PROGRAMS}

    def _run(self, name: str, args: tuple, probe, rows: slice):
        outs = self.steps[name]([*args, *self.caches], self.phase(name == "prefill"))
        n, names = self.n_caches, self.names[name]
        if len(outs) != 1 + n + len(names):
            raise TraceToolError(
                f"the {name} program returned {len(outs)} outputs; expected {1 + n + len(names)} "
                "(logits, caches, reported kinds)"
            )
        self.caches = [t.clone() for t in outs[1 : 1 + n]]  # outputs may live in the program's planned memory
        self.report(probe, ((F.output_site(full), value[rows].clone()) for full, value in zip(names, outs[1 + n :])))
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

    def prepare(self, input_ids, extra_inputs) -> None:
        """Lower (or take from the artifact cache) and load the programs for the prefill chunk the
        driver has set; int8 calibrates on this prompt."""
        if self.steps is None:
            self._load([int(t) for t in torch.as_tensor(input_ids).reshape(-1)], extra_inputs)

    def encode_images(self, pixels, positions, probe=None) -> torch.Tensor:
        """The images through the vision program (built for their shape on first use; the int8
        modes' quantized on the images themselves, as the step programs are on the prompt)."""
        return F.strip_vision(self._run_tower("vision", pixels, positions), positions.cpu().numpy(), probe)

    def encode_audio(self, features, features_mask, probe=None) -> torch.Tensor:
        """The audio clips through the audio program (as the images through the vision program)."""
        return F.strip_audio(self._run_tower("audio", features, features_mask), probe)

    def _run_tower(self, tower: str, a, b) -> dict:
        """The program of the encoder `tower` run on its inputs (a, b): {output name: array}; built and
        loaded for them where the last one was another's."""
        inputs = tower_inputs(tower, a, b)
        key = _tower_key(self.loaded, self.mode, tower, inputs)
        if self.towers.get(tower, (None,))[0] != key:
            self.towers[tower] = (key, *self._load_tower(tower, inputs))
        _, names, run = self.towers[tower]
        return dict(zip(names, (o.numpy() for o in run(list(inputs)))))

    def _load_tower(self, tower: str, inputs: tuple):
        """(output names, run: list of tensors -> list of tensors) of the tower's program for `inputs`."""
        if self.mode == "executorch-int8-reference":  # the converted program, by PyTorch in this process
            names, program = _read_from(converted_tower(self.loaded, tower, inputs), partial(_tower_in, tower=tower))
            module = program.module()
            return names, lambda args: [t.detach() for t in module(*args)]
        art = tower_program(self.loaded, self.mode, tower, inputs)
        try:
            names = json.loads((art.path / f"{tower}.json").read_text())
            self.child.call("load", {tower: str(art.path / f"{tower}.pte")}, {}, phase="loading")
        finally:
            art.close()
        return names, lambda args: _in_child(self.child, tower, args, self.phase(True))

    def prefill(self, input_ids, extra_inputs, probe):
        """The prefill program once per chunk of the plan, the caches carried from one run to the
        next; each run's new rows go to the probe, stitched by position (ChunkProbe)."""
        ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        if self.steps is None:
            self._load(ids, extra_inputs)
        args = self.host.prepare_prefill(ids, extra_inputs, probe)
        self.caches = F.zero_caches(self.host)
        chunks = ChunkProbe(probe) if probe is not None else None
        for c0, rows in F.prefill_plan(self.host, args, len(ids)):
            logits = self._run("prefill", F.chunk_inputs(self.host, args, c0), chunks, rows)
        if chunks is not None:
            chunks.flush()
        return logits  # the last run holds position T - 1

    def decode(self, token_id, position, probe):
        tok = self.host.pad_id if int(token_id) in self.host.mm_token_ids else int(token_id)
        args = (torch.tensor([[tok]], dtype=torch.long), torch.tensor([position], dtype=torch.long))
        return self._run("decode", args, probe, slice(0, 1))


def create(loaded, max_seq: int, choice):
    return ExecuTorchRuntime(loaded, max_seq, choice.name, choice.capture)


def export_command(request) -> str:
    """`trace export --runtime executorch[-int8]` (`export-pte`; `request` an ExportRequest,
    spec.py): write prefill.pte and decode.pte into its folder, both or neither (the artifact
    cache's files); return a summary line. int8 calibrates on the calibration prompt ((prompt
    ids, extra inputs) of a REF). --prefill-chunk N is resolved as a replay resolves it."""
    from gemma4_trace.hf.model import load_model

    model_dir, mode, max_seq, out_dir, force = request.basics()
    calibration_prompt, prefill_chunk = request.calibration_prompt, request.prefill_chunk

    if mode not in MODES[:2]:
        raise TraceToolError(f"--runtime {mode!r}: export-pte writes executorch or executorch-int8 programs")
    if mode == "executorch-int8" and calibration_prompt is None:
        raise TraceToolError("--runtime executorch-int8 calibrates on a trace's prompt: give --calibrate REF.h5")
    chunk = resolve_prefill_chunk(prefill_chunk, max_seq)
    out = Path(out_dir)
    targets = [out / f"{n}.pte" for n in PROGRAMS]
    check_output_folder(out, [t.name for t in targets], force, ".pte", inputs=model_folder_files(model_dir))
    prompt, extra = calibration_prompt or (None, None)
    loaded = load_model(model_dir)
    if loaded.dtype != "float32":
        raise TraceToolError(f"--runtime {mode} runs in float32; the model was loaded in {loaded.dtype}")
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
