"""``charlm``: a small GPT-style character-level transformer on real text."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.workloads.base import check_slice, parse_dtype, step_generator
from gradsync.workloads.data import VOCAB, load_text


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        logits = self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))
        # A Linear on (batch, context, dim) returns a view of its 2-D product, which FSDP2
        # (zero:3) warns of on every rank when a wrapped module returns one; a copy of the
        # logits (batch x context x 65 floats) is not a view, and has the same bits.
        return logits.clone()


class CharLM:
    name = "charlm"
    default_lr = 3e-3

    def __init__(
        self,
        *,
        seed: int = 0,
        data: str | None = None,
        dtype: str = "float32",
        context: int = 64,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
    ) -> None:
        self.seed = seed
        self.dtype = parse_dtype(dtype)
        self.context = context
        self.dim, self.layers, self.heads = dim, layers, heads
        self.tokens = load_text(data)

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        model = TinyGPT(VOCAB, self.context, self.dim, self.layers, self.heads)
        return model.to(self.dtype)

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def batch(
        self, step: int, global_batch: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_slice(global_batch, start, stop)
        g = step_generator(self.seed, step)
        high = self.tokens.numel() - self.context - 1
        starts = torch.randint(0, high, (global_batch,), generator=g)[start:stop]
        idx = starts[:, None] + torch.arange(self.context + 1)
        window = self.tokens[idx]
        return window[:, :-1], window[:, 1:]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
