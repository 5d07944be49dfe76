"""Standalone repro of one Gemma 4 decoder layer (or the embeddings, or the per-layer inputs) at one
step (written by `trace repro`).

Needs only numpy and torch. Recomputes the layer in plain float32 from REF's inputs
(inputs.npz) and that layer's weights (weights.npz), then prints its error against REF's
and RUN's recorded outputs (outputs.npz). Exit 0 when the recompute matches REF's output
within TOLERANCE (rel-L2), 1 otherwise. When layer.onnx is here (`trace repro --onnx`: this
recompute as an ONNX graph, inputs named as in inputs.npz) and onnxruntime is installed, it is
run too and must match REF within the same tolerance.

    python repro.py            # run from this folder
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

CONFIG = json.loads(__CONFIG__)  # noqa: F821 - the writer replaces __CONFIG__ with a JSON string literal
TOLERANCE = float(CONFIG["tolerance"])
HERE = os.path.dirname(os.path.abspath(__file__))

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


def load(name):
    with np.load(os.path.join(HERE, name), allow_pickle=False) as z:
        return {
            k: torch.from_numpy(np.array(z[k], dtype=np.float32))
            if z[k].dtype != np.bool_
            else torch.from_numpy(np.array(z[k]))
            for k in z.files
        }


def rms(x, weight, eps):
    h = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return h if weight is None else h * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x, cos, sin):  # x (n, heads, D); cos/sin (n, D)
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def layer(inp, w, c):
    eps, H, KV, D = float(c["eps"]), int(c["num_heads"]), int(c["num_kv_heads"]), int(c["head_dim"])
    act = ACTIVATIONS[c["activation"]]
    x = inp["hidden"]  # (n, hidden): REF's input to this layer
    n = x.shape[0]
    pos = inp["positions"].long()  # (n,) absolute positions
    h = rms(x, w["input_norm"], eps)
    q = rope(rms((h @ w["q_proj"].T).view(n, H, D), w["q_norm"], eps), inp["cos"], inp["sin"])
    k_all, v_all = inp["k_rows"].clone(), inp["v_rows"].clone()  # (keys, KV, D): REF's K/V rows
    if c["owns_kv"]:  # this layer writes its own rows at `pos` (past rows are REF's)
        k_raw = (h @ w["k_proj"].T).view(n, KV, D)
        v = k_raw if c["k_eq_v"] else (h @ w["v_proj"].T).view(n, KV, D)
        k_all[pos] = rope(rms(k_raw, w["k_norm"], eps), inp["cos"], inp["sin"])
        v_all[pos] = rms(v, None, eps)
    G = H // KV  # query head j reads KV head j // G
    kh = k_all[:, torch.arange(H) // G]  # (keys, H, D)
    vh = v_all[:, torch.arange(H) // G]
    scores = torch.einsum("nhd,khd->hnk", q, kh)  # scaling 1.0 (q and k are normed)
    scores = scores.masked_fill(~inp["mask"][None], torch.finfo(torch.float32).min)
    attn = torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), vh).reshape(n, H * D)
    attn = attn @ w["o_proj"].T
    x = x + rms(attn, w["post_attn_norm"], eps)
    h = rms(x, w["pre_ffn_norm"], eps)
    mlp = (act(h @ w["gate_proj"].T) * (h @ w["up_proj"].T)) @ w["down_proj"].T
    x = x + rms(mlp, w["post_ffn_norm"], eps)
    if c["ple"]:
        g = act(x @ w["ple_gate"].T) * inp["per_layer_input"]
        x = x + rms(g @ w["ple_proj"].T, w["ple_norm"], eps)
    return x * w["layer_scalar"], attn


def global_tensor(inp, w, c):
    """The embeddings (the token's row, scaled) or the per-layer inputs (a token-identity part from
    the per-layer table plus a projection of REF's embeddings, RMS-normed, averaged) at the step."""
    if c["site"] == "embeddings":
        return w["embed_rows"] * float(c["embed_scale"])
    x = inp["embeddings"]
    n, layers, dim = x.shape[0], int(c["n_layers"]), int(c["ple_dim"])
    tok = (w["ple_rows"] * float(c["ple_scale"])).view(n, layers, dim)
    proj = (x @ w["ple_model_proj"].T) * (float(c["hidden"]) ** -0.5)
    proj = rms(proj.view(n, layers, dim), w["ple_proj_norm"], float(c["eps"]))
    return (proj + tok) * (2.0**-0.5)


def global_main(inp, w, out):
    """trace repro of the embeddings or per_layer_inputs: the recompute against REF, RUN and BASE."""
    kind = CONFIG["site"]
    got = global_tensor(inp, w, CONFIG)
    print(f"{kind}, step {CONFIG['step']}, positions {CONFIG['positions'][0]}..{CONFIG['positions'][-1]}")
    e_ref = rel_l2(got, out["ref_" + kind])
    print(f"float recompute vs REF ({CONFIG['ref_runtime']}) {kind}: rel-L2 {e_ref:.3e} (tolerance {TOLERANCE:.0e})")
    if "run_" + kind in out:
        print(f"float recompute vs RUN ({CONFIG['run_runtime']}) {kind}: rel-L2 {rel_l2(got, out['run_' + kind]):.3e}")
        run_err = rel_l2(out["run_" + kind], out["ref_" + kind])
        print(f"RUN vs REF {kind}: rel-L2 {run_err:.3e}")
        if "base_" + kind in out:
            base_err = rel_l2(out["base_" + kind], out["ref_" + kind])
            print(f"BASE ({CONFIG['base_runtime']}) vs REF {kind}: rel-L2 {base_err:.3e}")
            print(f"RUN's excess over BASE: x{run_err / base_err if base_err > 0 else math.inf:.3g}")
    ok = e_ref <= TOLERANCE
    print(verdict(ok, "run_" + kind in out))
    return 0 if ok else 1


def verdict(ok: bool, run: bool) -> str:
    """The last line: what exit 0 or 1 says (this script's recompute against REF, not RUN's error)."""
    if not ok:
        return "recompute does NOT match REF (exit 1): this script does not compute the site as REF does"
    return "recompute matches REF (exit 0)" + (": RUN's error above is RUN's own" if run else "")


def rel_l2(a, b):
    num = float(torch.linalg.vector_norm((a - b).double()))
    den = float(torch.linalg.vector_norm(b.double()))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def onnx_check(out):
    """layer.onnx (written by `trace repro --onnx`), run by onnxruntime when it is installed:
    its error against REF's layer_out, else None."""
    path = os.path.join(HERE, "layer.onnx")
    if not os.path.exists(path):
        return None
    try:
        import onnxruntime
    except ImportError:
        print("layer.onnx: not run (onnxruntime is not installed)")
        return None
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    dtypes = {"positions": np.int64, "mask": np.bool_}
    with np.load(os.path.join(HERE, "inputs.npz"), allow_pickle=False) as z:
        feeds = {i.name: np.asarray(z[i.name], dtype=dtypes.get(i.name, np.float32)) for i in session.get_inputs()}
    got = torch.from_numpy(session.run(["layer_out"], feeds)[0])
    e = rel_l2(got, out["ref_layer_out"])
    print(f"onnxruntime layer.onnx vs REF layer_out: rel-L2 {e:.3e} (tolerance {TOLERANCE:.0e})")
    return e


def main():
    torch.set_grad_enabled(False)
    inp, w, out = load("inputs.npz"), load("weights.npz"), load("outputs.npz")
    if CONFIG.get("site", "layer") != "layer":
        return global_main(inp, w, out)
    got, attn = layer(inp, w, CONFIG)
    print(
        f"layer {CONFIG['layer']} ({CONFIG['layer_type']}, {CONFIG['kv_role']}), step {CONFIG['step']}, "
        f"positions {CONFIG['positions'][0]}..{CONFIG['positions'][-1]}"
    )
    e_ref = rel_l2(got, out["ref_layer_out"])
    print(f"float recompute vs REF ({CONFIG['ref_runtime']}) layer_out: rel-L2 {e_ref:.3e} (tolerance {TOLERANCE:.0e})")
    if "ref_attn_out" in out:
        print(f"float recompute vs REF attn_out: rel-L2 {rel_l2(attn, out['ref_attn_out']):.3e}")
    if "run_layer_out" in out:
        print(
            f"float recompute vs RUN ({CONFIG['run_runtime']}) layer_out: rel-L2 "
            f"{rel_l2(got, out['run_layer_out']):.3e}"
        )
        run_err = rel_l2(out["run_layer_out"], out["ref_layer_out"])
        print(f"RUN vs REF layer_out: rel-L2 {run_err:.3e}")
        if "base_layer_out" in out:  # trace repro --baseline: what RUN adds to the trusted run's error
            base_err = rel_l2(out["base_layer_out"], out["ref_layer_out"])
            excess = run_err / base_err if base_err > 0 else math.inf
            print(f"BASE ({CONFIG['base_runtime']}) vs REF layer_out: rel-L2 {base_err:.3e}")
            print(f"RUN vs BASE layer_out: rel-L2 {rel_l2(out['run_layer_out'], out['base_layer_out']):.3e}")
            print(f"RUN's excess over BASE: x{excess:.3g} (RUN vs REF over BASE vs REF)")
    e_onnx = onnx_check(out)
    ok = e_ref <= TOLERANCE and (e_onnx is None or e_onnx <= TOLERANCE)
    print(verdict(ok, "run_layer_out" in out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
