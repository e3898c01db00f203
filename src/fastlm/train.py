"""`python -m fastlm.train`: train the language model on one or many processes.

    torchrun --nproc-per-node 4 -m fastlm.train --preset xl --parallel bucketed --bucket-mb 25
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m fastlm.train ...

Data parallelism: every rank holds the model and takes its slice of each global batch; the global
batch of step s is drawn from a generator seeded by (seed, s), so a run's data does not depend on
the number of ranks and a resumed run sees exactly the batches it would have seen. `--parallel`:
none (one process), naive / flat (`allreduce_gradients` after backward, per parameter / flattened),
ddp / bucketed (fastlm's overlapping wrappers), torch-ddp (PyTorch's DistributedDataParallel),
fsdp (PyTorch's FSDP2 `fully_shard`, per block and the root: parameters, gradients and optimizer
state sharded, for models that do not fit one GPU). `--shard-optimizer` wraps AdamW in
`ShardedOptimizer`. Checkpoints (`--checkpoint PATH`) are written by rank 0 to a temporary file
and renamed over PATH, so a crash never leaves a torn file; `--resume` continues from PATH exactly.

Tokens are synthetic (uniform ids, next-token targets): this entry point measures and checks the
parallel machinery; `fastlm train ar` and the text-corpus trainer are about what the model learns.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fastlm.distributed import DDP, BucketedDDP, ShardedOptimizer, allreduce_gradients
from fastlm.distributed.launch import exit_process
from fastlm.model import PRESETS, ModelConfig, TransformerLM

PARALLEL = ("none", "naive", "flat", "ddp", "bucketed", "torch-ddp", "fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastlm.train", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=10, help="train until this many steps are done")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--parallel", choices=PARALLEL, default="none")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--shard-optimizer", action="store_true")
    p.add_argument(
        "--checkpoint", type=Path, default=None, help="written every --checkpoint-every steps and at the end"
    )
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="a collective that waits longer (a rank died or hangs) fails instead of hanging")  # fmt: skip
    args = p.parse_args(argv)
    if args.parallel == "fsdp" and args.shard_optimizer:
        p.error("--shard-optimizer does not combine with --parallel fsdp (FSDP already shards the optimizer state)")
    if args.resume and args.checkpoint is None:
        p.error("--resume needs --checkpoint")
    return args


def _setup(args) -> tuple[int, int, torch.device]:
    """(rank, world size, device); initializes torch.distributed unless --parallel none."""
    if args.parallel == "none":
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ:
        raise SystemExit(f"--parallel {args.parallel} needs torchrun (RANK / WORLD_SIZE are not set)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=args.timeout_s))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _wrap(model: torch.nn.Module, args, device: torch.device) -> torch.nn.Module:
    if args.parallel == "ddp":
        return DDP(model)
    if args.parallel == "bucketed":
        return BucketedDDP(model, args.bucket_mb)
    if args.parallel == "torch-ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_mb)
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    return model


def batch_for_step(step: int, args, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (batch * world sequences)."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab, (args.batch * world, args.context + 1), generator=generator)
    mine = tokens[rank * args.batch : (rank + 1) * args.batch]
    return mine[:, :-1].to(device), mine[:, 1:].to(device)


def _state(model, optimizer, args):
    """(model state, optimizer state) in the layout of an unsharded single-process run."""
    if args.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    inner = getattr(model, "module", model)
    return inner.state_dict(), optimizer.state_dict()


def save_checkpoint(path: Path, step: int, model, optimizer, args, rank: int) -> None:
    """Every rank takes part (sharded states are gathered); rank 0 writes PATH.tmp, then renames."""
    model_state, optimizer_state = _state(model, optimizer, args)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        torch.save({"step": step, "model": model_state, "optimizer": optimizer_state}, temporary)
        os.replace(temporary, path)  # atomic on POSIX: PATH is the old checkpoint or the new one
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path: Path, model, optimizer, args) -> int:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if args.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"],
                       optim_state_dict=checkpoint["optimizer"], options=options)  # fmt: skip
    else:
        getattr(model, "module", model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["step"]


def train(args) -> dict:
    """Run the training loop; returns {"step", "losses"} (rank-averaged loss per step) on every rank."""
    rank, world, device = _setup(args)
    try:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        config = ModelConfig.preset(args.preset, vocab_size=args.vocab, context_length=args.context)
        model = _wrap(TransformerLM(config).to(device), args, device)
        if args.shard_optimizer:
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        step = load_checkpoint(args.checkpoint, model, optimizer, args) if args.resume else 0
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
        losses = []
        while step < args.steps:
            tokens, targets = batch_for_step(step, args, rank, world, device)
            with autocast:
                loss = model(tokens, targets)
            loss.backward()
            if args.parallel in ("naive", "flat"):
                allreduce_gradients(model, flat=args.parallel == "flat")
            elif args.parallel in ("ddp", "bucketed"):
                model.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            reported = loss.detach().float()
            if world > 1:
                dist.all_reduce(reported)
                reported /= world
            losses.append(reported.item())
            if rank == 0:
                print(f"step {step}/{args.steps} loss {losses[-1]:.4f}", flush=True)
            if args.checkpoint is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint, step, model, optimizer, args, rank)
        if args.checkpoint is not None:
            save_checkpoint(args.checkpoint, step, model, optimizer, args, rank)
        if dist.is_initialized():
            dist.barrier()  # no rank tears down while another still has collectives in flight
        return {"step": step, "losses": losses}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process
