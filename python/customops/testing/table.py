"""The op table: one :class:`OpInfo` row per op (or overload) of the library, with its sample,
batch, bad-input and fuzz makers, its float64 reference and its tolerances. The checks, the
pytest suite and the support matrix loop over :data:`OPS`: a new op gets every check by adding
one row here.
"""

from __future__ import annotations

import torch

from .bad_inputs import (_add_rms_norm_bad_inputs, _attention_bad_inputs, _binary_bad_inputs,
                         _cache_attention_bad_inputs, _cache_write_bad_inputs, _cross_entropy_bad_inputs, _rope_cache_write_bad_inputs,
                         _fused_linear_bad_inputs,
                         _linear_cross_entropy_bad_inputs, _merge_attention_bad_inputs, _rms_norm_bad_inputs,
                         _rope_bad_inputs, _scale_clamp_bad_inputs, _silu_mul_bad_inputs, _swiglu_bad_inputs,
                         _quantize_fp8_bad_inputs, _quantize_int4_bad_inputs, _unary_bad_inputs)
from .core import ROUNDED_ONCE, SUMMED_THEN_ROUNDED, OpInfo
from .fuzz import (_fuzz_attention, _fuzz_cache_attention, _fuzz_cache_write, _fuzz_cross_entropy, _fuzz_elementwise,
                   _fuzz_fused_linear, _fuzz_rope_cache_write,
                   _fuzz_linear_cross_entropy, _fuzz_merge_attention, _fuzz_muladd_c, _fuzz_rms_norm, _fuzz_rope,
                   _fuzz_scale_clamp, _fuzz_swiglu)
from .references import (_add_rms_norm_ref, _attention_ref, _cache_attention_ref, _cache_write_ref, _rope_cache_write_ref,
                         _cross_entropy_ref, _fused_linear_ref, _linear_cross_entropy_ref, _merge_attention_ref,
                         _mul_ref, _muladd_ref,
                         _quantize_fp8_ref, _quantize_int4_ref, _rms_norm_ref, _rope_ref, _scale_clamp_ref,
                         _silu_mul_ref, _silu_ref, _swiglu_ref)
from .samples import (_add_rms_norm_batch, _add_rms_norm_samples, _attention_batch, _attention_samples,
                      _cache_attention_batch, _cache_attention_samples, _cache_write_batch, _cache_write_samples,
                      _cross_entropy_batch, _cross_entropy_samples, _elementwise_batch, _elementwise_samples,
                      _fused_linear_batch, _fused_linear_samples,
                      _halves_samples, _linear_cross_entropy_batch, _linear_cross_entropy_samples,
                      _merge_attention_batch, _merge_attention_samples, _rms_norm_batch, _rms_norm_samples,
                      _rope_batch, _rope_cache_write_batch, _rope_cache_write_samples, _rope_samples, _swiglu_batch,
                      _swiglu_samples, _quantize_fp8_batch, _quantize_fp8_samples, _quantize_int4_batch,
                      _quantize_int4_samples)


OPS: list[OpInfo] = [
    OpInfo(
        name="muladd",
        samples=_elementwise_samples(2, (0.75,)),
        ref=_muladd_ref,
        batch=_elementwise_batch(2, (0.75,)),
        bad_inputs=_binary_bad_inputs("muladd", (0.75,)),
        autocast="promote",
        cancels=True,
        fuzz=_fuzz_elementwise(2, _fuzz_muladd_c),
    ),
    OpInfo(
        name="mul",
        samples=_elementwise_samples(2),
        ref=_mul_ref,
        batch=_elementwise_batch(2),
        bad_inputs=_binary_bad_inputs("mul"),
        autocast="promote",
        fuzz=_fuzz_elementwise(2),
    ),
    OpInfo(
        name="muladd.out",
        samples=_elementwise_samples(2, (-1.5,), with_out=True),
        ref=_muladd_ref,
        batch=_elementwise_batch(2, (-1.5,), with_out=True),
        bad_inputs=_binary_bad_inputs("muladd.out", (-1.5,), with_out=True),
        differentiable=False,
        cancels=True,
        fuzz=_fuzz_elementwise(2, _fuzz_muladd_c, with_out=True),
    ),
    OpInfo(
        name="rms_norm",
        samples=_rms_norm_samples,
        ref=_rms_norm_ref,
        batch=_rms_norm_batch,
        bad_inputs=_rms_norm_bad_inputs,
        # a reduction over the row before the final rounding: a little looser than one rounding
        tolerances={**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5)},
        double_backward=False,
        autocast="norm",
        fuzz=_fuzz_rms_norm(residual=False),
    ),
    OpInfo(
        name="add_rms_norm",
        samples=_add_rms_norm_samples,
        ref=_add_rms_norm_ref,
        batch=_add_rms_norm_batch,
        bad_inputs=_add_rms_norm_bad_inputs,
        # the reference normalizes the exact sum, the op the sum rounded to the dtype
        tolerances=SUMMED_THEN_ROUNDED,
        double_backward=False,
        diff_outputs=(0, 1),
        autocast="add_norm",
        cancels=True,
        fuzz=_fuzz_rms_norm(residual=True),
    ),
    OpInfo(
        name="rope",
        samples=_rope_samples,
        ref=_rope_ref,
        batch=_rope_batch,
        bad_inputs=_rope_bad_inputs,
        diff_outputs=(0, 1),
        grad_args=(0, 1),
        autocast="first",
        cancels=True,
        fuzz=_fuzz_rope,
    ),
    OpInfo(
        name="cross_entropy",
        samples=_cross_entropy_samples,
        ref=_cross_entropy_ref,
        batch=_cross_entropy_batch,
        bad_inputs=_cross_entropy_bad_inputs,
        # the outputs are float32 whatever the logits' dtype; the gradient is rounded once to it
        tolerances={**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5)},
        double_backward=False,
        diff_outputs=(0, 1),
        autocast="float32",
        cancels=True,
        fuzz=_fuzz_cross_entropy,
    ),
    OpInfo(
        name="linear_cross_entropy",
        samples=_linear_cross_entropy_samples,
        ref=_linear_cross_entropy_ref,
        batch=_linear_cross_entropy_batch,
        bad_inputs=_linear_cross_entropy_bad_inputs,
        # the logits are rounded to the inputs' dtype before the loss, as in eager
        tolerances={**ROUNDED_ONCE, torch.float32: (5e-5, 5e-5), torch.float16: (1e-2, 1e-2),
                    torch.bfloat16: (5e-2, 3e-2)},
        double_backward=False,
        autocast="lower",
        cancels=True,
        fuzz=_fuzz_linear_cross_entropy,
    ),
    OpInfo(
        name="attention",
        samples=_attention_samples,
        ref=_attention_ref,
        batch=_attention_batch,
        bad_inputs=_attention_bad_inputs,
        # sums over keys before the final rounding
        tolerances=SUMMED_THEN_ROUNDED,
        double_backward=False,
        diff_outputs=(0, 1),
        grad_args=(0, 1, 2),
        autocast="lower",
        fuzz=_fuzz_attention,
    ),
    OpInfo(
        name="merge_attention",
        samples=_merge_attention_samples,
        ref=_merge_attention_ref,
        batch=_merge_attention_batch,
        bad_inputs=_merge_attention_bad_inputs,
        tolerances={**ROUNDED_ONCE, torch.float32: (2e-5, 2e-5)},
        diff_outputs=(0, 1),
        cancels=True,
        fuzz=_fuzz_merge_attention,
    ),
    OpInfo(
        name="cache_attention",
        samples=_cache_attention_samples,
        ref=_cache_attention_ref,
        batch=_cache_attention_batch,
        bad_inputs=_cache_attention_bad_inputs,
        tolerances=SUMMED_THEN_ROUNDED,
        differentiable=False,  # inference: refuses inputs that require grad
        fuzz=_fuzz_cache_attention,
    ),
    OpInfo(
        name="cache_write",
        samples=_cache_write_samples,
        ref=_cache_write_ref,
        batch=_cache_write_batch,
        bad_inputs=_cache_write_bad_inputs,
        tolerances={d: (0.0, 0.0) for d in ROUNDED_ONCE},  # a copy
        differentiable=False,
        writes=(0, 1),
        fuzz=_fuzz_cache_write,
    ),
    OpInfo(
        name="rope_cache_write",
        samples=_rope_cache_write_samples,
        ref=_rope_cache_write_ref,
        batch=_rope_cache_write_batch,
        bad_inputs=_rope_cache_write_bad_inputs,
        differentiable=False,
        writes=(0, 1),
        cancels=True,  # a rotation
        fuzz=_fuzz_rope_cache_write,
    ),
    OpInfo(
        name="silu",
        samples=_elementwise_samples(1),
        ref=_silu_ref,
        batch=_elementwise_batch(1),
        bad_inputs=_unary_bad_inputs("silu"),
        double_backward=False,
        fuzz=_fuzz_elementwise(1),
    ),
    OpInfo(
        name="silu_mul",
        samples=_halves_samples,
        ref=_silu_mul_ref,
        batch=_elementwise_batch(2),
        bad_inputs=_silu_mul_bad_inputs,
        double_backward=False,
        autocast="promote",
        fuzz=_fuzz_elementwise(2),
    ),
    OpInfo(
        name="swiglu",
        samples=_swiglu_samples,
        ref=_swiglu_ref,
        batch=_swiglu_batch,
        bad_inputs=_swiglu_bad_inputs,
        double_backward=False,
        fuzz=_fuzz_swiglu,
    ),
    OpInfo(
        name="fused_linear",
        samples=_fused_linear_samples,
        ref=_fused_linear_ref,
        batch=_fused_linear_batch,
        bad_inputs=_fused_linear_bad_inputs,
        # a sum over in_features of a prologue rounded to the dtype, rounded again
        tolerances={**SUMMED_THEN_ROUNDED, torch.float32: (5e-5, 5e-5), torch.float16: (5e-3, 5e-3),
                    torch.bfloat16: (3e-2, 2e-2)},
        autocast="lower",
        cancels=True,
        grad_args=(0, 1, 2, 3, 5),  # not weight_scale: a quantized weight is frozen
        fuzz=_fuzz_fused_linear,
    ),
    OpInfo(
        name="quantize_fp8",
        samples=_quantize_fp8_samples,
        ref=_quantize_fp8_ref,
        batch=_quantize_fp8_batch,
        bad_inputs=_quantize_fp8_bad_inputs,
        tolerances={d: (0.0, 0.0) for d in ROUNDED_ONCE},  # the same rounding
        differentiable=False,  # rounding
        autocast="as_is",
    ),
    OpInfo(
        name="quantize_int4",
        samples=_quantize_int4_samples,
        ref=_quantize_int4_ref,
        batch=_quantize_int4_batch,
        bad_inputs=_quantize_int4_bad_inputs,
        tolerances={d: (0.0, 0.0) for d in ROUNDED_ONCE},  # the same rounding, in the weight's dtype
        differentiable=False,
        autocast="as_is",
        ref_in_dtype=True,
    ),
    OpInfo(
        name="scale_clamp",
        samples=_elementwise_samples(1, (2.0, -1.0, 1.5)),
        ref=_scale_clamp_ref,
        batch=_elementwise_batch(1, (2.0, -1.0, 1.5)),
        bad_inputs=_scale_clamp_bad_inputs,
        fuzz=_fuzz_elementwise(1, _fuzz_scale_clamp),
    ),
]


OPS_BY_NAME = {o.name: o for o in OPS}
