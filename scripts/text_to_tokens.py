#!/usr/bin/env python3
"""Turn text files into a nanoGPT-style token file of byte ids (0-255, uint16), the format
`data.tokenFile` reads. Byte-level "tokenization" needs no tokenizer download, so a real-text
run works offline:

    python scripts/text_to_tokens.py README.md operator/README.md --output data/bytes.bin
    cephalo run examples/local-text.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="text files to concatenate")
    parser.add_argument("--output", "-o", type=Path, required=True)
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        print(f"text_to_tokens: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    data = b"\n".join(p.read_bytes() for p in args.inputs)
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tokens.tofile(tmp)
    tmp.replace(args.output)
    print(f"wrote {tokens.size:,} byte tokens to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
