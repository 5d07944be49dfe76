"""`--runtime llama.cpp` on image prompts: the project's mmproj conversion of the vision tower
(replayer/runtimes/llamacpp/gguf_mmproj.py) run by llama.cpp's mtmd, every named vision node
captured, the soft tokens decoded between the prompt's text tokens (llamacpp/mtmd.py)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from PIL import Image  # noqa: E402

from gemma4_trace.diff import diff_traces  # noqa: E402
from gemma4_trace.diff.tolerances import resolve_tolerances  # noqa: E402
from gemma4_trace.hf.model import embedded_model_dir, load_model  # noqa: E402
from gemma4_trace.recorder.golden import golden_path  # noqa: E402
from gemma4_trace.replayer.replay import replay_trace  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp import gguf_mmproj as GM  # noqa: E402
from gemma4_trace.replayer.runtimes.llamacpp.runtime import IMAGE_TOKENS_ENV, image_rgb, image_runs  # noqa: E402
from gemma4_trace.replayer.runtimes.registry import BY_NAME  # noqa: E402
from gemma4_trace.traces import schema as S  # noqa: E402
from gemma4_trace.traces.reader import TraceReader  # noqa: E402
from tests.support.cli import invoke, one_line_error  # noqa: E402

pytestmark = pytest.mark.slow  # converts and runs llama.cpp; make test-fast skips it

PROFILE = str(resolve_tolerances(BY_NAME["llama.cpp"].profile))
VISION = [k.key for k in S.TOWER_BY_NAME["vision"].kinds]


def _rel(x, y) -> float:
    x, y = x.reshape(len(x), -1).astype(np.float64), y.reshape(len(y), -1).astype(np.float64)
    return float((np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)).max())


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    """The two image goldens replayed through llama.cpp (F32): {name: (REF, RUN)}; the GGUF and
    mmproj conversions cached (a one-line test's stderr then holds no "converting" line)."""
    out = {}
    for name in ("image", "two_images"):
        run = tmp_path_factory.mktemp("llama-vision") / f"{name}.h5"
        summary = replay_trace(golden_path(name), run, runtime="llama.cpp")
        assert "llama.cpp:F32" in summary and "tokens agree" in summary, summary
        out[name] = (golden_path(name), run)
    return out


@pytest.mark.parametrize("name", ["image", "two_images"])
def test_every_vision_site_is_llamacpps_own_and_within_the_profile(replays, name):
    ref, run = replays[name]
    res = diff_traces(ref, run, PROFILE)
    assert res.match, res.to_json()["first_divergence"]
    with TraceReader(ref) as a, TraceReader(run) as b:
        for key in VISION:
            for site in S.sites_of(key, a.towers["vision"].layers):
                x, y = a.read(key, site.layer), b.read(key, site.layer)
                assert x.shape == y.shape, (key, site.layer, x.shape, y.shape)  # the real patches, image after image
                # llama.cpp's own arithmetic (F16 im2col, FP16 GELU table): not a copy of REF, close to it
                assert 0 < _rel(x, y) < 3e-3, (key, site.layer, _rel(x, y))
        assert _rel(a.read("vision.soft_tokens"), b.read("vision.soft_tokens")) < 1e-3  # the target
        # the soft tokens are what the text model is fed at the image's slots (llama.cpp's embeddings node)
        token = load_model(weights=False).model.config.image_token_id
        slots = [r for start, n in image_runs([int(t) for t in a.prompt_ids], token) for r in range(start, start + n)]
        assert len(slots) == len(b.read("vision.soft_tokens"))
        assert np.array_equal(b.read("embeddings")[slots], b.read("vision.soft_tokens"))


def test_the_image_handed_to_mtmd_is_the_processors_pixels():
    """The demo image (64x64: the processor keeps its size) rebuilt from the trace's patches is the
    PNG's pixels exactly; padding patches (position -1) are left out."""
    with TraceReader(golden_path("two_images")) as r:
        pixels, positions = r.extra_input("pixel_values"), r.extra_input("image_position_ids")
    patch = int(load_model(weights=False).model.config.vision_config.patch_size)
    for i, png in enumerate(("example.png", "example_wide.png")):
        want = np.asarray(Image.open(embedded_model_dir() / png).convert("RGB"))
        rgb, exact = image_rgb(np.asarray(pixels[i]), np.asarray(positions[i]), patch)
        assert exact and rgb.shape == want.shape and np.array_equal(rgb, want), png
    assert image_runs([5, 9, 9, 9, 5, 9, 9, 6], 9) == [(1, 3), (5, 2)]


def test_mtmds_own_token_budget_is_a_count_mismatch_in_one_line(tmp_path, monkeypatch, replays):
    """mtmd's default budget is 70 to 1120 soft tokens: the 64-token image is resized to 81."""
    monkeypatch.setenv(IMAGE_TOKENS_ENV, "mtmd")
    run = tmp_path / "run.h5"
    res = invoke("replay", golden_path("image"), "--runtime", "llama.cpp", "-o", run)
    one_line_error(res, "llama.cpp's mtmd made 81 soft tokens of image 1 where the trace has 64", "70 to 1120", out=run)
    monkeypatch.setenv(IMAGE_TOKENS_ENV, "9,x")
    res = invoke("replay", golden_path("image"), "--runtime", "llama.cpp", "-o", run)
    one_line_error(res, f"{IMAGE_TOKENS_ENV}='9,x': expected mtmd, or MIN,MAX", out=run)


def test_mmproj_holds_what_mtmds_gemma4v_loader_reads(tmp_path):
    loaded = load_model()
    path = tmp_path / "mmproj.gguf"
    GM.write(loaded, path)
    r = gguf.GGUFReader(path)
    fields = {f.name: f for f in r.fields.values()}

    def value(key):
        f = fields[key]
        return f.contents()

    vc = loaded.model.config.vision_config
    assert value("general.architecture") == "clip" and value("clip.vision.projector_type") == "gemma4v"
    assert value("clip.vision.block_count") == vc.num_hidden_layers
    assert value("clip.vision.projector.scale_factor") == vc.pooling_kernel_size == 2
    assert value("clip.use_gelu") is True
    tensors = {t.name: t for t in r.tensors}
    p, d = vc.patch_size, vc.hidden_size
    assert tuple(tensors["v.patch_embd.weight"].shape[::-1]) == (d, 3, p, p)
    # the kernel's (channel, row, col) is the projection's (row, col, channel) column
    w = loaded.model.model.vision_tower.patch_embedder.input_proj.weight.detach().numpy()
    kernel = np.asarray(tensors["v.patch_embd.weight"].data).reshape(d, 3, p, p)
    assert np.array_equal(kernel[:, 2, 1, 3], w[:, (1 * p + 3) * 3 + 2])
    assert len([n for n in tensors if n.startswith("v.blk.")]) == vc.num_hidden_layers * 13
    assert all(t.tensor_type.name == "F32" for t in r.tensors)


def test_a_text_only_model_has_no_mmproj_to_write(tmp_path):
    from gemma4_trace.traces.errors import TraceToolError

    class Loaded:
        name = "text-only"

        class model:
            class config:
                vision_config = None

    with pytest.raises(TraceToolError, match="text-only has no vision tower"):
        GM.check_supported(Loaded)


@pytest.fixture(scope="module")
def mmprojs(tmp_path_factory):
    """mmproj files of the embedded model: the project's, and as llama.cpp's converter writes it
    (the same tensors; no clip.use_gelu, no scale_factor), and without clip.use_gelu alone."""
    folder, loaded = tmp_path_factory.mktemp("mmproj"), load_model()
    out = {}
    for name, drop in (("own", ()), ("converter", ("clip.use_gelu", GM.SCALE_FACTOR)), ("quick", ("clip.use_gelu",))):
        GM.write(loaded, folder / f"{name}.gguf", drop=drop)
        out[name] = folder / f"{name}.gguf"
    return out


def test_mtmd_without_use_gelu_runs_quick_gelu_and_without_scale_factor_pools_3(tmp_path, mmprojs, replays):
    """docs/upstream/llamacpp-gemma4v-mmproj.md: an mmproj without clip.use_gelu runs the vision MLP
    with quick GELU (the first divergence: vision layer 0's mlp_out, nothing before it); without
    scale_factor mtmd pools 3x3 (25 soft tokens for the processor's 64). Fails once mtmd chooses
    the checkpoint's activation and pooling on its own."""
    ref, run = golden_path("image"), tmp_path / "quick.h5"
    res = invoke("replay", ref, "--runtime", "llama.cpp", "--mmproj", mmprojs["quick"], "-o", run)
    assert res.exit_code == 0, res.output
    assert "no clip.use_gelu in the mmproj: mtmd's quick GELU where REF's vision MLP has tanh GELU" in res.output
    first = diff_traces(ref, run, PROFILE).to_json()["first_divergence"]
    assert (first["phase"], first["layer"], first["kind"]) == ("prefill", 0, "vision.mlp_out"), first
    assert 3e-3 < first["value"] < 5e-2 and first["origin"]["verdict"] == "introduced", first
    out = tmp_path / "conv.h5"
    res = invoke("replay", ref, "--runtime", "llama.cpp", "--mmproj", mmprojs["converter"], "-o", out)
    one_line_error(res, "does not match REF's vision tower: pooling absent: mtmd pools 3 (REF 2)", out=out)
    args = ("replay", ref, "--runtime", "llama.cpp", "--mmproj", mmprojs["converter"], "--allow-config-mismatch")
    res = invoke(*args, "-o", out)
    one_line_error(res, "llama.cpp's mtmd made 25 soft tokens of image 1 where the trace has 64", out=out)


def test_a_users_mmproj_replays_with_a_users_gguf_and_names_itself(tmp_path, mmprojs):
    """--gguf FILE --mmproj FILE: the user's pair; the run names the mmproj (never its path)."""
    gguf_file, run = tmp_path / "text.gguf", tmp_path / "pair.h5"
    assert invoke("export-gguf", "-o", gguf_file).exit_code == 0
    res = invoke("replay", golden_path("two_images"), "--gguf", gguf_file, "--mmproj", mmprojs["own"], "-o", run)
    assert res.exit_code == 0, res.output
    assert "mmproj own.gguf" in res.output and str(mmprojs["own"].parent) not in res.output
    assert diff_traces(golden_path("two_images"), run, PROFILE).match


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p, m: p.write_bytes(m["own"].read_bytes()[:4000]), "not a valid GGUF file"),
        (lambda p, m: p.write_bytes(b""), "not a valid GGUF file"),
        (lambda p, m: p.mkdir(), "not a regular file (a folder)"),
    ],
    ids=["truncated", "empty", "folder"],
)
def test_a_bad_mmproj_is_one_line_before_the_model_loads(tmp_path, mmprojs, make, needle):
    bad, run = tmp_path / "bad.gguf", tmp_path / "run.h5"
    make(bad, mmprojs)
    res = invoke("replay", golden_path("image"), "--runtime", "llama.cpp", "--mmproj", bad, "-o", run)
    one_line_error(res, needle, out=run)


def test_an_mmproj_of_another_kind_or_model_is_refused_in_one_line(tmp_path, mmprojs):
    run = tmp_path / "run.h5"
    text = tmp_path / "text.gguf"
    assert invoke("export-gguf", "-o", text).exit_code == 0
    res = invoke("replay", golden_path("image"), "--runtime", "llama.cpp", "--mmproj", text, "-o", run)
    one_line_error(res, "not a Gemma 4 vision mmproj (architecture 'gemma4', projector 'None'", out=run)
    other = tmp_path / "other.gguf"
    GM.write(load_model(), other, metadata_override={"clip.vision.block_count": 3, "clip.vision.patch_size": 8})
    res = invoke("replay", golden_path("image"), "--runtime", "llama.cpp", "--mmproj", other, "-o", run)
    one_line_error(res, "does not match REF's vision tower: vision layers 3 (REF 2); patch size 8 (REF 4)", out=run)
    res = invoke("replay", golden_path("image"), "--mmproj", mmprojs["own"], "-o", run)
    one_line_error(res, "--mmproj FILE goes with --runtime llama.cpp; not with --runtime static", out=run)


def test_an_mmproj_whose_tensors_mtmd_cannot_use_is_one_line(tmp_path, monkeypatch, replays):
    """A position table too small for the image (refused by the config check; forced, ggml's
    assertion in the child is the one line) and a missing tensor (mtmd refuses the file)."""
    loaded, tensors, run = load_model(), GM.tensors, tmp_path / "run.h5"
    small, missing = tmp_path / "small.gguf", tmp_path / "missing.gguf"
    shrink = {"v.position_embd.weight": lambda a: a[:, :2]}
    monkeypatch.setattr(GM, "tensors", lambda m: ((n, shrink.get(n, lambda a: a)(a)) for n, a in tensors(m)))
    GM.write(loaded, small)
    monkeypatch.setattr(GM, "tensors", lambda m: ((n, a) for n, a in tensors(m) if n != "v.blk.1.ffn_down.weight"))
    GM.write(loaded, missing)
    monkeypatch.undo()
    args = ("replay", golden_path("image"), "--runtime", "llama.cpp", "-o", run)
    one_line_error(invoke(*args, "--mmproj", small), "position table 2x2x32 (REF 2x160x32)", out=run)
    res = invoke(*args, "--mmproj", small, "--allow-config-mismatch")
    one_line_error(res, "llama.cpp (F32) crashed in prefill (image 1)", "GGML_ASSERT", out=run)
    res = invoke(*args, "--mmproj", missing)
    one_line_error(
        res, "llama.cpp's mtmd could not load the mmproj file", "unable to find tensor v.blk.1.ffn_down", out=run
    )
