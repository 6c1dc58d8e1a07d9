"""The frontier's held-out model (issue 46): a transformer no benchmark had used, written for
this, so that the low-bandwidth frontier is also measured on a model the strategies were not
tuned on (``benchmarks.frontier``'s setting ``heldout2``, ``--workload heldout`` of
``benchmarks.cluster_worker``).

**The model** is a small decoder written by hand in the style of LLaMA rather than GPT-2:
pre-norm with RMSNorm (no LayerNorm, no biases anywhere), rotary position embeddings on the
queries and keys (no learned position table), a SwiGLU feed-forward, causal attention through
``scaled_dot_product_attention``, and the output head tied to the token embedding. Chosen so
that it shares no part with gradsync's ``charlm`` (learned positions, LayerNorm, GELU MLP,
biases, an untied head) nor with ``benchmarks/heldout.py``'s ``nn.TransformerEncoder``; and its
own optimizer: AdamW at lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on the matrices only
(charlm: lr 3e-3, 0.01 on everything). There is no warm-up (a workload's optimizer has no
schedule), and in a probe of 150 steps on one process lr 2e-3 to 1e-2 learned more slowly than
1e-3 (5e-4 about as fast). Size: 4 blocks of width 160 (5 heads of 32), SwiGLU width 432,
1.26M parameters, a 5 MB gradient in float32: at the frontier's batch (8 sequences of 64 tokens
over 2 ranks) one step took 40 ms on one CPU thread of the 2-core machine, about what sending
its gradient once over a 1 Gbit/s link takes, so the link matters as it does for the mlp.

**The data** is a deterministic synthetic language, not text: ``TOPICS`` dialects over a
``VOCAB``-token alphabet, each a fixed random sparse Markov chain (from every token,
``SUCCESSORS`` possible next tokens, drawn in proportion to a Zipf popularity of the tokens,
their weights from a flat Dirichlet); every sequence is drawn in one dialect, chosen at random,
from a uniform first token. Nothing to load or ship, every batch a function of (seed, step) as
the built-in workloads', and the language (fixed, not the seed's) has a known loss floor: the
Bayes-optimal next-token loss, which knows the chains and infers the dialect from the tokens so
far (``HeldOutLM.floor``: about 1.13 nats against ln 128 = 4.85 for a uniform guess). A model
gets there only by learning the chains and by attending back over the sequence to tell the
dialects apart, which a model of one token's context cannot; charlm's text has no floor one
can compute. DDP on 2 ranks is at about 2.1 nats after 128 steps, still falling.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradsync.workloads.base import check_slice, step_generator

VOCAB = 128
TOPICS = 8  # dialects
SUCCESSORS = 4  # next tokens possible after each token, per dialect
CONTEXT = 64
ZIPF = 1.0  # exponent of the tokens' popularity when successors are drawn
LANGUAGE_SEED = 46  # the language is fixed; the workload's seed picks the model and batches
DIM, LAYERS, HEADS, HIDDEN = 160, 4, 5, 432


class Language:
    """The synthetic language: per dialect and token, ``SUCCESSORS`` next tokens and their
    probabilities (``succ``, ``cdf``), and the dense log-probabilities for the floor."""

    def __init__(self, seed: int = LANGUAGE_SEED) -> None:
        g = torch.Generator().manual_seed(seed)
        # Distinct successors per (dialect, token), drawn without replacement in proportion to
        # a Zipf popularity of the tokens (Gumbel top-k), so that some tokens are common
        # everywhere, as in a language; their weights from a flat Dirichlet.
        zipf = -torch.arange(1, VOCAB + 1, dtype=torch.float64).log() * ZIPF
        gumbel = -(-torch.rand(TOPICS, VOCAB, VOCAB, generator=g, dtype=torch.float64).log()).log()
        succ = (zipf + gumbel).topk(SUCCESSORS, dim=-1)[1]
        w = -torch.rand(TOPICS, VOCAB, SUCCESSORS, generator=g, dtype=torch.float64).log()
        p = w / w.sum(-1, keepdim=True)  # flat Dirichlet: normalized exponentials
        # flat over (dialect, token), for the sampler's one lookup a position; numpy, whose
        # small operations cost a fraction of torch's (the sampler is a loop over positions)
        self.succ = succ.reshape(TOPICS * VOCAB, SUCCESSORS).numpy()
        self.cdf = p.cumsum(-1).reshape(TOPICS * VOCAB, SUCCESSORS).numpy()
        dense = torch.zeros(TOPICS, VOCAB, VOCAB, dtype=torch.float64)
        dense.scatter_(-1, succ, p)
        self.logp = dense.log()  # -inf where a dialect never goes

    def sample(self, g: torch.Generator, n: int, length: int) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens, each in one dialect, drawn from ``g``."""
        topic = torch.randint(0, TOPICS, (n,), generator=g).numpy()
        first = torch.randint(0, VOCAB, (n,), generator=g).numpy()
        u = torch.rand(length - 1, n, 1, generator=g, dtype=torch.float64).numpy()
        out = np.empty((length, n), dtype=np.int64)
        out[0] = first
        row = topic * VOCAB
        for t in range(length - 1):
            at = row + out[t]
            k = np.minimum((u[t] > self.cdf[at]).sum(-1), SUCCESSORS - 1)
            out[t + 1] = self.succ[at, k]
        return torch.from_numpy(np.ascontiguousarray(out.T))

    def floor(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The Bayes-optimal mean cross-entropy of predicting ``y`` from ``x`` (inputs and
        targets as ``HeldOutLM.batch`` gives them): the dialect's posterior after the tokens
        so far, times its chain. ``x``'s first tokens start the sequences."""
        step = self.logp[:, x, y]  # (TOPICS, n, T): log P(y_t | x_t, dialect)
        # log-likelihood of the sequence before each target, per dialect (shifted, so that a
        # dialect that cannot have produced it stays at -inf rather than -inf - -inf)
        before = F.pad(step.cumsum(-1)[..., :-1], (1, 0))
        prior = before - torch.logsumexp(before, 0, keepdim=True)  # dialect's posterior
        return -torch.logsumexp(prior + step, 0).mean()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(context: int, head_dim: int, base: float = 10_000.0) -> torch.Tensor:
    """cos and sin of each position's rotation angle per pair of channels: (2, context, hd/2)."""
    freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angle = torch.arange(context, dtype=torch.float32)[:, None] * freq
    return torch.stack([angle.cos(), angle.sin()])


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (batch, heads, T, hd): channel pairs (i, i + hd/2) rotated."""
    cos, sin = rot[0, : x.shape[2]], rot[1, : x.shape[2]]
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)  # SwiGLU's two inputs in one
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(rotate(q, rot), rotate(k, rot), v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(
        self, vocab: int, context: int, dim: int, layers: int, heads: int, hidden: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        # Not a buffer: DDP would broadcast it before every forward, a collective the
        # built-in workloads (which have no buffers) do not pay.
        self.rot = rotary(context, dim // heads)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init: residual outputs scaled down by depth
                scale = (
                    1 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 1
                )
                nn.init.normal_(p, std=0.02 * scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        rot = self.rot.to(x.device)  # no copy on the CPU
        for block in self.blocks:
            x = block(x, rot)
        return F.linear(self.norm(x), self.embed.weight)  # the head tied to the embedding


class HeldOutLM:
    """The workload (gradsync's ``Workload`` protocol, as ``gradsync/workloads/`` define it)."""

    name = "heldout"
    default_lr = 1e-3

    def __init__(self, *, seed: int = 0, context: int = CONTEXT) -> None:
        self.seed, self.context = seed, context
        self.language = Language()

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return Decoder(VOCAB, self.context, DIM, LAYERS, HEADS, HIDDEN)

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    def batch(
        self, step: int, global_batch: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank draws the whole global batch (8 x 65 tokens: cheap) and keeps its slice,
        so any split over ranks sees the same sequences."""
        check_slice(global_batch, start, stop)
        g = step_generator(self.seed, step)
        seqs = self.language.sample(g, global_batch, self.context + 1)[start:stop]
        return seqs[:, :-1], seqs[:, 1:]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def floor(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The language's Bayes-optimal loss on this batch (``Language.floor``)."""
        return float(self.language.floor(x, y))
