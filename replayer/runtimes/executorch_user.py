"""`trace replay REF --pte PATH`: the user's ExecuTorch programs (executorch_file.py reads and checks
them before any model loads) run by the `executorch` row's engine (executorch_engine.py, in the child
process), driven as `--runtime executorch` drives the tool's own (executorch.py's ExecuTorchRuntime).

PATH is a folder of prefill.pte and decode.pte in the tool's layout (`trace export-pte`): the prefill
program takes functional.PREFILL_CHUNK_INPUTS then the K/V caches of the layers that write K/V, the
decode program DECODE_INPUTS then the same caches; each returns the logits, the updated caches, then
every reported kind in the order functional.output_names gives for REF's checkpoint. The programs'
MethodMeta (their inputs' and outputs' shapes and dtypes) is checked against that layout and REF's
config once the checkpoint is loaded, before anything is copied or run: the inputs' count and
dtypes, the caches' shapes (layers that write K/V, their KV heads and head_dim, max_seq), the
prefill's rows (its chunk), the vocabulary (logits), the hidden size (mm_embeds), the outputs' count
and every output's shape against an eager run of the step graph; a config difference is one line
naming the field unless --allow-config-mismatch. What runs is the private copy that was checked,
moved into the artifact cache (`pte-file/`, keyed by the files' sha256) once it hashes as it did; an
image or audio prompt's towers are the tool's own programs of REF's checkpoint (as --runtime
executorch). The provenance names the files by basename and sha256.
"""

from __future__ import annotations

import torch

from gemma4_trace.traces.layers import layer_infos_from_config

from .. import functional as F
from ..artifacts import artifact_folder, code_digest
from . import executorch_file as U
from . import onnx_user as OU
from .executorch import ExecuTorchRuntime
from .executorch_engine import ENGINE as EXECUTORCH_ENGINE

NAME = "pte-file"  # what the provenance calls a replay of the user's programs
FORMAT = 1  # bump when the copy's form changes (the cache key holds it)


def layout(user: U.UserPTE) -> tuple[list, int | None, int]:
    """(the caches' shapes, the prefill's rows, max_seq) of the tool's layout, or one line saying how
    the programs differ from it."""
    ins = user.inputs
    n_pre, n_dec = len(F.PREFILL_CHUNK_INPUTS), len(F.DECODE_INPUTS)
    caches = ins["prefill"][n_pre:]
    if len(ins["prefill"]) <= n_pre or len(ins["decode"]) <= n_dec:
        user.fail(f"prefill.pte takes {len(ins['prefill'])} inputs and decode.pte {len(ins['decode'])}: "
                  f"not the tool's step programs ({', '.join(F.PREFILL_CHUNK_INPUTS)}, then the K/V caches; "
                  f"{U.DOC})")  # fmt: skip
    if ins["decode"][n_dec:] != caches or len(caches) % 2:
        user.fail("prefill.pte and decode.pte take different K/V caches (or an odd number)")
    if any(len(c.sizes) != 4 or c.sizes[0] != 1 or c.dtype != "float32" for c in caches):
        bad = next(c for c in caches if len(c.sizes) != 4 or c.sizes[0] != 1 or c.dtype != "float32")
        user.fail(f"a K/V cache input is {bad}: the tool's caches are float32[1, KV heads, max_seq, head_dim]")
    expect = {"prefill": ["int64"] * 2 + ["float32", "bool"] + ["int64"] * 3, "decode": ["int64"] * 2}
    for g, dtypes in expect.items():
        got = [t.dtype for t in ins[g][: len(dtypes)]]
        if got != dtypes:
            names = F.PREFILL_CHUNK_INPUTS if g == "prefill" else F.DECODE_INPUTS
            i = next(i for i, (a, b) in enumerate(zip(got, dtypes)) if a != b)
            user.fail(f"{g}.pte's input {i} ({names[i]}) is {ins[g][i]}; the tool's step program takes {dtypes[i]}")
    max_seq = caches[0].sizes[2]
    rows = ins["prefill"][0].sizes[-1] if ins["prefill"][0].sizes else 0
    return caches, (None if rows == max_seq else rows), max_seq


def differences(user: U.UserPTE, loaded, caches: list) -> list[str]:
    """Where the programs' shapes differ from REF's checkpoint config (its text config)."""
    cfg = loaded.text_config
    infos = layer_infos_from_config(cfg)
    owners = [i for i, info in enumerate(infos) if info.kv_role != "reuses"]
    pairs = [("layers that write K/V", len(caches) // 2, len(owners))]
    for i, k in zip(owners, caches[::2]):
        pairs += [(f"KV heads of layer {i}", k.sizes[1], infos[i].num_kv_heads)]
        pairs += [(f"head_dim of layer {i}", k.sizes[3], infos[i].head_dim)]
    logits = user.outputs["prefill"][0].sizes if user.outputs["prefill"] else ()
    pairs += [("vocabulary", logits[-1] if logits else None, int(cfg.vocab_size))]
    hidden = user.inputs["prefill"][2].sizes
    pairs += [("hidden size", hidden[-1] if hidden else None, int(cfg.hidden_size))]
    return [f"{what} {mine} (REF {ref})" for what, mine, ref in pairs if mine is not None and mine != ref]


def expected_outputs(host: F.FunctionalKV, step: str) -> tuple[list[str], list[tuple]]:
    """(the reported kinds' output names, every output's shape) of the tool's step graph: one eager run."""
    g = F.graph(host, step, chunked=True)
    with torch.no_grad(), F.quiet():
        outs = g(*F.step_inputs(host, step, chunked=True), *F.zero_caches(host))
    return g.names, [tuple(o.shape) for o in outs]


def check_outputs(user: U.UserPTE, host: F.FunctionalKV, shapes_too: bool) -> dict:
    """program -> its reported kinds' names, once each program's outputs are the tool's layout's."""
    names = {}
    for step in F.STEPS:
        names[step], shapes = expected_outputs(host, step)
        got = user.outputs[step]
        if len(got) != len(shapes):
            user.fail(f"{step}.pte returns {len(got)} outputs; the tool's {step} program of REF's checkpoint "
                      f"returns {len(shapes)} (logits, {len(shapes) - 1 - len(names[step])} caches, "
                      f"{len(names[step])} reported kinds): lower it with `trace export-pte` ({U.DOC})")  # fmt: skip
        labels = ["logits", *("cache" for _ in range(len(shapes) - 1 - len(names[step]))), *names[step]]
        for label, mine, want in zip(labels, got, shapes) if shapes_too else ():
            if mine.sizes != want:
                user.fail(
                    f"{step}.pte's output {label!r} is {mine}; REF's checkpoint gives [{', '.join(map(str, want))}]"
                )
    return names


def copied(user: U.UserPTE):
    """The artifact holding the copy that runs: the private copy that was checked (executorch_file.py)."""

    def build(folder) -> None:
        for step in F.STEPS:
            U.place_checked(user, step, folder / f"{step}.pte")

    key = {"format": FORMAT, "files": dict(user.files), "code": code_digest("runtimes/executorch_file.py")}
    return artifact_folder("pte-file", key, build, what=f"copying {user.shown()}")


class UserPrograms(ExecuTorchRuntime):
    """The user's step programs run as --runtime executorch runs the tool's own; the prefill's rows are
    the program's (--prefill-chunk does not change them)."""

    def __init__(self, loaded, max_seq: int, user: U.UserPTE, rows, names: dict, diffs: list[str], capture=None):
        label = f"ExecuTorch {_et_version()}"
        self.start(f"{NAME} ({label})", EXECUTORCH_ENGINE)
        self.mode, self.loaded, self.max_seq, self.kinds, self.user, self.capture = (
            "executorch", loaded, max_seq, None, user, capture
        )  # fmt: skip
        chunk = f"{rows}-row prefill chunk" if rows else f"prefill over max_seq {max_seq}"
        more = "".join(f"; config differs from REF: {d}" for d in diffs)
        self.name = f"{NAME} {user.shown()} ({label}; the tool's layout, {chunk}; files: {user.files_text()}{more})"
        self.host = F.FunctionalKV(loaded, max_seq, rows)
        self.towers = {}
        if self.host.multimodal:
            self.host.encode_images = self.encode_images
        if self.host.audio_tower is not None:
            self.host.encode_audio = self.encode_audio
        self.n_caches, self.names, self.steps, self.note = 2 * len(self.host.owners()), names, None, ""

    @property
    def prefill_chunk(self) -> int | None:
        return self.host.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, rows) -> None:
        """The program's own rows stay: a lowered program's shapes are fixed."""

    def _load_steps(self, prompt=None, extra=None) -> None:
        try:
            art = copied(self.user)
            self.note = art.note
            try:
                self.child.call("load", {n: str(art.path / f"{n}.pte") for n in F.STEPS}, {}, phase="loading")
            finally:
                art.close()
        except BaseException:
            self.close()
            raise
        self.steps = {n: (lambda args, phase, n=n: self._call(n, args, phase)) for n in F.STEPS}

    def _call(self, name: str, args: list, phase: str) -> list[torch.Tensor]:
        outs = self.child.call("run", name, [t.numpy() for t in args], phase=phase)[1]
        return [torch.from_numpy(a) for a in outs]

    def report(self, probe, sites, rows: slice | None = None) -> None:
        """The kinds the replay keeps (--kinds): the programs compute every kind."""
        from .registry import captures

        super().report(probe, ((s, v) for s, v in sites if captures(self.capture, s[0])), rows)


def _et_version() -> str:
    from executorch import version

    return version.__version__


def run_file(loaded, max_seq: int, header: U.UserPTE, allow_config_mismatch: bool = False, base=None, choice=None):
    """`trace replay --pte PATH`: the user's step programs (module docstring)."""
    caches, rows, S = layout(header)
    if S != max_seq:
        header.fail(f"its programs are lowered for max_seq {S}; replay with --max-seq {S}")
    diffs = differences(header, loaded, caches)
    OU.check_config(header, diffs, allow_config_mismatch)
    host = F.FunctionalKV(loaded, max_seq, rows)
    names = check_outputs(header, host, shapes_too=not diffs)
    return UserPrograms(loaded, max_seq, header, rows, names, diffs, None if choice is None else choice.capture)
