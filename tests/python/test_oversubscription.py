"""Several jobs oversubscribing the daemon's host tier: each streams the example GPT's blocks from
NVMe with its optimizer state at home there, and what their windows, gradients and optimizer
staging want of the 32 MiB host tier at once is more than it holds. An Acquire that finds the
tier full of what other sessions hold pinned waits for their release (within its call's deadline)
instead of failing, so every job slows down and none fails, and each trains exactly as it does
alone. (Before, one of three died of RESOURCE_EXHAUSTED within a step or two.)
"""
import json
import os
import subprocess
import sys
import tempfile

from test_c_abi import start_daemon, stop_daemon

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = 3


def run_jobs(root, seeds):
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "oversubscribed_job.py"), root,
                               os.path.join(root, f"job{seed}.json"), "--seed", str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for seed in seeds]
    results = {}
    for seed, p in zip(seeds, procs):
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"job {seed} failed:\n{out[-3000:]}"
        with open(os.path.join(root, f"job{seed}.json")) as f:
            results[seed] = json.load(f)
    return results


def test_jobs_oversubscribing_the_host_tier_all_slow_down_and_none_fails():
    with tempfile.TemporaryDirectory(prefix="tierd-over-") as root:
        proc = start_daemon(root, f"--nvme_regions={root}/nvme.region:768MiB")
        try:
            together = run_jobs(root, list(range(JOBS)))
            alone = run_jobs(root, [0])
        finally:
            stop_daemon(proc, root)
    assert together[0]["losses"] == alone[0]["losses"]  # the same training, only slower
    for seed in range(JOBS):
        assert len(together[seed]["losses"]) == 4
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"step alone {median(alone[0]['step_s']):.3f} s; {JOBS} together "
          + ", ".join(f"{median(together[s]['step_s']):.3f}" for s in range(JOBS)) + " s")
