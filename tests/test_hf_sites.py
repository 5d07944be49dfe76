"""hf/sites.py, the one table of where HF's Gemma 4 computes each canonical kind: every row names a
real module of the embedded tiny model (and of a text-only checkpoint) for every layer, and what it
hooks there is what HF computes for that kind, checked against the model's own modules; a planted
wrong row is caught."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from gemma4_trace.hf import sites as S
from gemma4_trace.traces.schema import KIND_NAMES, LAYER_KIND_NAMES, TOWER_BY_NAME, rope_kinds

IDS = [2, 30, 31, 32, 33, 34, 35, 36, 37, 38]  # plain text tokens (7..13 are multimodal ones), past the sliding window


@pytest.fixture(scope="module")
def embedded():
    from gemma4_trace.hf.model import load_model

    return load_model()


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    from gemma4_trace.hf.model import load_model
    from tests.support.tiny_models import build

    return load_model(build(tmp_path_factory.mktemp("text_only")))


def test_every_kind_hf_computes_has_one_row_in_the_schemas_order():
    text = [s for s in S.SITES if s.tower == S.TEXT]
    assert [s.kind for s in text] == [k for k in KIND_NAMES if k != "token"]  # the token is generate()'s
    vision = [s.kind for s in S.SITES if s.tower == S.VISION]
    assert vision == [k.name for k in TOWER_BY_NAME[S.VISION].kinds]  # every vision kind, in the schema's order
    assert len(S.BY_KEY) == len(S.SITES)
    for s in S.SITES:
        assert s.tower in S.TOWERS and s.tensor in (S.OUTPUT, S.INPUT, S.ATTENTION), s
        assert s.each_layer or s.kind not in LAYER_KIND_NAMES, s  # a per-layer kind is found in each layer
        if s.tensor == S.INPUT:
            assert isinstance(s.item, str) and isinstance(s.position, int), s
        if s.tensor == S.ATTENTION:
            assert s.item in S.ATTENTION_ARGS and s.each_layer, s
    assert S.LOGITS.kind == "logits" and S.LOGITS.module == ""


@pytest.mark.parametrize("which", ["embedded", "text_only"])
def test_every_row_names_a_real_module_for_every_layer(which, request):
    lm = request.getfixturevalue(which)
    model = lm.model
    n = lm.text_config.num_hidden_layers
    assert S.layer_count(model) == n
    assert S.root_path(model) == ("model.language_model" if which == "embedded" else S.TEXT_ONLY_ROOT)
    assert S.has_tower(model, S.VISION) == (which == "embedded")
    for s in S.SITES:
        if not S.has_tower(model, s.tower):
            continue
        for layer in range(S.layer_count(model, s.tower)) if s.each_layer else (None,):
            path = S.module_path(model, s, layer)
            module = model.get_submodule(path)  # AttributeError: no such module
            params = list(inspect.signature(module.forward).parameters)
            if s.tensor == S.INPUT:  # the argument is forward's, by name and position
                assert params[s.position] == s.item, (s, path, params)
            if s.layer_type is not None:
                assert params[S.LAYER_TYPE_ARG[0]] == S.LAYER_TYPE_ARG[1], (s, path, params)
            if s.tensor == S.ATTENTION:  # the module calls the attention function
                assert type(module).__name__ == f"Gemma4{s.tower.title()}Attention", (s, path)
    if which == "embedded":
        assert S.module_path(model, S.BY_KEY["q"], 3) == "model.language_model.layers.3.self_attn"
    else:
        assert S.module_path(model, S.BY_KEY["q"], 3) == "model.layers.3.self_attn"
        assert S.module_path(model, S.LOGITS) == ""


def test_the_attention_functions_arguments_are_as_the_table_says():
    from transformers.models.gemma4 import modeling_gemma4

    params = list(inspect.signature(modeling_gemma4.eager_attention_forward).parameters)
    assert tuple(params[1 : 1 + len(S.ATTENTION_ARGS)]) == S.ATTENTION_ARGS
    assert S.attention_tensors("Q", "K", "V", "M") == {"mask": "M", "q": "Q", "k": "K", "v": "V"}


def test_the_encoder_towers_are_where_the_table_places_them(embedded):
    """The vision tower (the embedded model has one) and the audio tower (a model built on the meta
    device: no weights) at their roots, with their layers and embedders."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.support.tiny_models import BASE_TEXT, VISION

    vision = S.TOWERS[S.VISION]
    assert type(S.tower_model(embedded.model, S.VISION)).__name__ == "Gemma4VisionModel"
    assert S.layer_count(embedded.model, S.VISION) == embedded.config.vision_config.num_hidden_layers
    assert type(embedded.model.get_submodule(vision.embedder)).__name__ == "Gemma4MultimodalEmbedder"
    for name in ("patch_embedder", "pooler"):
        embedded.model.get_submodule(f"{vision.root}.{name}")
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(
            Gemma4Config(text_config=BASE_TEXT, vision_config=VISION, audio_config={"num_hidden_layers": 2})
        )
    audio = S.TOWERS[S.AUDIO]
    assert type(S.tower_model(model, S.AUDIO)).__name__ == "Gemma4AudioModel"
    assert S.layer_count(model, S.AUDIO) == 2
    assert type(model.get_submodule(audio.embedder)).__name__ == "Gemma4MultimodalEmbedder"


def _close(a, b) -> bool:
    import torch

    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def wrong_rows(lm, sites: tuple[S.HFSite, ...]) -> list[str]:
    """Run HF's forward once (eager attention) with `sites` hooked; say which row's tensor is not what
    HF computes for its kind, judged by the model's own modules, hooked here directly: each layer's
    input is the previous layer's output, o_proj's output is attn_out, q, K, V and the mask
    attended again through o_proj give it too, and so on."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gemma4 import modeling_gemma4

    sites = tuple(s for s in sites if s.tower == S.TEXT)  # the vision rows: tests/test_record_vision.py
    model, cfg = lm.model, lm.text_config
    tm = S.tower_model(model)
    n = S.layer_count(model)
    ids = torch.tensor([IDS])
    got, seen, bad = {}, {}, []
    by_kind = {s.kind: s for s in sites}

    def put(site, layer, t):
        got[(site.kind, layer)] = t

    def keep(key):
        return lambda m, args, out=None: seen.__setitem__(key, args[0] if out is None else out)

    attention = {}
    for s in sites:
        if s.tensor == S.ATTENTION:
            try:
                attention[s.kind] = {id(S.submodule(model, s, i)): i for i in range(n)}
            except AttributeError as e:
                bad.append(f"{s.kind}: {e}")

    def wrapped(module, query, key, value, attention_mask, **kwargs):
        given = dict(zip(S.ATTENTION_ARGS, (query, key, value, attention_mask)))
        for kind, where in attention.items():
            if id(module) in where:
                got[(kind, where[id(module)])] = given[by_kind[kind].item]
        return modeling_gemma4.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    handles = [tm.norm.register_forward_pre_hook(keep(("in", n)))]
    for i in range(n):
        handles.append(tm.layers[i].register_forward_pre_hook(keep(("in", i))))
        handles.append(tm.layers[i].self_attn.o_proj.register_forward_hook(keep(("o_proj", i))))
    impl = [c._attn_implementation for c in (model.config, cfg)]
    try:
        handles += S.install(model, put, sites)
        for c in (model.config, cfg):
            c._attn_implementation = "eager"
        ALL_ATTENTION_FUNCTIONS["eager"] = wrapped
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        for h in handles:  # before the references below call the modules again
            h.remove()
        with torch.no_grad():
            logits = S.output_of(by_kind["logits"], out)
            pos = torch.arange(len(IDS))[None]
            emb = tm.embed_tokens(ids)
            ple = tm.project_per_layer_inputs(emb, tm.get_per_layer_inputs(ids, emb))
            expect = {("embeddings", None): emb, ("final_hidden", None): tm.norm(seen[("in", n)])}
            for lt in set(cfg.layer_types):
                cos, sin = rope_kinds(lt)
                expect[(cos, None)], expect[(sin, None)] = tm.rotary_emb(emb, pos, lt)
            for i in range(n):
                expect[("per_layer_inputs", i)] = ple[:, :, i]
                expect[("layer_out", i)] = seen[("in", i + 1)]
                expect[("attn_out", i)] = seen[("o_proj", i)]
            for kind, want in expect.items():
                if not _close(got.get(kind), want):
                    bad.append(f"{kind}: not what HF computes there")
            softcap = cfg.final_logit_softcapping
            head = model.lm_head(got.get(("final_hidden", None), emb))
            if not _close(logits, torch.tanh(head / softcap) * softcap if softcap else head):
                bad.append("logits: not lm_head(final_hidden), soft-capped")
            for i in range(n):  # attend again with the rows' q, K, V and mask: o_proj gives attn_out
                attn = tm.layers[i].self_attn
                try:
                    q, k, v, mask = (got[(kind, i)] for kind in ("q", "k", "v", "mask"))
                    o, _ = modeling_gemma4.eager_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
                    ok = _close(attn.o_proj(o.reshape(1, len(IDS), -1)), seen[("o_proj", i)])
                except (KeyError, RuntimeError, IndexError, ValueError) as e:
                    ok = False
                    bad.append(f"attention of layer {i}: {type(e).__name__}: {e}")
                if not ok:
                    bad.append(f"q, k, v, mask of layer {i}: attended again, not attn_out")
    finally:
        for h in handles:
            h.remove()
        ALL_ATTENTION_FUNCTIONS._local_mapping.pop("eager", None)
        for c, was in zip((model.config, cfg), impl):
            c._attn_implementation = was
    return bad


@pytest.mark.parametrize("which", ["embedded", "text_only"])
def test_every_row_hooks_what_hf_computes_for_its_kind(which, request):
    assert wrong_rows(request.getfixturevalue(which), S.SITES) == []


_MODULE = "model.language_model.layers.{layer}"
PLANTED = {  # a wrong row -> what the checker must say
    "layer_out at the MLP": ("layer_out", dict(module=f"{_MODULE}.mlp"), "layer_out"),
    "attn_out at the input norm": ("attn_out", dict(module=f"{_MODULE}.input_layernorm", item=None), "attn_out"),
    "final_hidden before the norm": ("final_hidden", dict(module=_MODULE.format(layer=7)), "final_hidden"),
    "rope cos and sin swapped": ("rope_cos_sliding", dict(item=1), "rope_cos_sliding"),
    "k from the value argument": ("k", dict(item="value"), "attended again"),
    "mask from the query argument": ("mask", dict(item="query"), "layer 0"),
    "q from the MLP's call": ("q", dict(module=f"{_MODULE}.mlp"), "attention of layer 0"),
    "embeddings from layer 1": ("embeddings", dict(module=_MODULE.format(layer=1)), "embeddings"),
    "per-layer input by the wrong position": ("per_layer_inputs", dict(position=0, item="hidden_states"), "per_layer"),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_a_wrong_row_is_caught(case, embedded):
    kind, change, said = PLANTED[case]
    sites = tuple(replace(s, **change) if s.kind == kind else s for s in S.SITES)
    bad = wrong_rows(embedded, sites)
    assert any(said in b for b in bad), bad
