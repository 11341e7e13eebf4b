"""Train the GPT example on local processes with the plan autopar finds for them.

    autopar run examples/train.py --nproc 2 -- --steps 30
    autopar run examples/train.py --nproc 2 -- --steps 30 --compile   # compiled, communication overlapped
    autopar run examples/train.py --nproc 2 -- --degrees tp=2 --compile --async-tp   # TP matmuls in pieces
    autopar run examples/train.py --nproc 2 -- --plan ckpt/step-00000010/plan.json   # a saved plan, no search
    torchrun --nproc-per-node 2 examples/train.py --steps 30
    autopar run examples/train.py --nproc 4 --max-restarts 3 -- --checkpoint-dir ckpt --checkpoint-every 10
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train.py --checkpoint-dir ckpt --checkpoint-every 10

Every rank builds the same model (same seed), autopar plans it for the world it finds, and
each step feeds every rank its slice of the same global batch. The task is synthetic but
learnable: arithmetic sequences of tokens, so the loss falls as the model trains.

With ``--checkpoint-dir`` the script resumes by itself from the newest checkpoint there: after
a restart (a rank died; the launcher started all ranks again) it continues from the saved step,
with the saved plan; started on another number of ranks it plans for them and loads the same
checkpoint into the new plan. The batch of step s depends only on s, so the data position is
the step counter.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.cli.arguments import parse_degrees
from autopar.runtime import Checkpointer, finish, init_from_env

sys.path.insert(0, str(Path(__file__).parent))
import gpt  # noqa: E402


def arithmetic_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences start + i·stride (mod vocab); the label of each token is the next one."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this global norm (0: never)")
    parser.add_argument("--degrees", type=parse_degrees, help="pin parallel sizes, e.g. pp=2 (default: searched)")
    parser.add_argument("--plan", help="train with this saved plan (a checkpoint's plan.json)")
    parser.add_argument("--compile", action="store_true", help="run the per-rank program through torch.compile")
    parser.add_argument(
        "--async-tp",
        action="store_true",
        help="tensor-parallel matmuls in pieces with their collectives (implies --compile)",
    )
    parser.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here, and resume from the newest one")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--checkpoint-keep", type=int, default=2, help="how many of the newest checkpoints to keep")
    args = parser.parse_args()

    init_from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt.build(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, seq=args.seq)
    example = arithmetic_batch(0, args.batch, args.seq, args.vocab)
    checkpointer = None
    if args.checkpoint_dir:
        checkpointer = Checkpointer(args.checkpoint_dir, every=args.checkpoint_every, keep=args.checkpoint_keep)
    plan = (checkpointer and checkpointer.plan(world)) or args.plan  # a restart keeps its checkpoint's plan
    pins = {"degrees": args.degrees} if args.degrees and plan is None else {}
    pmodel = autopar.parallelize(
        model, world, example, plan=plan, compile=args.compile or args.async_tp, async_tp=args.async_tp, **pins
    )
    if rank == 0:
        print(pmodel.plan, flush=True)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    start = checkpointer.resume(pmodel, optimizer) if checkpointer else 0
    if rank == 0 and start:
        print(f"resumed from step {start} on {world} ranks", flush=True)
    for step in range(start, args.steps):
        started = time.perf_counter()
        batch = pmodel.shard_batch(*arithmetic_batch(step, args.batch, args.seq, args.vocab))
        loss = pmodel.train_step(*batch)
        if args.max_norm:
            pmodel.clip_grad_norm_(args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            what = " (compiling)" if args.compile and step == 0 else ""
            elapsed_ms = 1e3 * (time.perf_counter() - started)
            print(f"step {step:3d}  loss {loss.item():.6g}  {elapsed_ms:.0f} ms{what}", flush=True)
        if checkpointer:
            checkpointer.maybe_save(step + 1, pmodel, optimizer)
    finish()


if __name__ == "__main__":
    main()
