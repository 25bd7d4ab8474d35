"""The ``"customops"`` torch.compile backend: rewrites eager patterns into customops ops.

Dynamo's graph is traced once more into pre-dispatch ATen (above autograd and autocast, so the
rewritten graph still differentiates and autocasts like the original), the patterns of each family
are replaced with ``torch.pattern_matcher`` passes, and Inductor compiles the result. Autograd then
records customops' own backward ops, so training runs customops' backward kernels.
:func:`explain` shows per captured graph what matched and what was replaced.

- ``_match``: what every family shares: emitting a replacement, the canonical form, the passes,
  the checks every match makes, the report;
- ``_norms``: RMSNorm, residual add + RMSNorm, SwiGLU, silu;
- ``_losses``: cross-entropy, and a linear layer in front of it;
- ``_rope``: rotate-half RoPE of q and k;
- ``_attention``: SDPA, where the attention policy picks customops.attention;
- ``_backend``: the trace, the passes in order, the backend and ``explain``.
"""

from ._backend import _register_backend, backend, explain, rewrite  # noqa: F401  (_register_backend: for customops)
from ._match import GraphReport

__all__ = ["backend", "rewrite", "explain", "GraphReport"]
