"""Reference forwards for layouts whose model code is not installed (Meta / torchtitan Llama,
torchtitan Qwen3 MoE, Megatron GPT, GPT-2 with nn.Linear weights), written from the formulas in
../shared/reference/conversions.md, independent of checkpoint.convert. float32, no cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _angles(t: int, hd: int, theta: float):
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.outer(torch.arange(t).float(), freqs)  # (T, hd/2)
    return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]


def rope_interleaved(x, theta):
    """Meta / torchtitan Llama: rotate pairs (x[2j], x[2j+1]); x is (B, T, H, hd)."""
    cos, sin = _angles(x.shape[1], x.shape[-1], theta)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)


def rope_half(x, theta):
    """HF / Megatron / Qwen3: rotate halves (x[j], x[j + hd/2])."""
    cos, sin = _angles(x.shape[1], x.shape[-1], theta)
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)


def attend(q, k, v):
    """Causal grouped-query attention; q (B, T, H, hd), k / v (B, T, G, hd) -> (B, T, H*hd)."""
    b, t, h, hd = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, t, h * hd)


def swiglu(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def meta_llama_logits(sd, n_heads, n_kv_heads, tokens, eps=1e-5, theta=10000.0):
    """Meta / torchtitan Llama (``tok_embeddings``, ``layers.i.attention.wq``, interleaved RoPE)."""
    x = sd["tok_embeddings.weight"][tokens]
    b, t, d = x.shape
    hd = d // n_heads
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    for i in range(n_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"], eps)
        q = rope_interleaved(F.linear(h, sd[p + "attention.wq.weight"]).view(b, t, n_heads, hd), theta)
        k = rope_interleaved(F.linear(h, sd[p + "attention.wk.weight"]).view(b, t, n_kv_heads, hd), theta)
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
        out = torch.zeros_like(h)
        w1, w3, w2 = (sd[p + f"moe.experts.{n}"] for n in ("w1", "w3", "w2"))
        for e in range(w1.shape[0]):  # each expert on the tokens routed to it, weighted
            tok, j = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, w[tok, j, None] * swiglu(h[tok], w1[e], w3[e], w2[e]))
        x = x + out.view(b, t, d)
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
