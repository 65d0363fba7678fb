"""Tiny shared models for tests: a Llama-style transformer small enough for CPU multi-rank runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class TinyConfig:
    """Sizes of `TinyTransformer` (counts, not bytes)."""

    vocab: int = 32
    dim: int = 16
    n_heads: int = 2
    n_layers: int = 2
    ffn: int = 32
    seq: int = 8


def rope_tables(head_dim: int, seq: int, device=None) -> torch.Tensor:
    """RoPE (cos, sin) table, float32 of shape [seq, head_dim // 2, 2]; deterministic (arange based)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x [b, s, h, head_dim] by table [s, head_dim // 2, 2]."""
    b, s, h, d = x.shape
    xr = x.reshape(b, s, h, d // 2, 2)
    cos = table[:s, :, 0].reshape(1, s, 1, d // 2).to(x.dtype)
    sin = table[:s, :, 1].reshape(1, s, 1, d // 2).to(x.dtype)
    x0, x1 = xr[..., 0], xr[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).reshape(b, s, h, d)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; weight [dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE; wq/wk/wv/wo are bias-free [dim, dim] linears."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), table)
        k = apply_rope(self.wk(x).view(b, s, self.n_heads, self.head_dim), table)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / self.head_dim**0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)

    def init_weights(self, std: float = 0.02) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=std)


class MLP(nn.Module):
    """SwiGLU MLP: w1/w3 [ffn, dim], w2 [dim, ffn]."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    """Pre-norm block; the attention runs under non-reentrant activation checkpointing."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = MLP(cfg)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + checkpoint(self.attention, self.attention_norm(x), table, use_reentrant=False)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights()
        self.feed_forward.init_weights()


class TinyTransformer(nn.Module):
    """Llama-style transformer: tokens LongTensor[b, s] -> logits float[b, s, vocab].

    The output head is tied to the token embedding (one tensor, two FQNs). The RoPE table
    `freqs_cis` is a non-persistent buffer, recomputed by `init_weights`, so the model can be built
    on the meta device and materialized with `to_empty` + `init_weights`.
    """

    def __init__(self, cfg: TinyConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", rope_tables(cfg.dim // cfg.n_heads, cfg.seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))

    def init_weights(self) -> None:
        """Single-device init: normal embedding, per-layer init, ones for norms, RoPE recomputed."""
        with torch.no_grad():
            self.freqs_cis.copy_(
                rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.seq, device=self.freqs_cis.device)
            )
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers:
            layer.init_weights()
        self.norm.init_weights()


class Base(nn.Module):
    """A base model: its checkpoint goes into ``WithHead`` under the ``backbone.`` prefix."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layer = nn.Linear(4, 4)


class WithHead(nn.Module):
    """``Base`` under ``backbone`` plus a classifier head (Hugging Face's ``base_model_prefix``)."""

    base_model_prefix = "backbone"

    def __init__(self):
        super().__init__()
        self.backbone = Base()
        self.classifier = nn.Linear(4, 3)


# -- small transformers models with the library's defaults (sdpa attention) -------------------------
# Dropout is 0 so the parallel module and eager draw no random masks; use_cache=False because a
# KV cache is not a tensor output (capture refuses it, naming this fix).


def hf_llama(vocab: int = 64, hidden: int = 32, layers: int = 1, **overrides):
    """``LlamaForCausalLM``: 4 heads, 2 KV heads (GQA), untied head, default attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides}))


def hf_bert(vocab: int = 64, hidden: int = 32, layers: int = 1):
    """``BertModel`` (with pooler): 4 heads, default attention, no dropout."""
    from transformers import BertConfig, BertModel

    return BertModel(
        BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def hf_gpt2(vocab: int = 64, hidden: int = 32, layers: int = 1):
    """``GPT2LMHeadModel`` (head tied to the token embedding): 4 heads, default attention, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def hf_qwen3_moe(vocab: int = 64, hidden: int = 32, layers: int = 1):
    """``Qwen3MoeForCausalLM``: the library's default config (routing, attention) apart from small
    sizes (4 experts, 2 per token) and ``use_cache=False``. Its MoE block branches on the device
    (``histc`` on CPU), so a graph captured on meta tensors would not run on CPU."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            use_cache=False,
        )
    )
