#!/usr/bin/env python3
"""Write a tiny, briefly pre-trained Hugging Face Llama (byte-level, vocabulary 256) that
`examples/finetune-local.yaml` fine-tunes offline: no download, seconds on a CPU.

    python scripts/text_to_tokens.py docs/readme-walk.md --output data/pretrain.bin
    python scripts/make_tiny_hf_model.py --tokens data/pretrain.bin --output data/tiny-llama

The folder holds what `transformers`' `save_pretrained` writes (config.json +
model.safetensors), so a fine-tune of it starts at the pre-trained loss, well below the
ln(256) = 5.55 of an untrained model. Needs `transformers` (the dev extra).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

# The llama-tiny preset's shape (cephalo.api.models), with 64 positions for the example.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=Path, required=True,
                        help="uint16 byte-token file (scripts/text_to_tokens.py) to pre-train on")
    parser.add_argument("--output", "-o", type=Path, required=True, help="folder to write")
    parser.add_argument("--steps", type=int, default=300, help="pre-training steps")
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.tokens.is_file():
        print(f"make_tiny_hf_model: no such token file: {args.tokens}", file=sys.stderr)
        return 2
    tokens = np.fromfile(args.tokens, dtype=np.uint16).astype(np.int64)
    if len(tokens) <= args.sequence_length + 1:
        print(f"make_tiny_hf_model: {args.tokens} has only {len(tokens)} tokens",
              file=sys.stderr)
        return 2

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    # One thread: the matrices are tiny, and extra threads only spin (10x slower on a
    # machine whose cores are busy).
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = torch.from_numpy(tokens)
    seq = args.sequence_length
    loss = torch.tensor(math.log(256))
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - seq - 1, (args.batch_size,))
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        logits = model(window[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"pre-train step {step + 1}/{args.steps} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(args.output)
    print(f"wrote {args.output} (pre-trained loss {loss.item():.3f}, ln(256) = "
          f"{math.log(256):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
