"""One job of test_oversubscription.py: the example GPT with its blocks streamed from NVMe and
OffloadedAdamW's state at home on NVMe, trained a few steps on the daemon at SOCKET_DIR; writes its
losses and step times to OUT as JSON.

    oversubscribed_job.py SOCKET_DIR OUT [--seed N] [--steps N]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "..", "..",
                                                                       "examples")]
import torch  # noqa: E402

import tierd.torch  # noqa: E402
from train_gpt import GPT  # noqa: E402

CTX = 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("socket_dir")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = GPT(4, 256, 4, CTX)
    stream = tierd.torch.stream_parameters(model, device=torch.device("cpu"),
                                           device_budget_bytes=64 << 20, host_budget_bytes=0,
                                           name=f"oversubscribed-{args.seed}",
                                           socket_dir=args.socket_dir)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=1e-3, socket_dir=args.socket_dir,
                                     home="nvme", host_budget_bytes=4 << 20, threads=1,
                                     overlap_backward=True)
    g = torch.Generator().manual_seed(100 + args.seed)
    losses, times = [], []
    try:
        for _ in range(args.steps):
            x = torch.randint(0, 256, (4, CTX + 1), generator=g)
            started = time.perf_counter()
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
    finally:
        opt.close()
        stream.close()
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "step_s": times}, f)


if __name__ == "__main__":
    main()
