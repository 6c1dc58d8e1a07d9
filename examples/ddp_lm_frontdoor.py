# torchrun --standalone --nproc_per_node=2 examples/ddp_lm_frontdoor.py --steps 40
"""examples/ddp_lm.py through gradsync's DDP-shaped front door (bsp: bit for bit). The original:
gradient accumulation with no_sync, a GradScaler, gradient clipping, linear warmup then cosine
decay set on the param groups, AdamW with and without weight decay, evaluation and checkpoints
on rank 0. examples/ddp_lm_gradsync.py is the same script ported to gradsync;
`diff examples/ddp_lm.py examples/ddp_lm_gradsync.py` shows every line the port changes.
"""

from __future__ import annotations

import argparse
import math
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync import DistributedDataParallel as DDP

TEXT = Path(torch.__file__).read_text()  # any text will do; this one ships with torch
VOCAB = 128


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(dim, VOCAB)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        return self.head(self.blocks(x, mask=self.mask[: idx.shape[1], : idx.shape[1]]))


def get_batch(split: str, step: int, rank: int, args: argparse.Namespace) -> tuple:
    data = torch.tensor([min(ord(c), VOCAB - 1) for c in TEXT], dtype=torch.long)
    data = data[: len(data) * 9 // 10] if split == "train" else data[len(data) * 9 // 10 :]
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(len(data) - args.context - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[s : s + args.context] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + args.context] for s in starts])
    return x, y


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="per micro-batch, per rank")
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", default="ddp_lm_out")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1337)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = TinyLM(context=args.context)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16 needs a GPU; kept for the port
    model = DDP(model, optimizer=optimizer)  # gradsync's: steps through the optimizer
    raw_model = model.module

    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        for micro in range(args.accumulation):
            last = micro == args.accumulation - 1
            with nullcontext() if last else model.no_sync():
                x, y = get_batch("train", step * args.accumulation + micro, rank, args)
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
                scaler.scale(loss / args.accumulation).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step + 1) % args.eval_every == 0:
            raw_model.eval()
            with torch.no_grad():
                x, y = get_batch("val", step, 0, args)
                val = nn.functional.cross_entropy(raw_model(x).view(-1, VOCAB), y.view(-1))
            raw_model.train()
            print(f"step {step + 1} train loss {loss.item():.4f} val loss {val.item():.4f}")
            torch.save(raw_model.state_dict(), out / "checkpoint.pt")
    if rank == 0:
        torch.save(raw_model.state_dict(), out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
