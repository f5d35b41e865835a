"""OffloadedAdamW's checkpoints: save_checkpoint and load_checkpoint in each format this torch
has, beside torch.save and torch.load of the same state_dict (the floor: the same bytes through
one file, with no format of ours around them), alternating, in one process.

    python3 bench/checkpoint.py [--build BUILD] [--params N] [--rounds R] [--dir DIR]

Each round writes to DIR (a temporary directory by default: put it on the file system
checkpoints go to) and syncs; every load, the floor's too, goes into an optimizer made afresh. The page cache is not
dropped, so loads read what the save just wrote: they measure the formats, not the drive.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402


def model(params: int) -> torch.nn.Module:
    """Square layers of 4 M parameters each, `params` in all."""
    width = 2048
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(max(1, params // (width * width)))])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TIERD_CLIENT_LIB",
                          os.path.join(args.build, "client", "libtierd_client.so.0"))
    import tierd.torch
    from tierd.torch import _state_files

    m = model(int(args.params))
    n = sum(p.numel() for p in m.parameters())
    state_bytes = 2 * 4 * n  # exp_avg and exp_avg_sq, fp32
    host = f"{((3 * state_bytes >> 28) + 2) * 256}MiB"  # segments of 256 MiB
    formats = sorted(_state_files.formats())
    print(f"checkpoint: torch {torch.__version__}, {n / 1e6:.0f} M parameters, "
          f"{state_bytes / 1e9:.2f} GB of moments; formats {', '.join(formats)}", flush=True)
    root = tempfile.mkdtemp(prefix="tierd-ckpt-", dir=args.dir)
    with benchlib.daemon(args.build, host_capacity=host, nvme="64MiB") as socket_dir:
        def optimizer():
            return tierd.torch.OffloadedAdamW(m.parameters(), lr=1e-4, socket_dir=socket_dir,
                                              home="host", reset=True, name="bench/ckpt")

        opt = optimizer()
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        want = opt.state_dict()
        times = {}
        for r in range(args.rounds):
            for fmt in ["floor"] + formats:
                where = os.path.join(root, f"{fmt}-{r}")
                if fmt == "floor":
                    def save():
                        os.makedirs(where)
                        with open(os.path.join(where, "state.pt"), "wb") as f:
                            torch.save(opt.state_dict(), f)
                            f.flush()
                            os.fsync(f.fileno())
                    def load():
                        opt.load_state_dict(torch.load(os.path.join(where, "state.pt")))
                    save_s = timed(save)
                else:
                    save_s = timed(lambda: opt.save_checkpoint(where, format=fmt))

                    def load():
                        opt.load_checkpoint(where)
                opt.close()
                opt = optimizer()
                load_s = timed(load)
                got = opt.state_dict()
                assert all(torch.equal(got["state"][i]["exp_avg"], e["exp_avg"])
                           for i, e in want["state"].items()), f"{fmt}: not what was saved"
                shutil.rmtree(where)
                times.setdefault(fmt, []).append((save_s, load_s))
                print(f"  round {r} {fmt:>5}: save {save_s:6.2f} s ({state_bytes / save_s / 1e9:.2f}"
                      f" GB/s)  load {load_s:6.2f} s ({state_bytes / load_s / 1e9:.2f} GB/s)",
                      flush=True)
        opt.close()
    shutil.rmtree(root, ignore_errors=True)
    for fmt, ts in times.items():
        saves, loads = sorted(t[0] for t in ts), sorted(t[1] for t in ts)
        print(f"{fmt:>5}: save median {saves[len(saves) // 2]:.2f} s ({saves[0]:.2f}-"
              f"{saves[-1]:.2f}), load median {loads[len(loads) // 2]:.2f} s ({loads[0]:.2f}-"
              f"{loads[-1]:.2f})")


if __name__ == "__main__":
    main()
