"""``python -m customops bench``: the benchmarks, in families. The default one times each op against
PyTorch eager, torch.compile and Liger-Kernel (:mod:`.ops`, its registry :mod:`.op_table`, its
output :mod:`.report`); ``--model`` times a Hugging Face model's training step and inference
forward (:mod:`.model`, with ``--fsdp`` under FSDP2); ``--ring`` times ring attention across GPUs
against one (:mod:`.ring`); ``--generate`` times text generation, Python's against
``customops-run generate`` (:mod:`.generate`); ``--decode`` times decode attention against a KV
cache, customops' split-KV kernel against SDPA (:mod:`.decode`); ``--attention`` times attention
against SDPA at the attention issue's shapes, forward and forward+backward (:mod:`.attention`);
``--serve`` times ``customops-run serve`` under concurrent clients against ``customops-run
generate`` of the same batch (:mod:`.serve`); ``--linear`` times a decoder layer's products with
bfloat16, float8 and int4 weights (:mod:`.linear`).
The families share :mod:`.timers` and :mod:`.common`.

A family is a module whose ``main(argv) -> int`` parses its own options and runs it; a new family
is that module and one line in :data:`FAMILIES`. Only the family that runs is imported.
"""

from __future__ import annotations

import importlib

# The option that selects each family (None: the default one) -> its module.
FAMILIES = {
    None: "customops.bench.ops",
    "--model": "customops.bench.model",
    "--ring": "customops.bench.ring",
    "--generate": "customops.bench.generate",
    "--decode": "customops.bench.decode",
    "--attention": "customops.bench.attention",
    "--serve": "customops.bench.serve",
    "--linear": "customops.bench.linear",
}


def main(argv: list[str]) -> int:
    """Runs the family whose option is in argv (the default one when none is), with all of argv."""
    module = FAMILIES[None]
    for option, family in FAMILIES.items():
        if option is not None and any(a == option or a.startswith(f"{option}=") for a in argv):
            module = family
    return importlib.import_module(module).main(argv)
