"""The float64 references of the op table: each takes its op's arguments and returns what the op
returns, computed with ATen ops (the checks call them on float64 copies of the samples).
"""

from __future__ import annotations

import torch


def _muladd_ref(a, b, c, out=None):  # out: the muladd.out row's buffer, not read
    return a * b + c


def _mul_ref(a, b):
    return a * b


def _rms_norm_ref(x, weight=None, eps=1e-6):
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    y = x * rstd.unsqueeze(-1)
    return (y * weight if weight is not None else y), rstd


def _add_rms_norm_ref(x, residual, weight=None, eps=1e-6):
    s = x + residual
    y, rstd = _rms_norm_ref(s, weight, eps)
    return y, s, rstd


def _rope_ref(q, k, cos, sin, interleaved=False):
    r = cos.shape[-1]
    c, s_ = (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)  # broadcast over heads

    def rotate(x):
        xr, rest = x[..., :r], x[..., r:]
        if interleaved:
            turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        else:
            turned = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), -1)
        return torch.cat((xr * c + turned * s_, rest), -1)

    return rotate(q), rotate(k)


def _cross_entropy_ref(logits, target, ignore_index=-100, label_smoothing=0.0):
    lse = torch.logsumexp(logits, -1)
    ignored = target == ignore_index
    picked = logits.gather(-1, target.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    loss = lse - (1 - label_smoothing) * picked
    if label_smoothing:  # (0 * mean would turn a -inf logit into NaN)
        loss = loss - label_smoothing * logits.mean(-1)
    return loss.masked_fill(ignored, 0), lse


def _linear_cross_entropy_ref(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                              reduction="mean", tile_rows=None, tile_classes=None):
    """_cross_entropy_ref's loss of hidden @ weight^T (+ bias), reduced as F.cross_entropy reduces.
    (Not F.cross_entropy itself: with smoothing it sums -log_softmax over every class and every row
    before scaling, which overflows where the op's per-row losses, whose class sums stay within a
    row, are finite: hidden near 5e307 in float64 with 1000 classes.)"""
    logits = hidden @ weight.T + (bias if bias is not None else 0)
    loss = _cross_entropy_ref(logits, target, ignore_index, label_smoothing)[0]
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / (target != ignore_index).sum()


def _attention_ref(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale) v over every key (k and v repeated per group), and lse; a row that
    sees no key gives out 0 and lse -inf, a row with a NaN or +inf score NaN in both."""
    g = q.shape[1] // max(k.shape[1], 1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = scale if scale is not None else (q.shape[-1] ** -0.5 if q.shape[-1] else 1.0)
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        hidden = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), float("inf")).unsqueeze(-1))
    return p @ v, lse


def _slots(slots, b):
    return list(range(b)) if slots is None else slots.tolist()


def _cache_attention_ref(q, k_cache, v_cache, lengths, scale=None, slots=None):
    """Each sequence's attention over its filled positions (of its slot's cache row), causal (its
    queries the last ones)."""
    rows = _slots(slots, q.shape[0])
    outs = [_attention_ref(q[i:i + 1], k_cache[c:c + 1, :, :n], v_cache[c:c + 1, :, :n], True, scale)
            for i, (n, c) in enumerate(zip(lengths.tolist(), rows))]
    if not outs:
        return torch.empty_like(q), q.new_empty(q.shape[:3])
    return torch.cat([o for o, _ in outs]), torch.cat([l for _, l in outs])


def _cache_write_ref(k_cache, v_cache, k, v, start, slots=None):
    """The caches with each sequence's new rows at its start, in its slot's row (copies: the op
    writes in place)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for i, (s, c) in enumerate(zip(start.tolist(), _slots(slots, k.shape[0]))):
        k_cache[c, :, s:s + k.shape[2]] = k[i]
        v_cache[c, :, s:s + v.shape[2]] = v[i]
    return k_cache, v_cache


def _rope_cache_write_ref(k_cache, v_cache, q, k, v, cos, sin, start, slots=None):
    """rope, then the rotated k and v written into (copies of) the caches."""
    q_rot, k_rot = _rope_ref(q, k, cos, sin)
    return (q_rot, *_cache_write_ref(k_cache, v_cache, k_rot, v, start, slots))


def _merge_attention_ref(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1)
    return out_a * (lse_a.unsqueeze(-1) - safe).exp() + out_b * (lse_b.unsqueeze(-1) - safe).exp(), lse


def _silu_ref(x):
    return x * torch.sigmoid(x)


def _silu_mul_ref(gate, up):
    return gate * torch.sigmoid(gate) * up


def _swiglu_ref(x):
    gate, up = x.chunk(2, -1)
    return gate * torch.sigmoid(gate) * up


def _fused_linear_ref(x, weight, bias=None, residual=None, prologue="none", norm_weight=None, eps=1e-6,
                      constant_weight=False, weight_scale=None):
    if prologue == "rms_norm":  # in x's dtype (a float32 norm weight with half x is read as it is)
        x = _rms_norm_ref(x, norm_weight, eps)[0].to(x.dtype)
    elif prologue == "swiglu":
        x = _swiglu_ref(x)
    if weight_scale is not None:  # a quantized weight: the product in float32 (float64), then x's dtype
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = _dequantized_ref(weight, weight_scale, acc)
        y = torch.nn.functional.linear(x.to(acc), w, None if bias is None else bias.to(acc)).to(x.dtype)
    else:
        y = torch.nn.functional.linear(x, weight, bias)
    return y + residual if residual is not None else y


def _dequantized_ref(weight, scale, dtype):
    """A quantized weight [N, K] in dtype: float8 times its row's scale, or packed int4 (low nibble
    first) less 8 times its group's scale."""
    if scale.dim() == 1:  # float8 (as float8, or its values in float64: the reference's inputs)
        return weight.to(dtype) * scale.to(dtype)[:, None]
    n, groups = weight.shape[0], scale.shape[1]
    q = torch.stack([weight & 15, weight >> 4], -1).reshape(n, -1).to(dtype) - 8
    return (q.reshape(n, groups, -1) * scale.to(dtype)[:, :, None]).reshape(n, -1)


def _quantize_int4_ref(weight, group_size=128):
    """Each group of group_size inputs over the scale (of its largest magnitude / 7 times 1, 0.95,
    ..., 0.7, in float32, each rounded to weight's dtype, never to 0; 1 for zeros) whose rounding
    to [-8, 7] leaves the least squared error (the first of equals), stored plus 8, two a byte (low
    nibble first); the scale in weight's dtype."""
    n, k = weight.shape
    w = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    amax = w.abs().amax(2, keepdim=True)

    def stored(s):
        if weight.dtype not in (torch.bfloat16, torch.float16):
            return s
        r = s.to(weight.dtype).float()
        return torch.where(r > 0, r, torch.tensor(2.0 ** (-24 if weight.dtype == torch.float16 else -133)))

    best = best_err = None
    for i in range(7):
        s = torch.where(amax > 0, stored(amax * ((1 - 0.05 * i) / 7)), torch.ones_like(amax))
        err = ((torch.round(w / s).clamp(-8, 7) * s - w) ** 2).sum(2, keepdim=True)
        if best is None:
            best, best_err = s, err
        else:
            best, best_err = torch.where(err < best_err, s, best), torch.where(err < best_err, err, best_err)
    q = (torch.round(w / best).clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k // 2, 2)
    return q[..., 0] | (q[..., 1] << 4), best.squeeze(2).to(weight.dtype)


def _quantize_fp8_ref(weight):
    """Each row over its largest magnitude / 448 (1 where that is 0), rounded to float8_e4m3fn (in
    float32, as the op computes whatever the weight's dtype)."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(1) if w.numel() else torch.zeros(w.shape[0], device=w.device)
    scale = torch.where(amax / 448.0 > 0, amax / 448.0, torch.ones_like(amax))
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _scale_clamp_ref(x, scale, lo, hi):
    return torch.clamp(x * scale, lo, hi)
