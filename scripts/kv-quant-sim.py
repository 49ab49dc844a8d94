#!/usr/bin/env python3
"""Simulate 4-bit KV-cache layouts on a float model in transformers, to choose one before
writing kernels: the perplexity of a text at a context, with K (after RoPE) and V rounded
and restored the way each layout would store them.

    python scripts/kv-quant-sim.py HF_FOLDER [--text FILE] [--context 2048]

HF_FOLDER is a Llama-family float checkpoint (scripts/fp8-checkpoint.py writes SmolLM2's as
OUT-f32/). Layouts (group: elements sharing a scale; sym: round(x / amax * 7) / 7 * amax;
asym: 16 levels between the group's min and max; rot: a 64-point Walsh-Hadamard rotation of
the head before rounding, undone after; kivi: K per channel over each 16-token page,
asymmetric, as KIVI (arXiv:2402.02750) does over its groups). Needs torch and transformers.
"""

import argparse
import math

import torch
import transformers.models.llama.modeling_llama as ml
from transformers import AutoModelForCausalLM, AutoTokenizer


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def per_token(x, group, asym=False, rot=None):
    """Round the last dim (a head) in groups of `group`, 4 bits."""
    if rot is not None:
        x = x @ rot.T
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if asym:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
        g = torch.round((g - lo) / d).clamp(0, 15) * d + lo
    else:
        a = g.abs().amax(-1, keepdim=True)
        a = torch.where(a == 0, torch.ones_like(a), a)
        g = torch.round(g / a * 7) / 7 * a
    x = g.reshape(x.shape)
    return x @ rot if rot is not None else x


def per_channel_pages(k, page=16):
    """K [b, heads, t, d]: each channel over each page of `page` tokens, asymmetric 4 bits."""
    b, h, t, d = k.shape
    g = torch.nn.functional.pad(k, (0, 0, 0, (-t) % page)).reshape(b, h, -1, page, d)
    lo, hi = g.amin(3, keepdim=True), g.amax(3, keepdim=True)
    dd = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    g = torch.round((g - lo) / dd).clamp(0, 15) * dd + lo
    return g.reshape(b, h, -1, d)[:, :, :t]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--context", type=int, default=2048)
    a = ap.parse_args()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(a.model)(open(a.text).read(), return_tensors="pt").input_ids[0]
    hd = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    rot = hadamard(hd)
    cur = {"k": None, "v": None}
    rope = ml.apply_rotary_pos_emb

    def patched(q, k, *args, **kw):
        q, k = rope(q, k, *args, **kw)
        return q, (cur["k"](k) if cur["k"] else k)

    ml.apply_rotary_pos_emb = patched

    def v_hook(_m, _i, out):
        if not cur["v"]:
            return out
        return cur["v"](out.reshape(*out.shape[:-1], -1, hd)).reshape(out.shape)

    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(v_hook)

    @torch.no_grad()
    def ppl():
        nll, n = 0.0, 0
        for s in range(0, len(ids) - 1, a.context):
            w = ids[s:s + a.context]
            if len(w) < 2:
                break
            lg = model(w[None]).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(lg, w[1:], reduction="sum").item()
            n += len(w) - 1
        return math.exp(nll / n)

    layouts = {
        "f32": (None, None),
        "sym per token-head (Lantern's q4 today)": (lambda k: per_token(k, hd), lambda v: per_token(v, hd)),
        "sym per 32": (lambda k: per_token(k, 32), lambda v: per_token(v, 32)),
        "asym per token-head": (lambda k: per_token(k, hd, True), lambda v: per_token(v, hd, True)),
        "asym per 32": (lambda k: per_token(k, 32, True), lambda v: per_token(v, 32, True)),
        "rot + sym per token-head": (lambda k: per_token(k, hd, rot=rot), lambda v: per_token(v, hd, rot=rot)),
        "rot + asym per token-head": (lambda k: per_token(k, hd, True, rot), lambda v: per_token(v, hd, True, rot)),
        "K asym per 16, V asym per 32": (lambda k: per_token(k, 16, True), lambda v: per_token(v, 32, True)),
        "K only, sym per token-head": (lambda k: per_token(k, hd), None),
        "V only, sym per token-head": (None, lambda v: per_token(v, hd)),
        "K per channel per 16-token page, V asym per 32 (KIVI)": (per_channel_pages, lambda v: per_token(v, 32, True)),
    }
    print(f"{len(ids)} tokens, context {a.context}")
    base = None
    for name, (k, v) in layouts.items():
        cur["k"], cur["v"] = k, v
        p = ppl()
        base = base or p
        print(f"{name:56s} {p:8.3f} {100 * (p / base - 1):+7.2f}%", flush=True)


if __name__ == "__main__":
    main()
