"""The static runtime as pure functions of tensors: what the ONNX and ExecuTorch runtimes lower.

A step graph is one step as a function, (step inputs..., K/V caches...) -> (logits, updated
caches..., reported kinds...): the caches of the layers that own K/V are inputs and outputs (no
in-place buffer writes; the host keeps them between steps, as an NPU runtime's host code would),
and every canonical kind the static runtime reports through its probe becomes an extra output,
named `<kind>` or `L07.<kind>` (the step graphs' capture map, runtimes/captures.py's STEP_GRAPH;
output_site reads a name back); a graph made with `kinds` (a narrowed capture:
RuntimeChoice.capture) has only those kinds as outputs, and what only the others needed is dead
code the exporters drop (the logits' own computation is unchanged). The prefill graph runs N
prompt rows from a start position (the static runtime's prefill chunk; N = max_seq: the whole
padded prompt in one run), the decode graph one token.

    rt = FunctionalKV(loaded, max_seq)
    prog = export_step(rt, "decode")        # torch.export.ExportedProgram, static shapes
    logits, *rest = prog.module()(*step_inputs(rt, "decode"), *zero_caches(rt))
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import torch
from torch import nn

from gemma4_trace.traces import schema as S

from .api import report
from .child import ChildRuntime
from .ops import rms_norm
from .runtime import StaticGemma4Runtime, chunk_plan
from .runtimes.captures import STEP_GRAPH_TOWERS
from .static_audio import AUDIO

PREFILL_INPUTS = ("ids", "ple_ids", "mm_embeds", "mm_slots", "block_ids", "n_valid")
PREFILL_CHUNK_INPUTS = (*PREFILL_INPUTS, "start")
DECODE_INPUTS = ("token", "input_pos")
STEPS = ("prefill", "decode")


class ListProbe:
    """Collects the probe's reports while a graph is traced: each becomes a graph output (those of
    `kinds` only; None: every kind)."""

    def __init__(self, kinds=None):
        self.kinds = None if kinds is None else frozenset(kinds)
        self.names: list[str] = []
        self.values: list[torch.Tensor] = []

    def tensor(self, kind, value, layer=None, tower=S.TEXT):
        key = S.kind_key(kind, tower)
        if self.kinds is not None and key not in self.kinds:
            return
        self.names.append(output_name(key, layer))
        self.values.append(value)


def output_name(kind: str, layer: int | None) -> str:
    """A reported kind's output name (the step graphs' capture map, runtimes/captures.py): "L07.q",
    "embeddings", "vision.L00.q", "audio.L01.lconv_out"."""
    return STEP_GRAPH_TOWERS.name_of(kind, layer)


def output_site(name: str) -> tuple[str, int | None]:
    """An extra output's name -> (kind key, layer): "L07.q" -> ("q", 7), "embeddings" -> ("embeddings",
    None), "vision.L00.q" -> ("vision.q", 0)."""
    site = STEP_GRAPH_TOWERS.site_of(name)
    if site is None:
        raise ValueError(f"{name!r} is no output name of a step graph")
    return site.key, site.layer


class FunctionalKV(StaticGemma4Runtime):
    """The static runtime with its KV caches passed in and returned (no in-place buffer writes)."""

    def owners(self) -> list[int]:
        return [i for i, info in enumerate(self.infos) if info.kv_role != "reuses"]

    def _write_kv(self, i, k_t, v_t, input_pos, valid):
        kc, vc = self._kv[i]
        if valid is None:
            kc, vc = kc.index_copy(2, input_pos, k_t), vc.index_copy(2, input_pos, v_t)
        elif k_t.shape[2] < kc.shape[2]:  # a prefill chunk: its rows at input_pos, padding rows zero
            keep = valid[None, None, :, None]
            kc = kc.index_copy(2, input_pos, torch.where(keep, k_t, torch.zeros_like(k_t)))
            vc = vc.index_copy(2, input_pos, torch.where(keep, v_t, torch.zeros_like(v_t)))
        else:  # prefill rewrites the whole cache; padding rows are zero
            keep = valid[None, None, :, None]
            kc, vc = torch.where(keep, k_t, torch.zeros_like(k_t)), torch.where(keep, v_t, torch.zeros_like(v_t))
        self._kv[i] = (kc, vc)

    def _read_kv(self, i, input_pos):
        return self._kv[self.infos[i].kv_source]


def zero_caches(rt: FunctionalKV) -> list[torch.Tensor]:
    """Empty K/V caches in the graphs' order: (k, v) of each owning layer, (1, kv_heads, max_seq, head_dim)."""
    return [
        torch.zeros(1, rt.infos[i].num_kv_heads, rt.max_seq, rt.infos[i].head_dim, dtype=rt.dtype)
        for i in rt.owners()
        for _ in ("k", "v")
    ]


def cache_names(rt: FunctionalKV) -> list[str]:
    return [f"L{i:02d}.{c}_cache" for i in rt.owners() for c in ("k", "v")]


class StepGraph(nn.Module):
    """One step as a function: (step inputs..., caches...) -> (logits, caches..., reported kinds...).
    `chunked`: the prefill takes PREFILL_CHUNK_INPUTS (N rows from `start`), else PREFILL_INPUTS
    over the whole padded max_seq. `kinds`: the reported kinds that become outputs (None: every
    kind). `names` holds the reported kinds' output names after a call."""

    def __init__(self, rt: FunctionalKV, step: str, chunked: bool = False, kinds=None):
        super().__init__()
        self.rt, self.step, self.chunked, self.kinds, self.names = rt, step, chunked, kinds, None

    def forward(self, *args):
        rt = self.rt
        if self.step == "decode":
            inputs = DECODE_INPUTS
        else:
            inputs = PREFILL_CHUNK_INPUTS if self.chunked else PREFILL_INPUTS
        step, caches = args[: len(inputs)], args[len(inputs) :]
        rt._kv = {i: (caches[2 * j], caches[2 * j + 1]) for j, i in enumerate(rt.owners())}
        probe = ListProbe(self.kinds)
        if self.step == "decode":
            logits = rt.decode_step(*step, probe=probe)
        elif self.chunked:
            *rows, start = step
            input_pos = start + torch.arange(rows[0].shape[1], device=start.device)
            logits = rt.prefill_chunk_step(*rows, input_pos, probe=probe)
        else:
            logits = rt.prefill_step(*step, probe=probe)
        self.names = probe.names
        return (logits, *(t for i in rt.owners() for t in rt._kv[i]), *probe.values)


class VisionGraph(nn.Module):
    """The vision tower's port as a function of tensors, every shape static: (pixels (images, patches,
    3 p^2), positions (images, patches, 2)) -> ("kept": which pooled tokens cover real patches, then
    every vision site with its padding rows, "vision.soft_tokens" among them); the host strips the
    padding (VisionOutputs)."""

    def __init__(self, rt: FunctionalKV):
        super().__init__()
        self.tower, self.names = rt.vision_tower, None

    def forward(self, pixels, positions):
        probe = ListProbe()
        _, kept = self.tower.run(pixels, positions, probe, padded=True)
        self.names = ["kept", *probe.names]
        return (kept, *probe.values)


def vision_inputs(rt: FunctionalKV, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Example inputs of the vision graph for `shape` (images, patches): one real patch per image."""
    images, patches = shape
    side = rt.vision_tower.patch_proj.shape[1]
    positions = torch.full((images, patches, 2), -1, dtype=torch.long)
    positions[:, 0] = 0
    return torch.zeros(images, patches, side, dtype=rt.dtype), positions


def strip_vision(outputs: dict, positions: np.ndarray, probe) -> torch.Tensor:
    """A vision graph's outputs ({name: array}) -> the soft tokens of the real patches (tokens, hidden),
    each site's real rows reported to `probe` (patches: the real ones; pooled tokens: `kept`)."""
    valid, kept = (positions != -1).all(axis=-1), outputs["kept"].astype(bool)
    for name, value in outputs.items():
        if name == "kept":
            continue
        key, layer = output_site(name)
        spec = S.KIND_BY_NAME[key]
        rows = value[kept] if spec.index == S.ROW_SOFT_TOKEN else value[valid]
        report(probe, spec.name, torch.from_numpy(np.ascontiguousarray(rows)), layer=layer, tower=spec.tower)
    return torch.from_numpy(np.ascontiguousarray(outputs["vision.soft_tokens"][kept]))


class AudioGraph(nn.Module):
    """The audio tower's port as a function of tensors, every shape static: (features (clips, mel
    frames, bins) float32, mask (clips, mel frames) bool) -> ("valid": which subsampled frames are
    real (clips, frames), then every audio site with its padding frames (clips, frames, width),
    "audio.soft_tokens" among them); the host strips the padding (strip_audio). StaticAudio.run's
    steps, each by the port's own method; only the valid frames' selection is left to the host."""

    def __init__(self, rt: FunctionalKV):
        super().__init__()
        self.tower, self.names = rt.audio_tower, None

    def forward(self, features, mask):
        t, probe = self.tower, ListProbe()
        x, valid = t.subsample(features, mask.bool())
        report(probe, "subsampled", x, tower=AUDIO)
        rel, allowed = t.relative_positions(x.dtype), t.attention_mask(valid)
        for i, layer in enumerate(t.layers):
            x = t.layer(layer, i, x, rel, allowed, ..., probe)  # `...`: each site's every frame (x[...] is x)
        out = torch.nn.functional.linear(x, t.output_proj, t.output_bias)
        report(probe, "output_proj", out, tower=AUDIO)
        soft = torch.nn.functional.linear(rms_norm(out, None, t.embed_eps), t.embed_proj)  # per frame, as run's
        report(probe, "soft_tokens", soft, tower=AUDIO)
        self.names = ["valid", *probe.names]
        return (valid, *probe.values)


def audio_inputs(rt: FunctionalKV, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Example inputs of the audio graph for `shape` (clips, mel frames, bins): every frame valid."""
    return torch.zeros(shape, dtype=torch.float32), torch.ones(shape[:2], dtype=torch.bool)


def strip_audio(outputs: dict, probe) -> torch.Tensor:
    """An audio graph's outputs ({name: array}) -> the soft tokens of the valid frames (tokens, hidden),
    clip after clip, each site's valid frames reported to `probe` (as StaticAudio reports them)."""
    valid = outputs["valid"].astype(bool)
    for name, value in outputs.items():
        if name == "valid":
            continue
        key, layer = output_site(name)
        spec = S.KIND_BY_NAME[key]
        report(probe, spec.name, torch.from_numpy(np.ascontiguousarray(value[valid])), layer=layer, tower=spec.tower)
    return torch.from_numpy(np.ascontiguousarray(outputs["audio.soft_tokens"][valid]))


TOWER_GRAPHS = {"vision": ("pixels", "positions"), "audio": ("features", "mask")}  # each tower graph's inputs
SHAPE_KEY = {"vision": "images", "audio": "clips"}  # the cache-key entry of a tower graph's static shape


def tower_graph(rt: FunctionalKV, tower: str) -> VisionGraph | AudioGraph:
    """The graph of the encoder `tower` ("vision", "audio") of rt's ports, in eval mode."""
    return (VisionGraph if tower == "vision" else AudioGraph)(rt).eval()


def tower_inputs(rt: FunctionalKV, tower: str, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Example inputs of a tower graph for `shape`: (images, patches) or (clips, mel frames, bins)."""
    return vision_inputs(rt, shape) if tower == "vision" else audio_inputs(rt, shape)


def shape_words(tower: str, shape: tuple) -> str:
    """A tower graph's shape for people: "2 image(s) of 256 patches", "1 clip(s) of 308 mel frames"."""
    what = "image(s) of {} patches" if tower == "vision" else "clip(s) of {} mel frames"
    return f"{shape[0]} {what.format(shape[1])}"


def vision_calibration(images: tuple, k: int, table: int) -> tuple:
    """The vision graph's calibration inputs from the replay's `images` (pixels, positions), each
    image's padding patches made real: they extend its grid down into the pooled tokens no real
    patch covers (k x k patches per token, positions below `table`), their pixels the image's real
    ones in turn. As for the text programs' pad rows: a padding token pools to zero, its norm scales
    it by 1/sqrt(eps), and per-tensor activation ranges set by it round the real tokens to zero (all
    soft tokens 0 on the image golden). The real patches and what they pool to are computed as in
    the replay (attention and pooling ignore padding), on ranges they set themselves."""
    pixels, positions = (t.clone() for t in images)
    tokens = pixels.shape[1] // (k * k)
    for i in range(pixels.shape[0]):
        valid = (positions[i] != -1).all(dim=-1)
        real, pad = valid.nonzero()[:, 0], (~valid).nonzero()[:, 0]
        if not len(real) or not len(pad):
            continue
        width = max(1, (int(positions[i, real, 0].max()) + 1) // k)
        covered = {int(c) for c in positions[i, real, 0] // k + width * (positions[i, real, 1] // k)}
        grid = [
            (c % width * k + dx, c // width * k + dy)
            for c in range(tokens) if c not in covered
            for dy in range(k) for dx in range(k)
        ]  # fmt: skip
        grid = [p for p in grid if max(p) < table][: len(pad)]
        pixels[i, pad] = pixels[i, real[torch.arange(len(pad)) % len(real)]]
        positions[i, pad[: len(grid)]] = torch.tensor(grid, dtype=positions.dtype).reshape(-1, 2)
        positions[i, pad[len(grid) :]] = positions[i, real[torch.arange(len(pad) - len(grid)) % len(real)]]
    return pixels, positions


def calibration_inputs(g: VisionGraph | AudioGraph, inputs: tuple) -> tuple:
    """A tower graph's calibration inputs (a PT2E quantization's: runtimes/executorch.py) from the
    replay's own `inputs`: the images with their padding patches made real (vision_calibration); the
    audio clips as they are (a padding frame is zeroed before each subsampling conv and stays within
    the real frames' ranges: no norm scales it up)."""
    if isinstance(g, VisionGraph):
        return vision_calibration(inputs, g.tower.pooling, g.tower.position_table.shape[1])
    return inputs


def graph(rt: FunctionalKV, step: str, chunked: bool = False, kinds=None) -> StepGraph:
    return StepGraph(rt, step, chunked, kinds).eval()


def chunk_inputs(rt: FunctionalKV, args: tuple, c0: int) -> tuple:
    """prepare_prefill's tensors -> the chunked prefill graph's step inputs for its rows from position c0."""
    ids, ple_ids, mm_embeds, mm_slots, block_ids, n_valid = args
    rows = slice(c0, c0 + (rt.prefill_chunk or rt.max_seq))
    return (ids[:, rows], ple_ids[:, rows], mm_embeds[:, rows], mm_slots[:, rows], block_ids, n_valid, torch.tensor(c0))


def prefill_plan(rt: FunctionalKV, args: tuple, T: int) -> list[tuple[int, slice]]:
    """The chunked prefill graph's runs for a T-token prompt: [(first position, its rows that are reported)]."""
    N = rt.prefill_chunk or rt.max_seq
    return chunk_plan(T, N, rt.max_seq, args[4].cpu() if rt.bidir_vision else None)


def step_inputs(rt: FunctionalKV, step: str, chunked: bool = False) -> tuple:
    """Example step inputs (shapes and dtypes only: every shape is fixed by max_seq and the prefill chunk)."""
    dev = rt.embed.device
    if step == "decode":
        return torch.zeros(1, 1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
    args = rt.prepare_prefill([0], {})
    return chunk_inputs(rt, args, 0) if chunked else args


def output_names(rt: FunctionalKV, step: str, chunked: bool = False, kinds=None) -> list[str]:
    """The reported kinds' output names of a step graph (of `kinds`; None: every kind), in order
    (one eager run)."""
    g = graph(rt, step, chunked, kinds)
    with torch.no_grad():
        g(*step_inputs(rt, step, chunked), *zero_caches(rt))
    return g.names


def export_step(rt: FunctionalKV, step: str, chunked: bool = False, kinds=None) -> torch.export.ExportedProgram:
    """torch.export of a step graph with static shapes (`kinds`' outputs only; None: every kind)."""
    with torch.no_grad(), quiet():
        return torch.export.export(
            graph(rt, step, chunked, kinds), (*step_inputs(rt, step, chunked), *zero_caches(rt)), strict=False
        )


def capture_key(kinds) -> dict:
    """The cache-key entry of a narrowed capture: {"kinds": sorted kinds}; {} for every kind (None),
    so that a full capture's artifacts keep their keys."""
    return {} if kinds is None else {"kinds": sorted(kinds)}


def capture_note(kinds) -> str:
    """What a build line says of a narrowed capture ("" for every kind)."""
    if kinds is None:
        return ""
    return f", outputs {', '.join(sorted(kinds))} only" if kinds else ", no kinds as outputs"


@contextlib.contextmanager
def quiet():
    """Exporters print pages of warnings and progress for a successful export: keep them off the console."""
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


PT2_OUTPUTS = "gemma4_trace_outputs.json"  # the .pt2's extra file: its outputs' names (diff/node_data.py reads it)


def _namespace(name: str) -> tuple[str, str]:
    """An output's (module path, namespace) for Model Explorer: a layer's sites in "layer_<i>" (a
    tower's in "vision_layer_<i>"), a site of no layer in its own ("embeddings"), logits in "logits"."""
    if name == "logits":
        return ("", "logits")
    if name.endswith("_cache"):  # L00.k_cache
        return (f"layers.{int(name[1 : name.index('.')])}", "layer")
    key, layer = output_site(name)
    tower, _, kind = key.rpartition(".")
    prefix = f"{tower}_" if tower else ""
    return (f"layers.{layer}", f"{prefix}layer") if layer is not None else ("", prefix + kind)


def _place(nodes: list, output: str) -> None:
    path, space = _namespace(output)
    for n in nodes:
        n.meta["nn_module_stack"] = {space + path: (path, space)}


def named_program(program: torch.export.ExportedProgram, outputs: list[str]) -> torch.export.ExportedProgram:
    """`program` with each output's node named after it ("L02.attn_out" -> node `L02_attn_out`, a
    cache's `L00_k_cache`, `logits`) and every node placed in the namespace of the next output it
    leads to (`layer_2`, `embeddings`, `logits`: nn_module_stack, which Model Explorer draws as
    groups), instead of torch.export's op-numbered names in one flat graph. Names and metadata only:
    the program computes what it did."""
    graph, specs = program.graph, program.graph_signature.output_specs
    named: dict = {}
    for name, node in zip(outputs, graph.output_node().args[0]):
        if isinstance(node, torch.fx.Node) and node.op == "call_function" and node not in named:
            named[node] = name
    for node, name in named.items():
        old = node.name
        node._rename(name.replace(".", "_"))  # unique within the graph (FX's own namespace)
        for spec in specs:
            if getattr(spec.arg, "name", None) == old:
                spec.arg.name = node.name
    pending: list = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        pending.append(node)
        if node in named:
            _place(pending, named[node])
            pending = []
    _place(pending, "logits")
    program.graph_module.recompile()
    return program


def export_pt2_command(model_dir, max_seq: int, out_dir, force: bool = False) -> str:
    """`trace export-pt2`: the static runtime's prefill and decode steps as torch.export programs
    (prefill.pt2, decode.pt2; what Model Explorer opens and `trace diff --node-data --graph`
    overlays), each with the names of its outputs ("logits", the caches, the reported kinds)."""
    import json
    import tempfile
    from pathlib import Path

    from gemma4_trace.hf.model import load_model

    from .artifacts import check_output_folder, copy_all_or_none, model_folder_files

    out = Path(out_dir)
    names = [f"{s}.pt2" for s in STEPS]
    check_output_folder(out, names, force, ".pt2", inputs=model_folder_files(model_dir))
    loaded = load_model(model_dir)
    rt = FunctionalKV(loaded, max_seq)
    with tempfile.TemporaryDirectory() as tmp:
        for step in STEPS:
            outputs = ["logits", *cache_names(rt), *output_names(rt, step)]
            with quiet():
                torch.export.save(
                    named_program(export_step(rt, step), outputs),
                    str(Path(tmp) / f"{step}.pt2"),
                    extra_files={PT2_OUTPUTS: json.dumps(outputs)},
                )
        copy_all_or_none([Path(tmp) / n for n in names], out, ".pt2")
    sizes = ", ".join(f"{n} ({(out / n).stat().st_size / 2**20:.1f} MiB)" for n in names)
    return f"wrote {sizes} into {out}: {loaded.name}, the static runtime's steps at max_seq {max_seq}"


class StepGraphRuntime(ChildRuntime):
    """The step graphs of replayer/functional.py run by an engine in the child process (the
    replayer/child.py protocol of runtimes/onnx_engine.py: "load" {graph: path}, "run" graph {input: array} ->
    outputs in the graph's order); the host keeps the caches between steps."""

    vision_artifact = None  # (images, patches) -> the artifact holding vision<suffix>; None: the host's port
    audio_artifact = None  # (clips, mel frames, bins) -> the artifact holding audio<suffix>; None: the host's port

    def load_graphs(self, label: str, engine: str, loaded, max_seq: int, artifact, suffix: str, options) -> None:
        """Start the child, build the host's prefill inputs, take the graphs from `artifact()` (an
        artifact-cache entry holding prefill<suffix> and decode<suffix>) and load them. With a
        `vision_artifact` (`audio_artifact`), the prompt's images (audio clips) run through the
        engine's vision (audio) graph, built for their shape when first seen, else through the
        host's port of the tower."""
        child = self.start(label, engine)
        self.suffix, self.options, self.tower_shapes = suffix, options, {}
        try:
            self.host = FunctionalKV(loaded, max_seq)  # prepares prefill inputs
            if self.vision_artifact is not None and self.host.multimodal:
                self.host.encode_images = self.encode_images
            if self.audio_artifact is not None and self.host.audio_tower is not None:
                self.host.encode_audio = self.encode_audio
            art = artifact()
            try:
                paths = {g: str(art.path / f"{g}{suffix}") for g in STEPS}
                meta = child.call("load", paths, options, phase="loading")[1]
            finally:
                art.close()  # a loaded graph is in memory; a temporary folder (cache off) goes now
        except BaseException:
            self.close()
            raise
        self.outputs = {g: outs for g, (_, outs) in meta.items()}
        self.artifact_note = art.note
        self.caches = {n: c.numpy() for n, c in zip(cache_names(self.host), zero_caches(self.host))}

    def _run(self, graph: str, feeds: dict, probe, rows: slice):
        names = self.outputs[graph]
        outs = dict(
            zip(names, self.child.call("run", graph, {**feeds, **self.caches}, phase=self.phase(graph == "prefill"))[1])
        )
        for n in self.caches:
            self.caches[n] = outs[f"{n}_out"]
        kinds = [n for n in names if n != "logits" and not n.endswith("_cache_out")]
        self.report(probe, ((output_site(n), outs[n]) for n in kinds), rows)
        return torch.from_numpy(outs["logits"])

    def run_tower(self, tower: str, artifact, shape: tuple, feeds: dict) -> dict:
        """Tower graph `tower` ("vision", "audio") run on `feeds` ({input: array}): {output: array}; the
        graph for `shape` taken from `artifact(shape)` and loaded when the shape is first seen."""
        if self.tower_shapes.get(tower) != shape:
            art = artifact(shape)
            try:
                meta = self.child.call("load", {tower: str(art.path / f"{tower}{self.suffix}")}, self.options,
                                       phase="loading")[1]  # fmt: skip
            finally:
                art.close()
            self.outputs[tower], self.tower_shapes[tower] = meta[tower][1], shape
        outs = self.child.call("run", tower, feeds, phase=self.phase(True))[1]
        return dict(zip(self.outputs[tower], outs))

    def encode_images(self, pixels, positions, probe=None) -> torch.Tensor:
        """The images through the engine's vision graph (loaded for their shape on first use)."""
        pos = positions.cpu().numpy()
        feeds = {"pixels": pixels.cpu().numpy(), "positions": pos}
        outs = self.run_tower("vision", self.vision_artifact, tuple(int(d) for d in pixels.shape[:2]), feeds)
        return strip_vision(outs, pos, probe)

    def encode_audio(self, features, features_mask, probe=None) -> torch.Tensor:
        """The audio clips through the engine's audio graph (loaded for their shape on first use)."""
        feeds = {"features": features.float().cpu().numpy(), "mask": features_mask.bool().cpu().numpy()}
        outs = self.run_tower("audio", self.audio_artifact, tuple(int(d) for d in features.shape), feeds)
        return strip_audio(outs, probe)

    def prefill(self, input_ids, extra_inputs, probe):
        args = self.host.prepare_prefill(input_ids, extra_inputs, probe)
        feeds = {n: a.cpu().numpy() for n, a in zip(PREFILL_INPUTS, args)}
        return self._run("prefill", feeds, probe, slice(0, len(input_ids)))

    def decode(self, token_id, position, probe):
        tok = self.host.pad_id if int(token_id) in self.host.mm_token_ids else int(token_id)
        feeds = {"token": np.array([[tok]], dtype=np.int64), "input_pos": np.array([position], dtype=np.int64)}
        return self._run("decode", feeds, probe, slice(0, 1))
