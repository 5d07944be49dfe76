"""`trace sweep`'s prompt sets: a text file (one prompt a line) or JSON lines, read bounded and
checked before anything loads (analysis/sweep.py runs them). Module level imports no torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gemma4_trace.traces.errors import TraceToolError
from gemma4_trace.traces.inputs import read_text, sha256_file

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # whole id (fullmatch: "$" would take a final newline)
MAX_PROMPTS = 100_000
MAX_PROMPTS_BYTES = (
    16 << 20
)  # a prompts file larger than this is refused before it is read (100,000 prompts of 160 bytes)
MAX_IMAGE_BYTES = 64 << 20
EMBEDDED_SET = "@embedded"  # PROMPTS naming the shipped set (hf/tiny_model/sweep_prompts.jsonl)


def read_prompts(path) -> list[dict]:
    """The prompts of a text file (one a line, blank lines skipped) or of JSON lines (a line starting
    with '{'): {"text": ...} or {"input_ids": [...]}, optional "image" (a path, relative to the file's
    folder), "chat" (false: raw text, no chat template) and "id". A bad line: TraceToolError naming it.
    "@embedded": the prompt set shipped for the embedded model."""
    p = Path(path)
    if str(path) == EMBEDDED_SET:
        from gemma4_trace.hf.model import embedded_model_dir

        p = embedded_model_dir() / "sweep_prompts.jsonl"
    text = read_text(p, "prompts file", MAX_PROMPTS_BYTES)  # bounded; a FIFO or a device is refused unread
    lines = text.splitlines()
    jsonl = any(ln.lstrip().startswith("{") for ln in lines if ln.strip())
    prompts, seen = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p} line {n}"
        spec = _json_prompt(line, where, p.parent) if jsonl else {"text": line}
        spec.setdefault("id", f"line{n:05d}")
        if spec["id"] in seen:
            raise TraceToolError(f"{where}: id {spec['id']!r} already used on line {seen[spec['id']]}")
        seen[spec["id"]] = n
        spec["line"] = n
        prompts.append(spec)
        if len(prompts) > MAX_PROMPTS:
            raise TraceToolError(f"{p}: more than {MAX_PROMPTS} prompts")
    if not prompts:
        raise TraceToolError(f"prompts file {p} holds no prompt")
    return prompts


def _json_prompt(line: str, where: str, folder: Path) -> dict:
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        raise TraceToolError(f"{where}: not a JSON object (a JSON-lines file has one object per line)") from None
    if not isinstance(d, dict):
        raise TraceToolError(f"{where}: not a JSON object")
    unknown = sorted(set(d) - {"text", "input_ids", "image", "chat", "id"})
    if unknown:
        raise TraceToolError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))[:200]}")
    spec = {}
    if ("text" in d) == ("input_ids" in d):
        raise TraceToolError(f'{where}: give exactly one of "text" or "input_ids"')
    if "text" in d:
        if not isinstance(d["text"], str) or not d["text"]:
            raise TraceToolError(f'{where}: "text" must be a non-empty string')
        spec["text"] = d["text"]
    else:
        ids = d["input_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids)
        ):
            raise TraceToolError(f'{where}: "input_ids" must be a non-empty list of token ids (integers >= 0)')
        spec["input_ids"] = ids
    if "image" in d:
        if "text" not in d:
            raise TraceToolError(f'{where}: "image" needs "text" (the processor places the image tokens)')
        if not isinstance(d["image"], str) or not d["image"]:
            raise TraceToolError(f'{where}: "image" must be a path')
        spec["image"] = str(_image_in(folder, d["image"], where))
    if "chat" in d:
        if not isinstance(d["chat"], bool):
            raise TraceToolError(f'{where}: "chat" must be true or false')
        spec["chat"] = d["chat"]
    if "id" in d:
        if not isinstance(d["id"], str) or not ID_RE.fullmatch(d["id"]):
            raise TraceToolError(f"{where}: \"id\" must be 1-64 letters, digits, '.', '_' or '-' (a file name)")
        spec["id"] = d["id"]
    return spec


def _image_in(folder: Path, name: str, where: str) -> Path:
    """An image a prompts file names: a regular file inside the file's folder (after links are
    followed), of bounded size; anything else is one line."""
    root = folder.resolve()
    image = (folder / name).resolve()
    if not image.is_relative_to(root):
        raise TraceToolError(f"{where}: image {name!r} is outside the prompts file's folder {root}")
    if not image.exists():
        raise TraceToolError(f"{where}: image {folder / name} does not exist")
    if not image.is_file():
        raise TraceToolError(f"{where}: image {folder / name} is not a regular file")
    if image.stat().st_size > MAX_IMAGE_BYTES:
        raise TraceToolError(f"{where}: image {folder / name} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return image


def prompt_key(spec: dict, chat_default: bool) -> dict:
    """What decides a prompt's REF (besides the model and max_new_tokens): its input, never its id."""
    key = {k: spec[k] for k in ("text", "input_ids") if k in spec}
    if "text" in spec:
        key["chat"] = spec.get("chat", chat_default)
    if "image" in spec:
        key["image_sha256"] = sha256_file(spec["image"])
    return key


def prompt_rows(spec: dict) -> list[tuple[str, str]]:
    """A prompt's rows for its report page: its id and line, its text or token ids, its image."""
    rows = [("prompt", f"{spec['id']} (line {spec['line']} of the prompts file)")]
    if spec.get("text") is not None:
        rows.append(("text", spec["text"] if len(spec["text"]) <= 2000 else spec["text"][:2000] + " ..."))
    if spec.get("input_ids") is not None:
        ids = spec["input_ids"]
        rows.append(("token ids", " ".join(map(str, ids[:200])) + (" ..." if len(ids) > 200 else "")))
    if "image" in spec:
        rows.append(("image", Path(spec["image"]).name))
    return rows
