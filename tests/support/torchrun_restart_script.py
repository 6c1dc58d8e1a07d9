"""A script for plain ``torchrun --max-restarts 1``: ``gs.init()``, one all-reduce, and rank 1 of
the first attempt dies; the restarted attempt's ranks say so once their all-reduce is done."""

import os

import torch
import torch.distributed as dist

import gradsync as gs

gs.init()
total = torch.ones(1)
dist.all_reduce(total)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0" and os.environ["RANK"] == "1":
    os._exit(9)
dist.barrier()
print(f"attempt {attempt} rank {os.environ['RANK']} summed {total.item():.0f}", flush=True)
dist.destroy_process_group()
