"""Reference forwards for layouts whose model code is not installed (Meta / torchtitan Llama,
torchtitan Qwen3 MoE, torchtitan DeepSeek-V3, Megatron GPT, GPT-2 with nn.Linear weights), written
from the formulas in ../shared/reference/conversions.md and the torchtitan sources cited below,
independent of checkpoint.convert. float32, no cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def meta_scaled_freqs(freqs, scale_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192):
    """Meta's ``apply_scaling`` (meta-llama/llama-models, Llama 3.1's use_scaled_rope): long
    wavelengths divided by the factor, short ones kept, a smooth blend between."""
    low_wl, high_wl = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / scale_factor)
        else:
            smooth = (old_context_len / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / scale_factor + smooth * f)
    return torch.tensor(out, dtype=freqs.dtype)


def _angles(t: int, hd: int, theta: float, scaled: bool = False):
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    if scaled:
        freqs = meta_scaled_freqs(freqs)
    ang = torch.outer(torch.arange(t).float(), freqs)  # (T, hd/2)
    return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]


def rope_interleaved(x, theta, scaled=False):
    """Meta / torchtitan Llama: rotate pairs (x[2j], x[2j+1]); x is (B, T, H, hd)."""
    cos, sin = _angles(x.shape[1], x.shape[-1], theta, scaled)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)


def rope_half(x, theta):
    """HF / Megatron / Qwen3: rotate halves (x[j], x[j + hd/2])."""
    cos, sin = _angles(x.shape[1], x.shape[-1], theta)
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)


def attend(q, k, v):
    """Causal grouped-query attention scaled by 1/sqrt(q's head dim); q / k (B, T, H or G, hd),
    v (B, T, G, v_hd) -> (B, T, H*v_hd)."""
    b, t, h, hd = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, t, -1)


def swiglu(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def meta_llama_logits(sd, n_heads, n_kv_heads, tokens, eps=1e-5, theta=10000.0, scaled=False):
    """Meta / torchtitan Llama (``tok_embeddings``, ``layers.i.attention.wq``, interleaved RoPE;
    ``scaled``: Llama 3.1's use_scaled_rope, factor 8)."""
    x = sd["tok_embeddings.weight"][tokens]
    b, t, d = x.shape
    hd = d // n_heads
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    for i in range(n_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"], eps)
        q = rope_interleaved(F.linear(h, sd[p + "attention.wq.weight"]).view(b, t, n_heads, hd), theta, scaled)
        k = rope_interleaved(F.linear(h, sd[p + "attention.wk.weight"]).view(b, t, n_kv_heads, hd), theta, scaled)
        v = F.linear(h, sd[p + "attention.wv.weight"]).view(b, t, n_kv_heads, hd)
        x = x + F.linear(attend(q, k, v), sd[p + "attention.wo.weight"])
        h = rms(x, sd[p + "ffn_norm.weight"], eps)
        x = x + swiglu(h, sd[p + "feed_forward.w1.weight"], sd[p + "feed_forward.w3.weight"], sd[p + "feed_forward.w2.weight"])
    return F.linear(rms(x, sd["norm.weight"], eps), sd["output.weight"])


def megatron_gpt_logits(sd, n_heads, n_kv_heads, tokens, eps=1e-5, theta=10000.0):
    """Megatron-core GPT (Llama-style): fused grouped-query ``linear_qkv`` (per group
    [q heads; k; v]), ``linear_fc1`` = [gate; up], TE's fused ``layer_norm_weight``, half RoPE."""
    x = sd["embedding.word_embeddings.weight"][tokens]
    b, t, d = x.shape
    g = n_kv_heads
    n_layers = len({k.split(".")[2] for k in sd if k.startswith("decoder.layers.")})
    for i in range(n_layers):
        p = f"decoder.layers.{i}."
        h = rms(x, sd[p + "self_attention.linear_qkv.layer_norm_weight"], eps)
        qkv = F.linear(h, sd[p + "self_attention.linear_qkv.weight"])  # (B, T, (H + 2G) * hd)
        hd = qkv.shape[-1] // (n_heads + 2 * g)
        blocks = qkv.view(b, t, g, n_heads // g + 2, hd)
        q = rope_half(blocks[:, :, :, : n_heads // g].reshape(b, t, n_heads, hd), theta)
        k = rope_half(blocks[:, :, :, n_heads // g], theta)
        v = blocks[:, :, :, n_heads // g + 1]
        x = x + F.linear(attend(q, k, v), sd[p + "self_attention.linear_proj.weight"])
        h = rms(x, sd[p + "mlp.linear_fc1.layer_norm_weight"], eps)
        gate, up = F.linear(h, sd[p + "mlp.linear_fc1.weight"]).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, sd[p + "mlp.linear_fc2.weight"])
    return F.linear(rms(x, sd["decoder.final_layernorm.weight"], eps), sd["output_layer.weight"])


def torchtitan_qwen3_moe_logits(sd, n_heads, n_kv_heads, top_k, tokens, eps=1e-6, theta=10000.0, norm_topk=True):
    """torchtitan Qwen3 MoE: q/k RMSNorm per head, half RoPE, softmax top-k router
    (``moe.router.gate``), stacked experts ``moe.experts.w1/w3`` [E, F, D], ``w2`` [E, D, F]."""
    x = sd["tok_embeddings.weight"][tokens]
    b, t, d = x.shape
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    for i in range(n_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"], eps)
        hd = sd[p + "attention.q_norm.weight"].shape[0]
        q = F.linear(h, sd[p + "attention.wq.weight"]).view(b, t, n_heads, hd)
        k = F.linear(h, sd[p + "attention.wk.weight"]).view(b, t, n_kv_heads, hd)
        q = rope_half(rms(q, sd[p + "attention.q_norm.weight"], eps), theta)
        k = rope_half(rms(k, sd[p + "attention.k_norm.weight"], eps), theta)
        v = F.linear(h, sd[p + "attention.wv.weight"]).view(b, t, n_kv_heads, hd)
        x = x + F.linear(attend(q, k, v), sd[p + "attention.wo.weight"])
        h = rms(x, sd[p + "ffn_norm.weight"], eps).reshape(b * t, d)
        probs = F.linear(h, sd[p + "moe.router.gate.weight"]).softmax(-1)
        w, idx = probs.topk(top_k, -1)
        if norm_topk:
            w = w / w.sum(-1, keepdim=True)
        x = x + routed_experts(sd, p, h, w, idx).view(b, t, d)
    return F.linear(rms(x, sd["norm.weight"], eps), sd["output.weight"])


def routed_experts(sd, p, h, w, idx):
    """Stacked experts ``{p}moe.experts.w1/w3`` [E, F, D], ``w2`` [E, D, F] on tokens h (N, D):
    each expert's SwiGLU on the tokens routed to it (idx (N, K)), times its weight w (N, K), summed."""
    out = torch.zeros_like(h)
    w1, w3, w2 = (sd[p + f"moe.experts.{n}"] for n in ("w1", "w3", "w2"))
    for e in range(w1.shape[0]):
        tok, j = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, w[tok, j, None] * swiglu(h[tok], w1[e], w3[e], w2[e]))
    return out


def deepseek_v3_route(logits, bias, top_k, n_group, topk_group, route_scale, norm_topk=True):
    """DeepSeek-V3 routing (torchtitan ``TokenChoiceTopKRouter`` with ``score_func="sigmoid"``):
    sigmoid scores; ``bias`` (expert_bias) added for the choice only; the ``topk_group`` groups with
    the largest sum of their top-2 biased scores kept; top-k of those; weights are the unbiased
    scores, renormalised (+1e-20) when ``norm_topk``, times ``route_scale``. -> weights, ids (N, K)."""
    scores = logits.sigmoid()
    choice = scores + bias
    grouped = choice.unflatten(-1, (n_group, -1))
    keep = grouped.topk(2, -1).values.sum(-1).topk(topk_group, -1).indices
    mask = torch.ones(grouped.shape[:2], dtype=torch.bool).scatter_(-1, keep, False)
    idx = grouped.masked_fill(mask[..., None], float("-inf")).flatten(-2).topk(top_k, -1).indices
    w = scores.gather(-1, idx)
    if norm_topk:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * route_scale, idx


def deepseek_v3_torchtitan_logits(sd, n_heads, rope_dim, top_k, n_group, topk_group, route_scale, tokens,
                                  norm_topk=True, eps=1e-6, theta=10000.0):  # fmt: skip
    """torchtitan DeepSeek-V3 (``torchtitan/models/deepseek_v3/model.py`` ``Attention``, b5bcd76):
    multi-head latent attention with ``wq`` or ``wq_a`` -> ``q_norm`` -> ``wq_b``; ``wkv_a`` gives
    the compressed kv (``kv_norm``, then ``wkv_b`` -> per head [k_nope; v]) and one shared k_pe;
    RoPE (``ComplexRoPE``: adjacent pairs) on the last ``rope_dim`` of each q head and on k_pe;
    softmax scale 1/sqrt(qk_head_dim) (no YaRN). Layers without ``moe.*`` keys are dense
    (``feed_forward``); MoE layers route by :func:`deepseek_v3_route` and add the shared experts."""
    x = sd["tok_embeddings.weight"][tokens]
    b, t, d = x.shape
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    for i in range(n_layers):
        p = f"layers.{i}.attention."
        h = rms(x, sd[f"layers.{i}.attention_norm.weight"], eps)
        if p + "wq.weight" in sd:
            q = F.linear(h, sd[p + "wq.weight"])
        else:
            q = F.linear(rms(F.linear(h, sd[p + "wq_a.weight"]), sd[p + "q_norm.weight"], eps), sd[p + "wq_b.weight"])
        q = q.view(b, t, n_heads, -1)
        q = torch.cat([q[..., :-rope_dim], rope_interleaved(q[..., -rope_dim:], theta)], -1)
        kv_rank = sd[p + "kv_norm.weight"].shape[0]
        ckv, k_pe = F.linear(h, sd[p + "wkv_a.weight"]).split([kv_rank, rope_dim], -1)
        k_pe = rope_interleaved(k_pe[:, :, None, :], theta)  # one head, shared by all
        kv = F.linear(rms(ckv, sd[p + "kv_norm.weight"], eps), sd[p + "wkv_b.weight"]).view(b, t, n_heads, -1)
        nope = q.shape[-1] - rope_dim
        k = torch.cat([kv[..., :nope], k_pe.expand(b, t, n_heads, rope_dim)], -1)
        x = x + F.linear(attend(q, k, kv[..., nope:]), sd[p + "wo.weight"])
        p = f"layers.{i}."
        h = rms(x, sd[p + "ffn_norm.weight"], eps)
        if p + "moe.router.gate.weight" not in sd:
            x = x + swiglu(h, *(sd[p + f"feed_forward.{n}.weight"] for n in ("w1", "w3", "w2")))
            continue
        h = h.reshape(b * t, d)
        w, idx = deepseek_v3_route(F.linear(h, sd[p + "moe.router.gate.weight"]), sd[p + "moe.expert_bias"],
                                   top_k, n_group, topk_group, route_scale, norm_topk)  # fmt: skip
        shared = swiglu(h, *(sd[p + f"moe.shared_experts.{n}.weight"] for n in ("w1", "w3", "w2")))
        x = x + (routed_experts(sd, p, h, w, idx) + shared).view(b, t, d)
    return F.linear(rms(x, sd["norm.weight"], eps), sd["output.weight"])


def gpt2_linear_logits(sd, n_heads, tokens, eps=1e-5):
    """GPT-2 with ``nn.Linear`` (out, in) weights: ``y = x @ W.T + b``; lm_head tied to wte."""
    pre = "transformer."
    t = tokens.shape[1]
    x = sd[pre + "wte.weight"][tokens] + sd[pre + "wpe.weight"][:t]
    b, _, d = x.shape
    hd = d // n_heads
    n_layers = len({k.split(".")[2] for k in sd if k.startswith(pre + "h.")})
    for i in range(n_layers):
        p = f"{pre}h.{i}."
        h = F.layer_norm(x, (d,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        q, k, v = F.linear(h, sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]).split(d, -1)
        a = attend(*(z.view(b, t, n_heads, hd) for z in (q, k, v)))
        x = x + F.linear(a, sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, (d,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        h = F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (d,), sd[pre + "ln_f.weight"], sd[pre + "ln_f.bias"], eps)
    return F.linear(x, sd.get("lm_head.weight", sd[pre + "wte.weight"]))


def greedy(logits_fn, prompt, steps=20):
    """Greedy decoding by full forwards: the ``steps`` token ids appended to ``prompt`` (1, T)."""
    ids = prompt
    for _ in range(steps):
        nxt = logits_fn(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids[0, prompt.shape[1] :].tolist()


# torchtitan's names today (pytorch/torchtitan b5bcd76, torchtitan/models/{llama3,qwen3,deepseek_v3}/
# state_dict_adapter.py from_hf_map) -> the legacy names the reference forwards above read. Written
# from the adapters, not from fqnckpt's layout table: the oracle of the versioned recipes.
TITAN_TODAY_TO_LEGACY = (
    (r"^lm_head\.weight$", "output.weight"),
    (r"\.attention\.qkv_linear\.(w[qkv])\.weight$", r".attention.\1.weight"),
    (r"\.moe\.routed_experts\.inner_experts\.(w[13])_EFD$", r".moe.experts.\1"),
    (r"\.moe\.routed_experts\.inner_experts\.w2_EDF$", ".moe.experts.w2"),
    (r"\.moe\.expert_bias_E$", ".moe.expert_bias"),
)


def titan_legacy(sd: dict) -> dict:
    """A torchtitan state dict in today's names, renamed to the legacy ones (values shared)."""
    import re

    out = {}
    for k, v in sd.items():
        for pat, rep in TITAN_TODAY_TO_LEGACY:
            k = re.sub(pat, rep, k)
        out[k] = v
    return out
