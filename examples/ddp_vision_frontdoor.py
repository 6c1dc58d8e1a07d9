# torchrun --standalone --nproc_per_node=2 examples/ddp_vision_frontdoor.py --epochs 2
"""examples/ddp_vision.py through gradsync's DDP-shaped front door (bsp: bit for bit). It is: a
DataLoader with a DistributedSampler, a CNN with BatchNorm, SGD with Nesterov momentum and
weight decay, a OneCycle schedule, label smoothing, gradient accumulation with no_sync, a
GradScaler, gradient clipping, evaluation and checkpoints on rank 0. The images are synthetic
(each class a noisy pattern of its own), so the script needs no download.
examples/ddp_vision_gradsync.py is the same script ported to gradsync.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gradsync import DistributedDataParallel as DDP

CLASSES = 10


def synthetic_images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(CLASSES, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 3, 16, 16, generator=g)
    return TensorDataset(images, labels)


def small_cnn() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(block(3, 16), block(16, 32), nn.Flatten(), nn.Linear(32 * 4 * 4, CLASSES))


def evaluate(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        images, labels = data.tensors
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    model.train()
    return accuracy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per micro-batch, per rank")
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--train-size", type=int, default=512)
    p.add_argument("--out", default="ddp_vision_out")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train = synthetic_images(args.train_size, seed=1)
    val = synthetic_images(256, seed=2)
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accumulation

    model = small_cnn()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16 needs a GPU; kept for the port
    model = DDP(model, optimizer=optimizer)  # gradsync's: steps through the optimizer
    raw_model = model.module

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(steps_per_epoch):
            for micro in range(args.accumulation):
                last = micro == args.accumulation - 1
                with nullcontext() if last else model.no_sync():
                    images, labels = next(batches)
                    loss = criterion(model(images), labels)
                    scaler.scale(loss / args.accumulation).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if rank == 0:
            accuracy = evaluate(raw_model, val)
            print(f"epoch {epoch + 1} loss {loss.item():.4f} val accuracy {accuracy:.3f}")
            torch.save(raw_model.state_dict(), out / "checkpoint.pt")
    if rank == 0:
        torch.save(raw_model.state_dict(), out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
