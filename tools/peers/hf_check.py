#!/usr/bin/env python3
"""Hugging Face `transformers` beside `export` and `model.init_from`, on the CPU in f32.

    python3 tools/peers/hf_check.py load DIR     # DIR: an export with ids.json and logits.json
    python3 tools/peers/hf_check.py save DIR     # a tiny random LlamaForCausalLM, its logits

`load` reads an exported directory with `LlamaForCausalLM.from_pretrained`, runs the token ids in
DIR/ids.json and prints the largest difference from DIR/logits.json (ours), relative to the
largest logit, as JSON. `save` writes a tiny random `LlamaForCausalLM` (width 64, 2 layers, 4
query and 2 key/value heads, SwiGLU width 192, 97 tokens, untied head) with `save_pretrained`,
and its logits on fixed ids in DIR/ids.json and DIR/logits.json, for `model.init_from` to read.
"""
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def main():
    mode, d = sys.argv[1], sys.argv[2]
    if mode == "load":
        model = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        ids = json.load(open(f"{d}/ids.json"))
        ours = torch.tensor(json.load(open(f"{d}/logits.json")))
        theirs = logits(model, ids)
        worst = (theirs - ours).abs().max().item()
        big = ours.abs().max().item()
        print(json.dumps({"mode": "load", "dir": d, "max_abs_diff": worst, "max_abs_logit": big,
                          "relative": worst / max(big, 1e-30),
                          "argmax_agree": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())}))
    else:
        torch.manual_seed(7)
        cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                          attention_bias=False, mlp_bias=False)
        model = LlamaForCausalLM(cfg).eval()
        # Norm gains away from one, so that a gain read into the wrong norm shows.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(d, safe_serialization=True)
        ids = [(i * 7 + 3) % 97 for i in range(32)]
        json.dump(ids, open(f"{d}/ids.json", "w"))
        json.dump(logits(model, ids).tolist(), open(f"{d}/logits.json", "w"))
        print(json.dumps({"mode": "save", "dir": d}))


if __name__ == "__main__":
    main()
