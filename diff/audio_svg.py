"""The HTML report's "Audio" section: an AudioMap (diff/audio_map.py) drawn per clip: REF's log-mel
spectrogram (time on x, mel bins on y, low bins at the bottom) as an inline PNG, and under it, on the
same time axis, one strip per tensor of each frame's error (the first divergent tensor, then every
conformer layer's output). Self-contained: the PNG is written here (zlib, no imaging library) and
embedded as a data: URI; every text from a trace is escaped."""

from __future__ import annotations

import base64
import html
import math
import struct
import zlib

import numpy as np

from .audio_map import AudioMap, ClipMap
from .fmt import seconds_text

WIDTH = 960  # pixels a clip's frames are drawn over, at most
FRAME_PX = (2, 16)  # pixels one frame is drawn at, at least and at most
LEFT = 170  # the strips' labels
MEL_PX = 128  # the spectrogram's height
STRIP_PX = 14
MAGMA = ("#000004", "#3b0f70", "#8c2981", "#de4968", "#fe9f6d", "#fcfdbf")  # quiet .. loud


def png_data_uri(rgb: np.ndarray) -> str:
    """A (height, width, 3) uint8 image as a data:image/png;base64 URI (one IDAT, no filter)."""
    h, w, _ = rgb.shape

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + rgb[y].astype(np.uint8).tobytes() for y in range(h))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def spectrogram_rgb(mel: np.ndarray) -> np.ndarray:
    """(bins, frames, 3) colours of a (frames, bins) log-mel: its 1st..99th percentile over the magma
    ramp, the highest bin on top."""
    if mel.size == 0:
        return np.zeros((1, 1, 3), dtype=np.uint8)
    lo, hi = np.percentile(mel, 1), np.percentile(mel, 99)
    t = np.clip((mel - lo) / (hi - lo if hi > lo else 1.0), 0, 1).T[::-1] * (len(MAGMA) - 1)
    stops = np.array([[int(c[k : k + 2], 16) for k in (1, 3, 5)] for c in MAGMA], dtype=np.float64)
    i = np.minimum(t.astype(int), len(MAGMA) - 2)
    f = (t - i)[..., None]
    return np.round(stops[i] * (1 - f) + stops[i + 1] * f).astype(np.uint8)


def _ticks(frames: int, px: int, ms: float) -> list[str]:
    """A tick and label every whole second (or every 0.5 s / 0.1 s on short clips) on the time axis."""
    seconds = frames * ms / 1000
    step = 1.0 if seconds >= 3 else 0.5 if seconds >= 1 else 0.1
    out, k = [], 0
    while k * step <= seconds + 1e-9 and k < 1000:
        x = LEFT + k * step * 1000 / ms * px
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="4" stroke="#000"/>')
        out.append(f'<text x="{x:.1f}" y="15" font-size="10" text-anchor="middle">{k * step:g} s</text>')
        k += 1
    return out


def _clip(i: int, c: ClipMap, am: AudioMap, scale) -> str:
    frames = len(c.strips[0][1])
    px = max(FRAME_PX[0], min(FRAME_PX[1], WIDTH // max(frames, 1)))
    w = frames * px
    body = [
        f'<image class="spectrogram" x="{LEFT}" y="0" width="{w}" height="{MEL_PX}" preserveAspectRatio="none" '
        f'style="image-rendering:pixelated" data-mel-frames="{len(c.mel)}" data-bins="{c.mel.shape[1]}" '
        f'href="{png_data_uri(spectrogram_rgb(c.mel))}"><title>REF log-mel input_features: {len(c.mel)} frames x '
        f"{c.mel.shape[1]} bins</title></image>",
        f'<text x="{LEFT - 6}" y="{MEL_PX // 2}" font-size="10" text-anchor="end">log-mel (REF)</text>',
    ]
    first = am.first if am.first is not None and am.first[0] == i else None
    y = MEL_PX + 4
    for s, (label, err) in enumerate(c.strips):
        cells = []
        for f, e in enumerate(err):
            ratio = e / am.threshold if am.threshold > 0 else e
            t = f * am.ms / 1000
            cells.append(
                f'<rect x="{LEFT + f * px}" y="{y}" width="{px}" height="{STRIP_PX}" fill="{scale.color(ratio)}" '
                f'data-frame="{f}" data-rel-l2="{e:.3e}"><title>frame {f} ({seconds_text(t, am.ms)}): rel-L2 '
                f"{e:.3g}</title></rect>"
            )
        body.append(
            f'<g class="err-strip" data-label="{html.escape(label)}" data-frames="{frames}">'
            f'<text x="{LEFT - 6}" y="{y + 11}" font-size="10" text-anchor="end">{html.escape(label)}</text>'
            + "".join(cells)
            + "</g>"
        )
        if s == 0 and first is not None and first[1] < frames:
            x = LEFT + first[1] * px
            body.append(
                f'<rect class="first" x="{x}" y="{y}" width="{px}" height="{STRIP_PX}" fill="none" stroke="#000" '
                f'stroke-width="2"/><line x1="{x + px / 2}" x2="{x + px / 2}" y1="0" y2="{MEL_PX}" stroke="#fff" '
                'stroke-dasharray="3,2"/>'
            )
        y += STRIP_PX + (6 if s == 0 else 2)
    body.append(f'<g transform="translate(0,{y + 2})">' + "".join(_ticks(frames, px, am.ms)) + "</g>")
    over = int(np.sum(c.strips[0][1] > am.threshold))
    worst = float(np.max(c.strips[0][1])) if frames else 0.0
    return (
        f'<figure class="audio-clip" data-clip="{i + 1}" style="margin:0 0 12px 0"><svg width="{LEFT + w + 10}" '
        f'height="{y + 22}" role="img">' + "".join(body) + f'</svg><figcaption class="legend">clip {i + 1}: '
        f"{frames} frames ({seconds_text(frames * am.ms / 1000, am.ms)}), {over} over the tolerance in the first "
        f"strip, worst rel-L2 {_sci(worst)}</figcaption></figure>"
    )


def render(am: AudioMap, scale_of) -> str:
    """The HTML section: per clip, the spectrogram and the error strips on one time axis, coloured on
    the report's scale (`scale_of(values)`: html._Scale over error / tolerance), the first divergence
    framed."""
    ratios = [e / am.threshold if am.threshold > 0 else e for c in am.clips for _, err in c.strips for e in err]
    scale = scale_of([float(r) for r in ratios])
    where = am.kind + ("" if am.layer is None else f" of layer {am.layer}")
    out = [f"<h2>Audio: error of {html.escape(where)} over each clip's frames</h2>", '<div class="audio">']
    out += [_clip(i, c, am, scale) for i, c in enumerate(am.clips)]
    out.append("</div>")
    out.append(f'<svg width="760" height="34">{"".join(scale.legend(10, 6, 400, "tolerance"))}</svg>')
    out.append(
        '<p class="legend">Each clip: REF\'s log-mel input (time left to right, low mel bins at the bottom) and, '
        f"on the same time axis, one cell per subsampled frame ({am.ms:g} ms of audio) of each strip: the first "
        "divergent tensor's rel-L2 over its tolerance, then each conformer layer's output (L0 layer output, ...), "
        "on the heatmap's scale: warm where it diverges. The black frame and the dashed line mark the first "
        "divergence. Hover a cell for its value.</p>"
    )
    return "\n".join(out)


def _sci(v: float) -> str:
    return "0" if v == 0 else f"{v:.1e}" if math.isfinite(v) else str(v)
