#!/usr/bin/env python3
"""Write an FP8 checkpoint the way the Hugging Face hub's are made, from a float model, to
measure Lantern's FP8 path on a real model (the hub cannot be reached from here).

    python scripts/fp8-checkpoint.py SRC OUT [--gguf FILE] [--block 128 | --channel]

SRC is a Hugging Face folder (or, with --gguf, the folder holding a GGUF file that
transformers dequantizes to float32). Every q/k/v/o/gate/up/down projection becomes
float8_e4m3fn with a float32 `<name>_scale_inv` per [block, block] tile (DeepSeek-V3 /
Qwen3-FP8 / transformers' `fp8` method; default 128), or with --channel a bfloat16
`<name>_scale` per output row (llm-compressor's compressed-tensors channel strategy).
Scales are amax / 448; embeddings, norms and lm_head stay in the source dtype. OUT also gets
the float32 model as OUT-f32/ for the baseline. Needs torch, transformers, safetensors.
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def block_quant(w, b):
    rows, k = w.shape
    sr, sk = -(-rows // b), -(-k // b)
    pad = torch.zeros(sr * b, sk * b, dtype=torch.float32)
    pad[:rows, :k] = w.float()
    tiles = pad.view(sr, b, sk, b)
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(sr * b, sk * b)[:rows, :k].contiguous()
    return q, scale.contiguous(), "_scale_inv"


def channel_quant(w):
    s = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (w.float() / s.float()).to(torch.float8_e4m3fn), s, "_scale"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--gguf")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--channel", action="store_true")
    a = ap.parse_args()
    kw = {"gguf_file": a.gguf} if a.gguf else {}
    model = AutoModelForCausalLM.from_pretrained(a.src, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(a.src, **kw)
    sd = {n: w.contiguous() for n, w in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # transformers marks GGUF-loaded models so
    f32 = a.out.rstrip("/") + "-f32"
    os.makedirs(f32, exist_ok=True)
    save_file(sd, os.path.join(f32, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(f32, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tok.save_pretrained(f32)
    out = {}
    for n, w in sd.items():
        if n.endswith(".weight") and any(p in n for p in PROJ) and w.dim() == 2:
            q, s, suffix = channel_quant(w) if a.channel else block_quant(w, a.block)
            out[n], out[n + suffix] = q, s
        else:
            out[n] = w.contiguous()
    os.makedirs(a.out, exist_ok=True)
    save_file(out, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = (
        {"quant_method": "compressed-tensors", "format": "float-quantized"} if a.channel
        else {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [a.block, a.block]}
    )
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tok.save_pretrained(a.out)
    print("wrote", a.out, "and", a.out.rstrip("/") + "-f32")


if __name__ == "__main__":
    main()
