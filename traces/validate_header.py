"""The header checks a trace passes on open (traces/validate.py runs them first): the schema name and
version, the provenance and input attributes, prompt ids, the per-layer metadata, the encoder tower
table and the step positions. Small datasets only, their sizes checked before they are read; the
object-level discipline and the error messages are traces/objects.py's."""

from __future__ import annotations

import json

import h5py
import numpy as np

from . import limits as LIM
from . import schema as S
from .errors import one_line
from .layers import LayerInfo, TowerInfo, tower_sizes
from .objects import ObjectChecks, as_int, attr_text, describe, file_error, read_small
from .rows import image_counts

_TOWER_CAPS = {"layers": LIM.MAX_LAYERS, "hidden": LIM.MAX_HIDDEN, "heads": LIM.MAX_HEADS, "head_dim": LIM.MAX_HEAD_DIM}
_METADATA = f"the per-layer metadata under '{S.GROUP_MODEL}/'"
_HEAD_CAPS = (
    (S.FIELD_HEAD_DIM, LIM.MAX_HEAD_DIM),
    (S.FIELD_NUM_HEADS, LIM.MAX_HEADS),
    (S.FIELD_NUM_KV_HEADS, LIM.MAX_HEADS),
)


MAX_IMAGE_PATCHES = 1 << 16  # patches of one image (E2B's largest budget, 1,120 tokens, is 10,080)


class HeaderChecks(ObjectChecks):
    """The checks of everything outside tensors/, each filling what it read into `out`."""

    # ------------------------------------------------------------------ header
    def _check_schema(self) -> None:
        attrs = self.f.attrs
        self.at = "the root attributes"
        name = attrs.get(S.ATTR_SCHEMA)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if not (isinstance(name, str) and name == S.SCHEMA_NAME):
            what = (
                f"has no {S.ATTR_SCHEMA!r} attribute"
                if name is None
                else f"its {S.ATTR_SCHEMA!r} attribute is {describe(name)}"
            )
            raise file_error(
                f"{self.path} is an HDF5 file but not a {S.SCHEMA_NAME} trace ({what}); "
                "pass a trace written by 'trace record' or 'trace replay'"
            )
        version = attrs.get(S.ATTR_SCHEMA_VERSION)
        if version is None:
            self._bad(f"the root attribute {S.ATTR_SCHEMA_VERSION!r} is missing")
        v = as_int(version)
        if v is None:
            self._bad(f"the root attribute {S.ATTR_SCHEMA_VERSION!r} should be an integer, got {describe(version)}")
        if v > S.SCHEMA_VERSION:
            raise file_error(
                f"{self.path} has trace schema version {v}, newer than this tool reads ({S.SCHEMA_VERSION}); "
                "upgrade gemma4-trace to read it"
            )
        if v < S.TEXT_SCHEMA_VERSION:
            raise file_error(
                f"{self.path} has trace schema version {v}; this tool reads versions "
                f"{S.TEXT_SCHEMA_VERSION}-{S.SCHEMA_VERSION} (re-record it with this version)"
            )
        self.version = v
        # version 1: the text tower alone; version 2: encoder towers too (a towers/ table)
        if (S.GROUP_TOWERS in self.f) != (v > S.TEXT_SCHEMA_VERSION):
            what = "has no towers/ table" if v > S.TEXT_SCHEMA_VERSION else "holds a towers/ table"
            self._bad(f"it is schema version {v} but {what} (version 1: the text tower alone; 2: encoder towers)")

    def _check_provenance(self) -> None:
        prov = {k: self._text_attr(self.f, k, "the root") for k in S.PROVENANCE_KEYS}
        mode = prov[S.ATTR_MODE]
        if mode not in S.MODES:
            self._bad(f"the root attribute {S.ATTR_MODE!r} is {mode!r}, not one of {', '.join(S.MODES)}")
        try:
            cfg = json.loads(prov[S.ATTR_MODEL_CONFIG])
        except (ValueError, RecursionError):
            cfg = None
        if not isinstance(cfg, dict):
            self._bad(f"the root attribute {S.ATTR_MODEL_CONFIG!r} is not a JSON object")
        self.out.provenance, self.out.config = prov, cfg

    def _check_selection(self) -> None:
        if S.ATTR_SELECTION not in self.f.attrs:
            return
        from .selection import Selection

        try:
            self.out.selection = Selection.from_json(self._text_attr(self.f, S.ATTR_SELECTION, "the root"))
        except (ValueError, RecursionError) as e:
            self._bad(f"the root attribute {S.ATTR_SELECTION!r} is not a valid selection ({one_line(str(e), 120)})")

    def _check_max_seq(self) -> None:
        if S.ATTR_MAX_SEQ in self.f.attrs:
            n = self._int_attr(self.f, S.ATTR_MAX_SEQ, "the root", 1)
            if n > LIM.MAX_POSITIONS:
                self._bad(f"the root attribute {S.ATTR_MAX_SEQ!r} is {n}, more than {LIM.MAX_POSITIONS} positions")
            self.out.max_seq = n

    def _check_inputs(self) -> None:
        g = self._group(S.GROUP_INPUTS)
        self._members(g, S.GROUP_INPUTS, S.MEMBERS[S.GROUP_INPUTS])
        self._check_prompt_ids()
        self._check_input_attrs(g)
        if S.leaf(S.GROUP_INPUT_EXTRA) in g:
            self._check_extra_inputs()

    def _check_prompt_ids(self) -> None:
        ids = self._small(self._dset(S.DSET_PROMPT_IDS, 1, "iu"), LIM.MAX_POSITIONS, "prompt ids")
        if ids.size == 0:
            self._bad(f"{S.DSET_PROMPT_IDS!r} is empty")
        if (ids < 0).any() or (ids.dtype.kind == "u" and (ids > np.iinfo(np.int64).max).any()):
            self._bad(f"{S.DSET_PROMPT_IDS!r} holds ids out of range ({int(ids.min())}..{int(ids.max())})")
        self.out.prompt_ids = ids.astype(np.int64)

    def _check_input_attrs(self, g: h5py.Group) -> None:
        out, where, n_ids = self.out, f"{S.GROUP_INPUTS!r}", self.out.prompt_ids.size
        out.max_new_tokens = self._int_attr(g, S.ATTR_MAX_NEW_TOKENS, where, 1)
        if n_ids + out.max_new_tokens > LIM.MAX_POSITIONS:
            self._bad(
                f"the attribute {S.ATTR_MAX_NEW_TOKENS!r} of {where} is {out.max_new_tokens}: with the "
                f"{n_ids} prompt ids that is more than {LIM.MAX_POSITIONS} positions"
            )
        eos = np.asarray(self._attr(g, S.ATTR_EOS_TOKEN_IDS, where))
        if eos.ndim > 1 or (eos.size and eos.dtype.kind not in "iu"):
            self._bad(f"the attribute {S.ATTR_EOS_TOKEN_IDS!r} of {where} should be integers, got {describe(eos)}")
        out.eos_token_ids = [int(x) for x in eos.reshape(-1)]
        out.prompt_text = self._text_attr(g, S.ATTR_PROMPT_TEXT, where)
        chat = self._attr(g, S.ATTR_CHAT_TEMPLATE_APPLIED, where)
        if not (isinstance(chat, (bool, np.bool_)) or as_int(chat) in (0, 1)):
            self._bad(
                f"the attribute {S.ATTR_CHAT_TEMPLATE_APPLIED!r} of {where} should be a bool, got {describe(chat)}"
            )
        out.chat_template_applied = bool(chat)

    def _check_extra_inputs(self) -> None:
        extra = self._group(S.GROUP_INPUT_EXTRA)
        names = sorted(self._members(extra, S.GROUP_INPUT_EXTRA, None))
        if len(names) > LIM.MAX_EXTRA_INPUTS:
            self._bad(f"{S.GROUP_INPUT_EXTRA!r} holds {len(names)} inputs (at most {LIM.MAX_EXTRA_INPUTS})")
        for name in names:
            self._dset(S.input_extra_path(name), None, "biuf")
        self.out.extra_names = names

    # ------------------------------------------------------------------ model and steps
    def _check_model(self) -> None:
        self._members(self._group(S.GROUP_MODEL), S.GROUP_MODEL, S.MEMBERS[S.GROUP_MODEL])
        fields = {k: self._layer_field(k) for k in S.LAYER_FIELDS}
        n = len(fields[S.FIELD_LAYER_TYPE])
        lengths = {k: len(v) for k, v in fields.items()}
        if n == 0 or any(x != n for x in lengths.values()):
            self._bad(f"{_METADATA} has inconsistent lengths {lengths}")
        self.at = _METADATA
        for i in range(n):
            self._check_layer(fields, i)
        self.out.layers = [LayerInfo(**{k: fields[k][i] for k in S.LAYER_FIELDS}) for i in range(n)]

    def _layer_field(self, k: str) -> list:
        """One per-layer metadata dataset: text or integers, at most MAX_LAYERS entries."""
        path = S.model_field_path(k)
        text = k in S.LAYER_TEXT_FIELDS
        ds = self._dset(path, 1)
        if text and h5py.check_string_dtype(ds.dtype) is None:
            self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected strings")
        if not text and ds.dtype.kind not in "iu":
            self._bad(f"the dataset {path!r} has dtype {ds.dtype}, expected integer")
        vals = self._small(ds, LIM.MAX_LAYERS, "layers", vlen_text=text)
        if not text:
            return [int(x) for x in vals]
        try:
            return [attr_text(x) for x in vals]
        except UnicodeDecodeError:
            self._bad(f"the dataset {path!r} holds text that is not UTF-8")

    def _check_layer(self, fields: dict, i: int) -> None:
        lt, role, src = fields[S.FIELD_LAYER_TYPE][i], fields[S.FIELD_KV_ROLE][i], fields[S.FIELD_KV_SOURCE][i]
        path = S.model_field_path
        if lt not in S.LAYER_TYPE_SHORT:
            self._bad(f"{path(S.FIELD_LAYER_TYPE)} of layer {i} is {lt!r}, not one of {', '.join(S.LAYER_TYPE_SHORT)}")
        if role not in S.KV_ROLES:
            self._bad(f"{path(S.FIELD_KV_ROLE)} of layer {i} is {role!r}, not one of {', '.join(S.KV_ROLES)}")
        for k, cap in _HEAD_CAPS:
            if not 1 <= fields[k][i] <= cap:
                self._bad(f"{path(k)} of layer {i} is {fields[k][i]}, expected 1..{cap}")
        ok = (src == i) if role != "reuses" else (0 <= src < i and fields[S.FIELD_KV_ROLE][src] != "reuses")
        if not ok:
            self._bad(
                f"{path(S.FIELD_KV_SOURCE)} of layer {i} is {src}, impossible for a layer whose kv_role is {role!r}"
            )

    def _check_towers(self) -> None:
        """Version 2: the encoder tower table, each tower's sizes as its sub-config says, its soft
        tokens as many as the prompt's tokens for them."""
        if self.version == S.TEXT_SCHEMA_VERSION:
            return
        g = self._group(S.GROUP_TOWERS)
        names = self._members(g, S.GROUP_TOWERS, S.ENCODER_TOWERS)
        if not names:
            self._bad(f"its {S.GROUP_TOWERS!r} table is empty (a version-2 trace records an encoder tower)")
        for name in sorted(names, key=S.ENCODER_TOWERS.index):
            self.out.towers[name] = self._tower(S.TOWER_BY_NAME[name])

    def _tower(self, tower: S.Tower) -> TowerInfo:
        path = S.tower_path(tower.name)
        self._members(self._group(path), path, S.TOWER_DSETS)
        g = self.f[path]
        sizes = {k: self._int_attr(g, k, repr(path), 1) for k in S.TOWER_ATTRS}
        for k, cap in _TOWER_CAPS.items():
            if sizes[k] > cap:
                self._bad(f"the attribute {k!r} of {path!r} is {sizes[k]}, expected 1..{cap}")
        config = tower_sizes(self.out.config, tower)
        if config is None or not isinstance(self.out.config.get(tower.config), dict):
            self._bad(f"it records a {tower.name} tower, but its model config has no {tower.config!r} object")
        missing = [k for k in S.TOWER_ATTRS if k not in config]
        if missing:  # what the table says cannot be checked: no writer of ours records such a tower
            self._bad(f"its model config's {tower.config} gives no {', '.join(missing)} (a positive integer)")
        for k, v in sizes.items():
            if k in config and config[k] != v:
                self._bad(
                    f"{path!r} says {k} {v}, but the model config's {tower.config} says {config[k]}: "
                    "the tower table disagrees with the model config"
                )
        counts = []
        for name in S.TOWER_DSETS:
            ds = self._dset(S.tower_path(tower.name, name), 1, "iu")
            vals = self._small(ds, LIM.MAX_EXTRA_INPUTS, "images or clips")
            if vals.size == 0 or (vals < 1).any() or int(vals.sum(dtype=np.float64)) > LIM.MAX_POSITIONS:
                self._bad(f"{ds.name.lstrip('/')!r} holds {describe(vals)}: expected 1..{LIM.MAX_POSITIONS} per item")
            counts.append(tuple(int(x) for x in vals))
        if len(counts[0]) != len(counts[1]):
            self._bad(f"{path!r}: {len(counts[0])} items' rows but {len(counts[1])} items' soft tokens")
        token_id = self.out.config.get(tower.token_id)
        if isinstance(token_id, int) and not isinstance(token_id, bool):
            n = int((self.out.prompt_ids == token_id).sum())
            if n != sum(counts[1]):
                self._bad(
                    f"{path!r} declares {sum(counts[1])} soft tokens, but the prompt holds {n} of its "
                    f"{tower.token_id} ({token_id})"
                )
        if tower.name == "vision":
            self._images_agree(path, counts, tower)
        return TowerInfo(tower.name, item_rows=counts[0], item_tokens=counts[1], **sizes)

    def _images_agree(self, path: str, counts: list, tower: S.Tower) -> None:
        """The vision tower's table against the images it was recorded from: each image's real
        patches (image_position_ids) and the soft tokens they pool to."""
        where = S.input_extra_path("image_position_ids")
        if "image_position_ids" not in (getattr(self.out, "extra_names", None) or ()):
            return  # rows of images the trace does not hold: nothing to check them against
        ds = self.f[where]  # a dataset, checked with the extra inputs (_check_extra_inputs)
        if ds.dtype.kind not in "iu" or ds.ndim != 3:
            self._bad(f"{where!r} has dtype {ds.dtype} and shape {ds.shape}, expected integers (images, patches, 2)")
        if ds.shape[0] != len(counts[0]) or ds.shape[2] != 2 or ds.shape[1] > MAX_IMAGE_PATCHES:
            self._bad(
                f"{where!r} has shape {ds.shape}, expected ({len(counts[0])} images, at most {MAX_IMAGE_PATCHES} "
                "patches, 2)"
            )
        pooling = self.out.config.get(tower.config, {}).get("pooling_kernel_size")
        if not isinstance(pooling, int) or isinstance(pooling, bool) or not 1 <= pooling <= 64:
            self._bad(f"its model config's {tower.config} gives no pooling_kernel_size in 1..64")
        found = image_counts(read_small(self.path, ds), pooling)
        if found is None or (tuple(found[0]), tuple(found[1])) != (counts[0], counts[1]):
            self._bad(
                f"{path!r} declares {'+'.join(map(str, counts[0]))} patches and "
                f"{'+'.join(map(str, counts[1]))} soft tokens, but its images ({where!r}) give "
                + ("none" if found is None else f"{'+'.join(map(str, found[0]))} and {'+'.join(map(str, found[1]))}")
            )

    def _check_steps(self) -> None:
        self._members(self._group(S.GROUP_STEPS), S.GROUP_STEPS, S.MEMBERS[S.GROUP_STEPS])
        sp_ds = self._dset(S.DSET_STEP_POSITIONS, 2, "iu")
        max_new = self.out.max_new_tokens
        if sp_ds.shape[0] > max_new:
            self._bad(f"it has {sp_ds.shape[0]} steps but {S.ATTR_MAX_NEW_TOKENS} is {max_new}")
        sp = self._small(sp_ds, LIM.MAX_POSITIONS, "steps")
        if sp.shape[0] == 0 or sp.shape[1] != 2:
            self._bad(f"{S.DSET_STEP_POSITIONS!r} has shape {sp.shape}, expected (n_steps >= 1, 2)")
        steps = [(int(a), int(b)) for a, b in sp]
        T = int(self.out.prompt_ids.size)
        for s, (a, b) in enumerate(steps):
            want = (0, T) if s == 0 else (T + s - 1, T + s)
            if (a, b) != want:
                self._bad(
                    f"{S.DSET_STEP_POSITIONS!r}: step {s} feeds positions [{a}, {b}), expected [{want[0]}, "
                    f"{want[1]}) (a prefill over the {T} prompt ids, then one position per decode step)"
                )
        self.out.step_positions = steps
