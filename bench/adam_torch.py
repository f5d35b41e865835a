"""torch.optim.AdamW, the comparison for `tierd-bench adam` (on the CPU) and `tierd-bench gpu-adam`
(on the GPU, the fused implementation).

Prints one line: the median parameters per second over the timed steps. The parameters are split
into tensors of 4 Mi elements, as a model's layers are; the foreach implementation (torch's
default on the CPU for a list of tensors) updates them all per step.

  adam_torch.py PARAMS THREADS ITERATIONS [cpu|cuda]      (THREADS 0: torch's default)
"""
import statistics
import sys
import time

import torch


def main():
    params, threads, iterations = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    sizes = [4 << 20] * (params // (4 << 20))
    if params % (4 << 20):
        sizes.append(params % (4 << 20))
    weights = [torch.randn(n, device=device).requires_grad_(True) for n in sizes]
    for w in weights:
        w.grad = torch.randn(w.numel(), device=device)
    if device == "cpu":
        opt = torch.optim.AdamW(weights, lr=1e-3, weight_decay=0.01, foreach=True)
    else:
        opt = torch.optim.AdamW(weights, lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()  # allocates the state
    times = []
    for _ in range(iterations):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(params / statistics.median(times))

if __name__ == "__main__":
    main()
