"""Fine-tune an unmodified Hugging Face model with a plain PyTorch loop, on local processes.

    autopar run examples/hf_finetune.py --nproc 4 -- --steps 40
    torchrun --nproc-per-node 4 examples/hf_finetune.py --family qwen2 --degrees pp=2,dp=2

The model is ``AutoModelForCausalLM.from_config`` (no hub access needed), as it comes. The two
lines that make it parallel are ``autopar.parallelize(model, world)`` and building the optimizer
over ``pmodel.parameters()``; the rest is the loop a single process runs, on the same batches:
every rank iterates the same loader (the GLOBAL batch) and autopar keeps each rank's share;
with ``--local-batches`` each rank's loader draws its own share instead, with the data-parallel
rank and size autopar gives (``DistributedSampler(num_replicas=pmodel.dp_size, rank=pmodel.dp_rank)``).

The task is synthetic but learnable: arithmetic token sequences, left-padded to random lengths
with an ``attention_mask`` (as a tokenizer pads a batch) and ``labels`` of -100 on the padding.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar
from autopar.runtime import finish, init_from_env

sys.path.insert(0, str(Path(__file__).parent))
import hf  # noqa: E402


def arithmetic_dataset(size: int, seq: int, vocab: int) -> TensorDataset:
    """Sequences start + i·stride (mod vocab), each left-padded to a random length of at least seq/2."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    stride = torch.randint(1, 8, (size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq)) % vocab
    pad = torch.randint(0, seq // 2, (size, 1), generator=generator)
    mask = (torch.arange(seq) >= pad).long()
    return TensorDataset(tokens * mask, mask, torch.where(mask.bool(), tokens, -100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=["llama", "qwen2", "gpt2", "mixtral"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--degrees", default="", help="pin the split, e.g. pp=2,dp=2 (default: autopar's plan)")
    parser.add_argument("--local-batches", action="store_true", help="each rank loads its own share")
    args = parser.parse_args()

    init_from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = hf.from_config(args.family, hidden=128, layers=4, heads=4, kv_heads=2, ffn=256, vocab=256, seq=args.seq)
    degrees = {key: int(value) for key, value in (pin.split("=") for pin in args.degrees.split(",") if pin)}

    pmodel = autopar.parallelize(
        model, world, local_batches=args.local_batches, **({"degrees": degrees} if degrees else {})
    )
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)

    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    data = arithmetic_dataset(args.batch * args.steps, args.seq, 256)
    if args.local_batches:  # this rank's share of every global batch
        sampler = DistributedSampler(data, num_replicas=pmodel.dp_size, rank=pmodel.dp_rank, shuffle=False)
        loader = DataLoader(data, batch_size=args.batch // pmodel.dp_size, sampler=sampler)
    else:  # the same global batches on every rank
        loader = DataLoader(data, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    if rank == 0:
        print(pmodel.plan, flush=True)
    for step, (input_ids, attention_mask, labels) in enumerate(loader):
        started = time.perf_counter()
        out = pmodel(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()
        pmodel.clip_grad_norm_(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(
                f"step {step:3d}  loss {out.loss.item():.4f}  {1e3 * (time.perf_counter() - started):.0f} ms",
                flush=True,
            )
    finish()


if __name__ == "__main__":
    main()
