"""``python -m customops``: the live support matrix; ``python -m customops bench ...``: benchmarks.

The matrix checks every cell right then (nothing is read from a list): one row per op of the op
table, one column per capability. A failing cell shows why; the exit status is 0 only when every
applicable cell passes.

This module knows the commands and imports a command's module only to run it (``import customops``
imports none of them); no command module imports it back: what they share is in ``_cli``.
"""

from __future__ import annotations

import importlib
import sys

# Every command: its name -> its module, whose main(argv) -> int runs it with the arguments after
# the name. Without a name: DEFAULT, the support matrix.
COMMANDS = {"bench": "customops.bench"}
DEFAULT = "customops.matrix"

# Every command, for `python -m customops --help` (the matrix's help ends with it).
USAGE = """commands:
  python -m customops [options]     the live support matrix (this one)
  python -m customops bench [OP ...] [options]
                                    per-op benchmarks against eager, torch.compile and Liger-Kernel
                                    (needs the cli extra)
  python -m customops bench --model llama [options]
                                    a Hugging Face Llama training step and inference forward
                                    (needs the hf extra)
  python -m customops bench --generate [options]
                                    text generation: Hugging Face's against customops-run generate
  python -m customops bench --decode [options]
                                    decode attention and products against a KV cache (CUDA)
  python -m customops bench --attention [options]
                                    attention against SDPA, forward and forward+backward
  python -m customops bench --ring [options]
                                    ring attention across GPUs (under torchrun)
  python -m customops bench --linear [options]
                                    a decoder layer's products with bf16, fp8 and int4 weights (CUDA)
Each has its own --help."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    return importlib.import_module(DEFAULT).main(argv, epilog=USAGE)


if __name__ == "__main__":
    sys.exit(main())
