"""Training on a real GPU with tierd.torch: OffloadedAdamW and offload_activations with the model
on `cuda`, checked against torch, then the two benchmarks on `cuda`.

    python3 tests/gpu/torch_train.py --build=DIR [--json=FILE]

DIR holds daemon/tierd and client/libtierd_client.so.0 (a build folder or an unpacked GPU kit).
Exits 0 when every check passes, 1 when one fails, 77 when torch sees no GPU.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ["TIERD_CLIENT_LIB"] = os.path.join(args.build, "client", "libtierd_client.so.0")
    sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples"),
                    os.path.join(ROOT, "bench")]
    import torch
    if not torch.cuda.is_available():
        print("torch_train: torch sees no GPU")
        return 77
    import tierd.torch
    import benchlib
    import train_gpt

    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    cuda = torch.device("cuda")
    with benchlib.daemon(args.build, host_capacity="2GiB", device="cuda") as root:
        # Activations: gradients equal the run without offload, slabs through NVMe.
        torch.manual_seed(1)
        model = train_gpt.GPT(2, 128, 4, 64).to(cuda)
        data = torch.randint(0, 256, (8, 65), device=cuda)
        x, y = data[:, :-1], data[:, 1:]
        model(x, y).backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        offload = tierd.torch.offload_activations(socket_dir=root, min_bytes=1 << 14,
                                                  host_budget_bytes=0, slab_bytes=1 << 20)
        with offload:
            loss = model(x, y)
        loss.backward()
        same = all(torch.equal(a, b) for a, b in zip(plain, [p.grad for p in model.parameters()]))
        results["activations_equal"] = same
        results["activations"] = vars(offload.stats)
        offload.close()
        assert same, "activation offload on cuda changed the gradients"
        assert offload.stats.nvme_read_bytes > 0, "no slab went through NVMe"

        # OffloadedAdamW on cuda beside torch.optim.AdamW: 20 steps, same data.
        losses = {}
        for name in ("tierd", "torch"):
            torch.manual_seed(1)
            model = train_gpt.GPT(2, 128, 4, 64).to(cuda)
            if name == "tierd":
                opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                                                 home="nvme", host_budget_bytes=1 << 20,
                                                 overlap_backward=True, socket_dir=root)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            losses[name] = []
            for step in range(20):
                g = torch.Generator().manual_seed(step)
                d = torch.randint(0, 256, (8, 65), generator=g).to(cuda)
                loss = model(d[:, :-1], d[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
            if name == "tierd":
                opt.close()
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses["tierd"], losses["torch"]))
        results["adamw_losses"] = losses
        results["adamw_worst_relative_difference"] = worst
        print(f"torch_train: OffloadedAdamW on cuda vs torch AdamW over 20 steps: worst relative "
              f"loss difference {worst:.2e}; loss {losses['tierd'][0]:.4f} -> "
              f"{losses['tierd'][-1]:.4f}")
        assert worst < 1e-4, "OffloadedAdamW on cuda drifted from torch.optim.AdamW"

    # The benchmarks and the example, on cuda (each starts its own daemon).
    for cmd in (["bench/train_step.py", "--device", "cuda", "--build", args.build],
                ["bench/activation_offload.py", "--device", "cuda", "--build", args.build]):
        run = subprocess.run([sys.executable, os.path.join(ROOT, cmd[0])] + cmd[1:],
                             capture_output=True, text=True, timeout=300)
        print(run.stdout + run.stderr)
        results[os.path.basename(cmd[0])] = run.stdout
        assert run.returncode == 0, f"{cmd[0]} failed"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
