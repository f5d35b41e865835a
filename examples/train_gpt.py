#!/usr/bin/env python3
"""Trains a small GPT on the licence texts every Debian system ships, with its optimizer state and
activations in tierd.

The model is a plain-torch decoder (byte tokens, pre-LayerNorm blocks, tied embeddings). Its AdamW
state (fp32 master weights, exp_avg, exp_avg_sq: 12 bytes per parameter) lives in the node's
tierd under a name, at home on NVMe and streamed through a host budget a quarter of its size; the
step of each bucket of parameters overlaps backward. The tensors autograd saves for backward go
into tierd chunks during forward (host memory up to --activation-budget, NVMe past it) and come
back in backward's order. Each step prints the loss, tokens/s, the step's time, the optimizer's
tail after backward and the bytes moved to and from NVMe. The state is persistent: `--resume`
continues from the last finished step, weights included.

    PYTHONPATH=python python3 examples/train_gpt.py --socket-dir var/run --fresh
    PYTHONPATH=python python3 examples/train_gpt.py --socket-dir var/run --resume --steps 10

With --stream-parameters the blocks' weights live in tierd too and pass through a device budget
(--device-budget) a few blocks at a time: the model trains on a device smaller than itself (the
CPU with a budget stands in for a GPU).

    PYTHONPATH=python python3 examples/train_gpt.py --socket-dir var/run --fresh --layers 12 \
        --stream-parameters --device-budget 8MiB

Under torchrun it trains data parallel: each rank a session of the node's tierd, computing on its
share of every batch (--batch is the global batch) and keeping and stepping its share of the
optimizer state (ZeRO-1); the losses are those of one process with the whole batch.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --socket-dir var/run --fresh
    (python3 -m tierd.torchrun ... where torch 1.13's torchrun fails on Python 3.11)

--checkpoint DIR writes the weights and the optimizer's state (a DCP checkpoint on torch 2.2 and
newer, else a file per rank) at the end;
--from-checkpoint DIR --fresh goes on from there with any number of ranks, on any nodes.
"""
import argparse
import contextlib
import glob
import math
import os
import re
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import tierd
except ImportError:  # run from a source checkout without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import tierd
import tierd.torch  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # python3-tqdm is optional: plain lines instead of a bar
    tqdm = None

TEXTS = "/usr/share/common-licenses/*"  # base-files: on every Debian system


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.full((ctx, ctx), float("-inf")).triu(1),
                             persistent=False)

    def attend(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads) + self.mask[:t, :t]
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attend(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, ctx: int, vocab: int = 256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, ctx) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()  # tied: the embedding is the output layer
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def size(text: str) -> int:
    """Bytes from "8MiB", "1GiB", "512KiB" or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8MiB)")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def load_text() -> torch.Tensor:
    data = b"".join(open(p, "rb").read() for p in sorted(glob.glob(TEXTS)) if os.path.isfile(p))
    if len(data) < 10_000:
        sys.exit(f"train_gpt: too little text under {TEXTS} ({len(data)} bytes)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(data, step, args, device, rank=0, world=1):
    """This rank's share of the step's global batch."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # resumable: by step
    starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g)
    starts = starts.chunk(world)[rank]
    x = torch.stack([data[s:s + args.ctx] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + args.ctx] for s in starts])
    return x.to(device), y.to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket-dir", default=os.environ.get("TIERD_SOCKET_DIR"))
    ap.add_argument("--name", default="train-gpt", help="the optimizer state's name in tierd")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the state of --name")
    mode.add_argument("--fresh", action="store_true", help="discard the state of --name first")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=0.0,
                    help="clip to this global norm (0: off; on, a step that clips is stepped "
                    "during backward, then discarded and taken again)")
    ap.add_argument("--host-budget", type=int, default=0,
                    help="host bytes the state streams through (0: a quarter of the state)")
    ap.add_argument("--home", choices=["nvme", "host"], default="nvme")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the optimizer's moments (bfloat16: 8 bytes of state a parameter, not 12)")
    ap.add_argument("--activations", choices=["tierd", "memory"], default="tierd",
                    help="where saved activations wait for backward")
    ap.add_argument("--activation-budget", type=int, default=8 << 20,
                    help="host bytes for activations; the rest go to NVMe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stream-parameters", action="store_true",
                    help="stream the blocks' weights through --device-budget (tierd.torch."
                    "stream_parameters)")
    ap.add_argument("--device-budget", type=size, default=None,
                    help="device bytes for the model's weights and gradients when streaming "
                    "(e.g. 8MiB; default: the least that works)")
    ap.add_argument("--prefetch", type=int, default=1, help="blocks copied ahead when streaming")
    ap.add_argument("--share-ranks", action="store_true",
                    help="with several ranks streaming: the ranks on a node stream one set of "
                    "weights (stream_parameters(share_ranks=True))")
    ap.add_argument("--weights-host-budget", type=size, default=None,
                    help="host bytes for the streamed weights; the rest at home on NVMe")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save", help="also write model and optimizer state_dicts to this file")
    ap.add_argument("--checkpoint", help="at the end, write the model's weights (model.pt) and "
                    "the optimizer's checkpoint (DCP on torch 2.2 and newer, else a file "
                    "per rank) to this directory")
    ap.add_argument("--from-checkpoint", help="start from a --checkpoint directory, whatever "
                    "number of ranks or nodes wrote it (the state resharded); with --fresh")
    args = ap.parse_args()
    if args.from_checkpoint and not args.fresh:
        ap.error("--from-checkpoint starts the state afresh from the checkpoint: add --fresh")

    # The sessions of this run (every rank's) are one job in tierctl status and the metrics.
    os.environ.setdefault("TIERD_JOB", re.sub(r"[^A-Za-z0-9._:/-]", "_", args.name)[:63])
    rank, world, dist = 0, int(os.environ.get("WORLD_SIZE", "1")), None
    device = torch.device(args.device)
    if world > 1:  # under torchrun
        import torch.distributed as dist
        if args.batch % world:
            sys.exit(f"train_gpt: --batch {args.batch} is not a multiple of the {world} ranks")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    data = load_text()
    model = GPT(args.layers, args.d_model, args.heads, args.ctx)
    if args.from_checkpoint:  # the weights before anything takes them (streaming, the optimizer)
        model.load_state_dict(torch.load(os.path.join(args.from_checkpoint, "model.pt"),
                                         weights_only=True))
    params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(t.numel() * t.element_size() for t in
                      list(model.parameters()) + list(model.buffers()))
    stream = None
    if args.stream_parameters:  # before the optimizer, which then steps the streamed blocks
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        resident = model_bytes - block * args.layers
        least = resident + (args.prefetch + 3) * block
        try:
            stream = tierd.torch.stream_parameters(
                model, device=device, device_budget_bytes=args.device_budget or least,
                prefetch=args.prefetch, host_budget_bytes=args.weights_host_budget,
                name=args.name if args.share_ranks else f"{args.name} rank {rank}",
                socket_dir=args.socket_dir, share_ranks=args.share_ranks)
        except (ValueError, tierd.TierdError) as e:
            print(f"train_gpt: {e}", file=sys.stderr)
            return 2
    else:
        model = model.to(device)
    state_dtype = getattr(torch, args.state_dtype)
    state_bytes = (8 if state_dtype == torch.bfloat16 else 12) * params
    budget = args.host_budget or max(state_bytes // 4, 4 << 20)
    try:
        opt = tierd.torch.OffloadedAdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
            name=args.name, resume=True if args.resume else (None if args.fresh else False),
            reset=args.fresh, home=args.home, host_budget_bytes=budget,
            max_grad_norm=args.max_grad_norm or None, overlap_backward=True,
            state_dtype=state_dtype,
            bucket_params=max(params // 16, 1 << 16), socket_dir=args.socket_dir)
    except (tierd.TierdError, RuntimeError) as e:  # RuntimeError: another rank's failure
        hint = {"ALREADY_EXISTS": " (--resume continues it, --fresh discards it)",
                "NOT_FOUND": " (run without --resume to start it)"}.get(
                    getattr(e, "code_name", ""), "")
        print(f"train_gpt: {e}{hint}", file=sys.stderr)
        if stream is not None:
            stream.close()
        return 2
    if args.from_checkpoint:
        opt.load_checkpoint(args.from_checkpoint)
    first = opt.steps_taken
    start = (f"resumed '{args.name}' at step {first}" if opt.resumed else
             f"state '{args.name}' from {args.from_checkpoint} at step {first}"
             if args.from_checkpoint else f"new state '{args.name}'")
    say(f"train_gpt: {params / 1e6:.2f} M parameters, {len(data) / 1e3:.0f} kB of text; "
        f"optimizer state {state_bytes / 2**20:.1f} MiB at home on {opt.home}, host budget "
        f"{budget / 2**20:.1f} MiB; {start}")
    if stream is not None:
        say(f"train_gpt: weights streamed: {len(stream.units)} blocks of "
            f"{stream.largest_unit_bytes / 2**20:.2f} MiB through a device budget of "
            f"{stream.device_budget_bytes / 2**20:.2f} MiB, the model being "
            f"{model_bytes / 2**20:.2f} MiB ({model_bytes / stream.device_budget_bytes:.1f}x the "
            f"budget); {stream.stats['units_on_nvme']} blocks at home on NVMe")
    if world > 1:
        say(f"train_gpt: {world} ranks, each computing on {args.batch // world} of the "
            f"{args.batch} sequences a step and stepping its {opt.state_bytes / 2**20:.1f} MiB "
            f"share of the state")

    client = tierd.connect(args.socket_dir, f"train_gpt rank {rank}" if world > 1 else "train_gpt")
    offload = None
    if args.activations == "tierd":
        offload = tierd.torch.offload_activations(client=client, min_bytes=1 << 16,
                                                  host_budget_bytes=args.activation_budget)
    moved = lambda: (client.path_bytes("nvme_to_host"), client.path_bytes("host_to_nvme"))  # noqa: E731
    steps = range(first + 1, first + args.steps + 1)
    bar = steps
    if tqdm and sys.stderr.isatty() and rank == 0:
        bar = tqdm(steps, unit="step", dynamic_ncols=True)
        say = tqdm.write
    losses, times, tails = [], [], []
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / args.warmup)
        x, y = batch(data, step, args, device, rank, world)
        before = moved()
        t0 = time.perf_counter()
        with offload if offload is not None else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        after = moved()
        loss = loss.detach()
        traffic = ""
        if world > 1:  # the mean over ranks: the loss of the whole batch
            dist.all_reduce(loss)
            loss /= world
            sent = torch.tensor(opt.last_stats["dist_bytes"], dtype=torch.float64,
                                device=loss.device)
            dist.all_reduce(sent)  # what the ranks' gradients and weights moved between them
            traffic = f"  torch.distributed {sent.item() / 2**20:.2f} MiB"
        losses.append(loss.item())
        times.append(dt)
        tails.append(opt.last_stats["tail_s"])
        say(f"step {step:4d}  loss {losses[-1]:.4f}  {x.numel() * world / dt:8.0f} tok/s  "
            f"step {dt * 1e3:6.0f} ms  optimizer tail {tails[-1] * 1e3:5.0f} ms "
            f"({int(opt.last_stats['buckets_during_backward'])}/"
            f"{int(opt.last_stats['buckets'])} buckets during backward"
            f"{'; clipped: stepped again' if opt.last_stats.get('rolled_back') else ''})  "
            f"NVMe read {(after[0] - before[0]) / 2**20:5.1f} MiB "
            f"write {(after[1] - before[1]) / 2**20:5.1f} MiB{traffic}")
    if offload is not None:
        a, n_steps = offload.stats, max(len(times), 1)
        say(f"train_gpt: activations: {a.stored / n_steps:.0f} tensors a step in tierd "
            f"({a.stored_bytes / n_steps / 2**20:.1f} MiB; {a.deduplicated / n_steps:.0f} saved "
            f"twice stored once; {a.kept / n_steps:.0f} small or parameters kept), "
            f"{a.nvme_written_bytes / n_steps / 2**20:.1f} MiB a step to NVMe and back in "
            f"{a.slabs} slabs; pack {a.pack_seconds / n_steps * 1e3:.1f} ms, unpack "
            f"{a.unpack_seconds / n_steps * 1e3:.1f} ms a step")
        offload.close()
    client.close()
    if stream is not None:
        st = stream.stats
        n_steps = max(len(times), 1)
        say(f"train_gpt: streaming: device peak {st['device_peak_bytes'] / 2**20:.2f} MiB of a "
            f"{stream.device_budget_bytes / 2**20:.2f} MiB budget for a {model_bytes / 2**20:.2f} "
            f"MiB model; a step moved {st['h2d_bytes'] / n_steps / 2**20:.1f} MiB of weights in "
            f"and {st['d2h_bytes'] / n_steps / 2**20:.1f} MiB of gradients out; compute waited "
            f"{st['wait_s'] / n_steps * 1e3:.1f} ms a step for weights; {st['on_demand']} blocks "
            f"fetched on demand, {st['trace_misses']} off the trace")
    if args.save:
        state = opt.state_dict()
        if world > 1:  # each rank holds its parameters' state: the union is the whole
            shards = [None] * world
            dist.all_gather_object(shards, state["state"])
            state["state"] = {k: v for shard in shards for k, v in shard.items()}
        with stream.gathered() if stream is not None else contextlib.nullcontext():
            weights = model.state_dict()
            if rank == 0:
                torch.save({"model": weights, "optimizer": state}, args.save)
    if args.checkpoint:  # rank 0 the weights, then every rank its share of the state
        with stream.gathered() if stream is not None else contextlib.nullcontext():
            weights = model.state_dict()
            if rank == 0:
                os.makedirs(args.checkpoint, exist_ok=True)
                path = os.path.join(args.checkpoint, "model.pt")
                torch.save(weights, path + ".tmp")
                os.replace(path + ".tmp", path)
        opt.save_checkpoint(args.checkpoint)  # returns once every rank's file is written
    opt.close()
    if stream is not None:
        stream.close()
    if world > 1:
        dist.destroy_process_group()

    if not losses:
        return 0
    n = max(1, len(losses) // 4)
    head, tail = sum(losses[:n]) / n, sum(losses[-n:]) / n
    steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    say(f"train_gpt: steps {first + 1}-{first + len(losses)}: loss {head:.3f} -> {tail:.3f} "
        f"(mean of first and last {n}), median step {steady * 1e3:.0f} ms, optimizer tail "
        f"{sorted(tails)[len(tails) // 2] * 1e3:.0f} ms; state '{args.name}' saved at step "
        f"{first + len(losses)} (--resume continues)")
    if len(losses) >= 8 and not tail < head:
        say("train_gpt: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
