"""The op table and the checks it drives: each :class:`OpInfo` row of :data:`OPS` (``table``) says
how to make samples for a device and dtype, its float64 reference, tolerances and bad inputs; each
``check_*`` takes one row. The pytest suite and the support matrix loop over :data:`OPS`, so a new
op gets every check by adding one row. Data apart from checks, as in PyTorch's OpInfo: ``core``,
``references``, ``samples``, ``bad_inputs``, ``fuzz``; ``checks``, ``subsystems``. Everything the
tests and the matrix use is importable from here.
"""

from .checks import (_call, _grad_inputs, _loss, _outputs, check_autograd, check_bad_inputs, check_compile,
                     check_correctness, check_export, check_gradcheck, check_meta, check_opcheck, export,
                     opcheck_samples)
from .core import (FLOAT_DTYPES, ROUNDED_ONCE, SUMMED_THEN_ROUNDED, FuzzSource, OpInfo, Sample, _to64, clone_sample,
                   devices, with_written)
from .references import (_add_rms_norm_ref, _attention_ref, _cache_attention_ref, _cache_write_ref,
                         _rope_cache_write_ref, _cross_entropy_ref, _linear_cross_entropy_ref, _merge_attention_ref, _mul_ref, _muladd_ref,
                         _rms_norm_ref, _rope_ref, _scale_clamp_ref, _silu_mul_ref, _silu_ref, _swiglu_ref)
from .subsystems import check_autocast, check_compiled_autograd, check_func, check_vmap, no_vmap_fallback
from .table import OPS, OPS_BY_NAME

__all__ = [
    # the table and its types
    "OPS", "OPS_BY_NAME", "OpInfo", "Sample", "FuzzSource", "FLOAT_DTYPES", "ROUNDED_ONCE", "SUMMED_THEN_ROUNDED",
    "clone_sample", "devices", "with_written",
    # the checks
    "check_correctness", "check_meta", "check_autograd", "opcheck_samples", "check_opcheck", "check_gradcheck",
    "check_compile", "export", "check_export", "check_bad_inputs", "check_func", "no_vmap_fallback", "check_vmap",
    "check_autocast", "check_compiled_autograd",
    # private, for the tests: the references and the checks' helpers
    "_muladd_ref", "_mul_ref", "_rms_norm_ref", "_add_rms_norm_ref", "_rope_ref", "_cross_entropy_ref",
    "_linear_cross_entropy_ref", "_attention_ref", "_cache_attention_ref", "_cache_write_ref", "_rope_cache_write_ref",
    "_merge_attention_ref",
    "_silu_ref", "_silu_mul_ref",
    "_swiglu_ref", "_scale_clamp_ref", "_to64", "_outputs", "_call", "_grad_inputs", "_loss",
]
