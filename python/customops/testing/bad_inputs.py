"""Bad-input makers of the op table: per op, samples the op must reject, each with the regex of the
error it must raise, which names the op and the argument.
"""

from __future__ import annotations

import torch

from .core import Sample


def _binary_bad_inputs(name: str, scalars: tuple = (), with_out: bool = False):
    op = f"customops::{name}"

    def make(device):
        a = torch.randn(4, 4, device=device)
        kw = (lambda: {"out": torch.empty(4, 4, device=device)}) if with_out else (lambda: {})
        cases = [
            (Sample((a, torch.randn(4, 5, device=device)) + scalars, kw()), rf"{op}: expected b to have the shape"),
            (Sample((a, a.double()) + scalars, kw()), rf"{op}: expected b to have the dtype"),
            (Sample((a.long(), a.long()) + scalars, kw()), rf"{op}: a has dtype Long"),
            (Sample((a, a.int()) + scalars, kw()), rf"{op}: b has dtype Int"),
            (Sample((a, a.to("meta")) + scalars, kw()), rf"{op}: expected b to be on the device of a"),
        ]
        if with_out:
            buf = torch.randn(20, device=device)
            x, o = buf[:16].view(4, 4), buf[2:18].view(4, 4)
            cases += [
                (Sample((a, a) + scalars, {"out": torch.empty(4, 5, device=device)}),
                 rf"{op}: expected out to have the shape"),
                (Sample((a, a) + scalars, {"out": torch.empty(4, 4, device=device, dtype=torch.float64)}),
                 rf"{op}: expected out to have the dtype"),
                (Sample((x, x.clone()) + scalars, {"out": o}), rf"{op}: out overlaps a partially"),
                (Sample((a, a) + scalars, {"out": torch.empty(4, 1, device=device).expand(4, 4)}),
                 rf"{op}: out has elements that share memory"),
                (Sample((a.clone().requires_grad_(), a) + scalars, kw()),
                 rf"{op}: out= arguments don't support automatic differentiation"),
            ]
        return cases

    return make


def _unary_bad_inputs(name, scalars=()):
    op = f"customops::{name}"

    def make(device):
        x = torch.randn(4, 4, device=device)
        return [(Sample((x.long(),) + scalars), rf"{op}: x has dtype Long"),
                (Sample((x.int(),) + scalars), rf"{op}: x has dtype Int"),
                (Sample((x.bool(),) + scalars), rf"{op}: x has dtype Bool"),
                (Sample((x.to(torch.complex64),) + scalars), rf"{op}: x has dtype ComplexFloat")]

    return make


def _rms_norm_bad_inputs(device):
    op = "customops::rms_norm"
    x = torch.randn(4, 8, device=device)
    return [
        (Sample((x, torch.ones(7, device=device), 1e-6)), rf"{op}: expected weight of shape \[8\]"),
        (Sample((x, torch.ones(8, device=device, dtype=torch.float64), 1e-6)), rf"{op}: expected weight to have the dtype"),
        (Sample((x.half(), torch.ones(8, device=device, dtype=torch.bfloat16), 1e-6)),
         rf"{op}: expected weight to have the dtype of x \(Half\), or float32"),
        (Sample((x.long(), None, 1e-6)), rf"{op}: x has dtype Long"),
        (Sample((x, torch.ones(8, device="meta"), 1e-6)), rf"{op}: expected weight to be on the device of x"),
        (Sample((torch.tensor(1.0, device=device), None, 1e-6)), rf"{op}: x must have at least one dimension"),
    ]


def _add_rms_norm_bad_inputs(device):
    op = "customops::add_rms_norm"
    x = torch.randn(4, 8, device=device)
    return [
        (Sample((x, torch.randn(4, 7, device=device), None, 1e-6)), rf"{op}: expected residual to have the shape"),
        (Sample((x, x.double(), None, 1e-6)), rf"{op}: expected residual to have the dtype"),
        (Sample((x, x.to("meta"), None, 1e-6)), rf"{op}: expected residual to be on the device of x"),
        (Sample((x, x, torch.ones(7, device=device), 1e-6)), rf"{op}: expected weight of shape \[8\]"),
        (Sample((x.long(), x.long(), None, 1e-6)), rf"{op}: x has dtype Long"),
        (Sample((torch.tensor(1.0, device=device), torch.tensor(1.0, device=device), None, 1e-6)),
         rf"{op}: x must have at least one dimension"),
    ]


def _rope_bad_inputs(device):
    op = "customops::rope"
    q, k, c = (torch.randn(2, 4, 5, 8, device=device), torch.randn(2, 2, 5, 8, device=device),
               torch.randn(5, 8, device=device))
    return [
        (Sample((q, k.double(), c, c, False)), rf"{op}: expected k to have the dtype of q"),
        (Sample((q[0], k, c, c, False)), rf"{op}: expected q of shape \[B, Hq, S, D\]"),
        (Sample((q, k[:, :, :4], c, c, False)), rf"{op}: expected k of shape \[B, Hkv, S, D\] with B, S and D of q"),
        (Sample((q, k, c[:4], c[:4], False)), rf"{op}: expected cos of shape \[S, R\] or \[B, S, R\] with S = 5"),
        (Sample((q, k, torch.randn(5, 10, device=device), torch.randn(5, 10, device=device), False)),
         rf"{op}: cos's last dim \(10, the rotated dims\) must be at most D = 8"),
        (Sample((q, k, c[:, :5], c[:, :5], False)), rf"{op}: cos's last dim \(5, the rotated dims\) must be even"),
        (Sample((q, k, c, c[:, :6], False)), rf"{op}: expected sin to have the shape of cos"),
        (Sample((q, k, torch.randn(3, 5, 8, device=device), torch.randn(3, 5, 8, device=device), False)),
         rf"{op}: expected cos of shape \[B, S, R\] with B = 1 or 2 \(q.shape\[0\]\), but got \[3, 5, 8\]"),
        (Sample((q.long(), k.long(), c, c, False)), rf"{op}: q has dtype Long"),
        (Sample((q, k, c.clone().requires_grad_(), c, False)), rf"{op}: cos and sin must not require grad"),
    ]


def _cross_entropy_bad_inputs(device):
    op = "customops::cross_entropy"
    x, t = torch.randn(4, 8, device=device), torch.randint(0, 8, (4,), device=device)
    cases = [
        (Sample((x, t.int(), -100, 0.0)), rf"{op}: expected target of dtype Long \(int64\)"),
        (Sample((x, t.float(), -100, 0.0)), rf"{op}: expected target of dtype Long"),
        (Sample((x, t[:3], -100, 0.0)), rf"{op}: expected target of shape logits.shape\[:-1\]"),
        (Sample((x.long(), t, -100, 0.0)), rf"{op}: logits has dtype Long"),
        (Sample((torch.tensor(1.0, device=device), t, -100, 0.0)), rf"{op}: logits must have at least one dimension"),
        (Sample((x[:, :0], t, -100, 0.0)), rf"{op}: logits must have at least one class"),
        (Sample((x, t, -100, 1.5)), rf"{op}: label_smoothing must be in \[0, 1\]"),
        (Sample((x, t.to("meta"), -100, 0.0)), rf"{op}: expected target to be on the device of logits"),
    ]
    if torch.device(device).type == "cpu":  # CUDA gives NaN for the row instead (no device sync)
        cases += [(Sample((x, torch.tensor([0, 8, 1, 2], device=device), -100, 0.0)),
                   rf"{op}: target holds 8 at index 1, outside \[0, 8\) and not ignore_index \(-100\)"),
                  (Sample((x, torch.tensor([0, -1, 1, 2], device=device), -100, 0.0)), rf"{op}: target holds -1")]
    return cases


def _linear_cross_entropy_bad_inputs(device):
    op = "customops::linear_cross_entropy"
    h, w, t = torch.randn(4, 8, device=device), torch.randn(10, 8, device=device), torch.randint(0, 10, (4,), device=device)
    return [
        (Sample((h, torch.randn(10, 7, device=device), t)), rf"{op}: expected weight of shape \[V, H\] with H = 8"),
        (Sample((h, w.double(), t)), rf"{op}: expected weight to have the dtype of hidden"),
        (Sample((h, w, t.int())), rf"{op}: expected target of dtype Long"),
        (Sample((h, w, t[:3])), rf"{op}: expected target of shape \[N\] with N = 4"),
        (Sample((h.long(), w.long(), t)), rf"{op}: hidden has dtype Long"),
        (Sample((h[0], w, t)), rf"{op}: expected hidden of shape \[N, H\]"),
        (Sample((h, w, t, torch.randn(9, device=device))), rf"{op}: expected bias of shape \[V\] with V = 10"),
        (Sample((h, w, t, None, -100, 0.0, "none")), rf"{op}: reduction must be \"mean\" or \"sum\""),
        (Sample((h, w, t, None, -100, 0.0, "mean", 0)), rf"{op}: tile_rows must be positive, but got 0"),
        (Sample((h, w, t, None, -100, -0.5)), rf"{op}: label_smoothing must be in \[0, 1\]"),
    ]


def _attention_bad_inputs(device):
    op = "customops::attention"
    q, k = torch.randn(1, 4, 5, 8, device=device), torch.randn(1, 2, 6, 8, device=device)
    return [
        (Sample((q, k.double(), k)), rf"{op}: expected k to have the dtype of q"),
        (Sample((q.long(), k.long(), k.long())), rf"{op}: q has dtype Long"),
        (Sample((q[0], k, k)), rf"{op}: expected q of shape \[B, Hq, Sq, D\]"),
        (Sample((q[:, :3], k, k)), rf"{op}: q's heads \(3\) must be a multiple of k's \(2\)"),
        (Sample((q, k[..., :4], k[..., :4])), rf"{op}: expected k of shape \[B, Hkv, Sk, D\] with B and D of q"),
        (Sample((q, k, k[:, :, :5])), rf"{op}: expected v to have the shape of k"),
        (Sample((q, k[:, :0], k[:, :0])), rf"{op}: k must have at least one head"),
        (Sample((q, k.to("meta"), k)), rf"{op}: expected k to be on the device of q"),
    ]


def _cache_attention_bad_inputs(device):
    op = "customops::cache_attention"
    q, kc = torch.randn(2, 4, 1, 8, device=device), torch.randn(2, 2, 6, 8, device=device)
    n = torch.tensor([3, 6], device=device)
    cases = [
        (Sample((q, kc.double(), kc.double(), n)), rf"{op}: expected k_cache to have the dtype of q"),
        (Sample((q[:, :3], kc, kc, n)), rf"{op}: q's heads \(3\) must be a multiple of the cache's \(2\)"),
        (Sample((q, kc[:1], kc[:1], n)), rf"{op}: the cache holds 1 sequences, fewer than q's batch \(2\); pass slots"),
        (Sample((q, kc, kc, n, None, n.int())), rf"{op}: expected slots of dtype int64"),
        (Sample((q, kc, kc, n, None, n[:1])), rf"{op}: expected slots of shape \[B\] = \[2\]"),
        (Sample((q, kc, kc[..., :4], n)), rf"{op}: expected v_cache to have the shape of k_cache"),
        (Sample((q, kc, kc, n.int())), rf"{op}: expected lengths of dtype int64"),
        (Sample((q, kc, kc, n[:1])), rf"{op}: expected lengths of shape \[B\] = \[2\]"),
        (Sample((torch.randn(2, 4, 7, 8, device=device), kc, kc, n)),
         rf"{op}: q has 7 new queries a sequence, more than the cache's 6"),
        (Sample((q, kc, kc, n.to("meta"))), rf"{op}: expected lengths to be on the device of k_cache"),
    ]
    if torch.device(device).type == "cpu":  # on CUDA a length out of range gives NaN rows (no sync)
        cases.append((Sample((q, kc, kc, torch.tensor([3, 7], device=device))),
                      rf"{op}: lengths\[1\] is 7; it must be at least the 1 new queries and at most the cache's 6"))
        cases.append((Sample((q, kc, kc, n, None, torch.tensor([1, 2], device=device))),
                      rf"{op}: slots\[1\] is 2, outside the cache's 2 sequences \[0, 2\)"))
    return cases


def _cache_write_bad_inputs(device):
    op = "customops::cache_write"
    kc, vc, k = (torch.zeros(2, 2, 6, 8, device=device), torch.zeros(2, 2, 6, 8, device=device),
                 torch.randn(2, 2, 3, 8, device=device))
    s = torch.tensor([0, 3], device=device)
    cases = [
        (Sample((kc, vc, k, k.double(), s)), rf"{op}: expected v to have the dtype of k_cache"),
        (Sample((kc, vc, k[:, :1], k[:, :1], s)), rf"{op}: expected k of shape \[B, Hkv, T, D\] with the cache's"),
        (Sample((kc[:1], vc[:1], k, k, s)), rf"{op}: the cache holds 1 sequences, fewer than k's batch \(2\)"),
        (Sample((kc[:1], vc[:1], k, k, s, s)), rf"{op}: the cache holds 1 sequences, fewer than k's batch \(2\), so its "
                                               "slots cannot be distinct"),
        (Sample((kc, vc, k, k, s.int())), rf"{op}: expected start of dtype int64"),
        (Sample((kc, vc, k, k, s[:1])), rf"{op}: expected start of shape \[B\] = \[2\]"),
        (Sample((kc, vc, torch.randn(2, 2, 7, 8, device=device), torch.randn(2, 2, 7, 8, device=device), s)),
         rf"{op}: k has 7 new positions a sequence, more than the cache's 6"),
        (Sample((kc, vc[..., :4], k, k, s)), rf"{op}: expected v_cache to have the shape of k_cache"),
        # written in place: caches whose elements share memory, or that share it with each other
        (Sample((kc[:1].expand(2, -1, -1, -1), vc, k, k, s)), rf"{op}: k_cache has elements that share memory"),
        (Sample((kc, kc, k, k, s)), rf"{op}: k_cache and v_cache share memory"),
    ]
    if torch.device(device).type == "cpu":  # on CUDA start is read on the device: rows outside are not written
        cases.append((Sample((kc, vc, k, k, torch.tensor([0, 4], device=device))),
                      rf"{op}: start\[1\] is 4; its 3 new positions must fit in the cache's 6"))
        cases.append((Sample((kc, vc, k, k, s, torch.tensor([1, 1], device=device))),
                      rf"{op}: slots\[0\] and slots\[1\] are both 1; the sequences a call writes must be distinct"))
        cases.append((Sample((kc, vc, k, k, s, torch.tensor([-1, 0], device=device))),
                      rf"{op}: slots\[0\] is -1, outside the cache's 2 sequences"))
    return cases


def _rope_cache_write_bad_inputs(device):
    op = "customops::rope_cache_write"
    kc, vc = torch.zeros(2, 2, 6, 8, device=device), torch.zeros(2, 2, 6, 8, device=device)
    q, k, c = torch.randn(2, 4, 3, 8, device=device), torch.randn(2, 2, 3, 8, device=device), torch.randn(3, 8, device=device)
    s = torch.tensor([0, 3], device=device)
    cases = [
        (Sample((kc, vc, q, k.double(), k, c, c, s)), rf"{op}: expected k to have the dtype of q"),
        (Sample((kc, vc, q, k, k, c[:2], c[:2], s)), rf"{op}: expected cos of shape \[S, R\] or \[B, S, R\] with S = 3"),
        (Sample((kc, vc, q, k, k.double(), c, c, s)), rf"{op}: expected v to have the dtype of k_cache"),
        (Sample((kc[:, :1], vc[:, :1], q, k, k, c, c, s)), rf"{op}: expected k of shape \[B, Hkv, T, D\] with the cache's"),
        (Sample((kc, vc, q, k, k, c, c, s.int())), rf"{op}: expected start of dtype int64"),
        (Sample((kc, vc, q.clone().requires_grad_(), k, k, c, c, s)), rf"{op} is not differentiable"),
        (Sample((kc, vc[:1].expand(2, -1, -1, -1), q, k, k, c, c, s)), rf"{op}: v_cache has elements that share memory"),
        (Sample((kc, kc, q, k, k, c, c, s)), rf"{op}: k_cache and v_cache share memory"),
    ]
    if torch.device(device).type == "cpu":  # on CUDA start is read on the device: rows outside are not written
        cases.append((Sample((kc, vc, q, k, k, c, c, torch.tensor([0, 4], device=device))),
                      rf"{op}: start\[1\] is 4; its 3 new positions must fit in the cache's 6"))
        cases.append((Sample((kc, vc, q, k, k, c, c, s, torch.tensor([0, 0], device=device))),
                      rf"{op}: slots\[0\] and slots\[1\] are both 0; the sequences a call writes must be distinct"))
    return cases


def _merge_attention_bad_inputs(device):
    op = "customops::merge_attention"
    o, l = torch.randn(2, 4, 8, device=device), torch.randn(2, 4, device=device)
    return [
        (Sample((o, l, o[:, :3], l)), rf"{op}: expected out_b to have the shape of out_a"),
        (Sample((o, l[:, :3], o, l[:, :3])), rf"{op}: expected lse_a of shape out_a.shape\[:-1\]"),
        (Sample((o, l, o, l.double())), rf"{op}: expected lse_b to have the dtype of lse_a"),
        (Sample((o.long(), l, o.long(), l)), rf"{op}: out_a has dtype Long"),
    ]


def _silu_mul_bad_inputs(device):
    op = "customops::silu_mul"
    g = torch.randn(4, 4, device=device)
    return [
        (Sample((g, torch.randn(4, 5, device=device))), rf"{op}: expected up to have the shape"),
        (Sample((g, g.double())), rf"{op}: expected up to have the dtype"),
        (Sample((g.long(), g.long())), rf"{op}: gate has dtype Long"),
        (Sample((g, g.to("meta"))), rf"{op}: expected up to be on the device of gate"),
    ]


def _swiglu_bad_inputs(device):
    op = "customops::swiglu"
    x = torch.randn(4, 6, device=device)
    return _unary_bad_inputs("swiglu")(device) + [
        (Sample((torch.randn(4, 7, device=device),)), rf"{op}: x's last dimension holds gate and up side by side, "
         r"so its size must be even, but x has shape \[4, 7\]"),
        (Sample((torch.tensor(1.0, device=device),)), rf"{op}: x must have at least one dimension"),
        (Sample((x[:, :5],)), rf"{op}: x's last dimension .* must be even"),
    ]


def _fused_linear_bad_inputs(device):
    op = "customops::fused_linear"
    x, w = torch.randn(2, 8, device=device), torch.randn(4, 8, device=device)
    return [
        (Sample((x, w, None, None, "gelu")), rf'{op}: prologue must be "none", "rms_norm" or "swiglu", but got "gelu"'),
        (Sample((x.long(), w.long())), rf"{op}: x has dtype Long"),
        (Sample((x, w.double())), rf"{op}: expected weight to have the dtype of x"),
        (Sample((torch.tensor(1.0, device=device), w)), rf"{op}: x must have at least one dimension"),
        (Sample((x, w[0])), rf"{op}: expected weight of shape \[out_features, in_features\]"),
        (Sample((x, torch.randn(4, 6, device=device))), rf"{op}: x's last dim must be weight's in_features \(6\)"),
        (Sample((x, w, None, None, "swiglu")), rf'{op}: with prologue "swiglu", x\'s last dim holds gate then up '
         r"and must be twice weight's in_features \(8\)"),
        (Sample((x, w, torch.randn(5, device=device))), rf"{op}: expected bias of shape \[4\], but got \[5\]"),
        (Sample((x, w, None, torch.randn(2, 8, device=device))),
         rf"{op}: expected residual of the result's shape, x.shape\[:-1\] \+ \[4\], but got \[2, 8\]"),
        (Sample((x, w, None, torch.randn(4, device=device))), rf"{op}: expected residual of the result's shape"),
        (Sample((x, w, None, None, "none", torch.ones(8, device=device))),
         rf'{op}: norm_weight is given but prologue is "none"'),
        (Sample((x, w, None, None, "rms_norm", torch.ones(6, device=device))),
         rf"{op}: expected norm_weight of shape \[8\] \(x's last dim\), but got \[6\]"),
        (Sample((x, w, None, None, "rms_norm", torch.ones(8, device=device, dtype=torch.float64))),
         rf"{op}: expected norm_weight to have the dtype of x \(Float\), or float32 when x is float16 or bfloat16"),
    ]


def _scale_clamp_bad_inputs(device):
    op = "customops::scale_clamp"
    return _unary_bad_inputs("scale_clamp", (2.0, -1.0, 1.0))(device) + [
        (Sample((torch.randn(3, device=device), 2.0, 1.0, -1.0)), rf"{op}: expected lo <= hi"),
    ]


def _quantize_fp8_bad_inputs(device):
    op = "customops::quantize_fp8"
    return [
        (Sample((torch.ones(2, 2, dtype=torch.long, device=device),)), rf"{op}: weight has dtype Long"),
        (Sample((torch.ones(4, device=device),)), rf"{op}: expected weight of shape \[out_features, in_features\]"),
        (Sample((torch.tensor([[1.0, float("inf")]], device=device),)), rf"{op}: weight holds NaN or infinite values"),
        (Sample((torch.ones(2, 2, device=device, requires_grad=True),)), rf"{op} is not differentiable"),
    ]


def _quantize_int4_bad_inputs(device):
    op = "customops::quantize_int4"
    return [
        (Sample((torch.ones(2, 100, device=device), 128)),
         rf"{op}: weight's in_features \(100\) must be a positive multiple of group_size \(128\)"),
        (Sample((torch.ones(2, 6, device=device), 3)), rf"{op}: group_size must be an even number >= 2, but it is 3"),
        (Sample((torch.full((1, 16), float("nan"), device=device), 16)), rf"{op}: weight holds NaN or infinite values"),
        (Sample((torch.ones(2, 16, dtype=torch.int32, device=device), 16)), rf"{op}: weight has dtype Int"),
    ]
