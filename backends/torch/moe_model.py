"""A small decoder-only MoE transformer, split into pipeline stages, in plain PyTorch.

Every stage is one block (causal self-attention, then a mixture of experts: a router picks
``top_k`` of ``experts`` MLPs per token); the first stage embeds the tokens, the last one
ends with the final norm, the LM head and gives logits. With ``experts=0`` the block's MLP
is dense.

A stage exposes the four MoE pieces of DeepSeek-V3's chunk split (arXiv 2412.19437, §3.2.1)
as methods, for ``schedc_torch_runtime.MoEParts.methods()``:

* ``attn(x)``: (embedding,) attention, the router: ``(x1, h, weights, experts)``;
* ``dispatch(x1, h, weights, experts)``: the token copies sorted by expert (the
  expert-parallel all-to-all's permutation; local here);
* ``mlp(...)``: every expert on its tokens;
* ``combine(...)``: the weighted sum back in token order, the residual (, norm and head).

``forward(x) == combine(*mlp(*dispatch(*attn(x))))``. The model is deterministic from a seed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    """Sizes: ``vocab`` tokens, ``dim`` hidden, ``heads`` attention heads, ``seq`` tokens per
    sequence, ``experts`` routed experts (0: a dense MLP) of hidden size ``expert_dim``,
    ``top_k`` experts per token."""

    vocab: int = 32
    dim: int = 16
    heads: int = 2
    seq: int = 8
    experts: int = 4
    top_k: int = 2
    expert_dim: int = 32


class Stage(nn.Module):
    """Stage ``index`` of ``n`` (see the module docs)."""

    def __init__(self, cfg: Config, index: int, n: int):
        super().__init__()
        self.cfg, self.first, self.last = cfg, index == 0, index == n - 1
        d = cfg.dim
        if self.first:
            self.embed = nn.Embedding(cfg.vocab, d)
            self.pos = nn.Parameter(0.02 * torch.randn(cfg.seq, d))
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        if cfg.experts:
            self.router = nn.Linear(d, cfg.experts, bias=False)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(d, cfg.expert_dim), nn.GELU(), nn.Linear(cfg.expert_dim, d))
                for _ in range(cfg.experts)
            )
        else:
            self.mlp_dense = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        if self.last:
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, cfg.vocab)

    # -- the four pieces --------------------------------------------------------------------

    def attn(self, x: torch.Tensor):
        if self.first:
            x = self.embed(x) + self.pos[: x.shape[1]]
        b, t, d = x.shape
        nh = self.cfg.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.reshape(b, t, nh, d // nh).transpose(1, 2) for y in (q, k, v))
        a = (q @ k.transpose(-2, -1)) / math.sqrt(d // nh)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        a = a.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x1 = x + self.proj((a @ v).transpose(1, 2).reshape(b, t, d))
        h = self.ln2(x1)
        if not self.cfg.experts:
            return x1, h
        probs = self.router(h).softmax(dim=-1)
        weights, chosen = probs.topk(self.cfg.top_k, dim=-1)
        return x1, h, weights / weights.sum(dim=-1, keepdim=True), chosen

    def dispatch(self, x1, h, weights=None, chosen=None):
        if not self.cfg.experts:
            return x1, h
        k = self.cfg.top_k
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = h.reshape(-1, h.shape[-1]).repeat_interleave(k, dim=0)[order]
        counts = torch.bincount(flat, minlength=self.cfg.experts)
        return x1, tokens, weights, order, counts

    def mlp(self, x1, tokens, weights=None, order=None, counts=None):
        if not self.cfg.experts:
            return x1, self.mlp_dense(tokens)
        parts = tokens.split(counts.tolist())
        out = torch.cat([e(p) for e, p in zip(self.experts, parts)])
        return x1, out, weights, order

    def combine(self, x1, out, weights=None, order=None):
        if self.cfg.experts:
            k = self.cfg.top_k
            back = torch.empty_like(out).index_copy(0, order, out)
            b, t, d = x1.shape
            out = (back.reshape(b, t, k, d) * weights.unsqueeze(-1)).sum(dim=2)
        y = x1 + out
        return self.head(self.norm(y)) if self.last else y

    def forward(self, x):
        return self.combine(*self.mlp(*self.dispatch(*self.attn(x))))


def build(cfg: Config, n_stages: int, seed: int, dtype=torch.float64) -> list[Stage]:
    """The ``n_stages`` stages of one model, deterministic from ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [Stage(cfg, s, n_stages).to(dtype) for s in range(n_stages)]


def maker(cfg: Config, n_stages: int, seed: int, dtype=torch.float64):
    """``make_stage(model_stage)`` for the runtime: a fresh copy of that stage of the model
    ``build`` gives (so every rank, and both DualPipe copies, start equal)."""
    stages = build(cfg, n_stages, seed, dtype)
    return lambda s: copy.deepcopy(stages[s])


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(cfg: Config, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random sequences: (tokens, next tokens)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab, (rows, cfg.seq + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
