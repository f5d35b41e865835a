"""accelerate: the same script, `Accelerator().prepare(model, optimizer, dataloader)` under
`accelerate launch` with one and with two processes (on the CPU, gloo), trains with OffloadedAdamW
— the model streamed or in memory — as it trains with torch.optim.AdamW on the model in memory:
the same losses on every process, the same final weights, within fp32 rounding (one AdamW in
another order). With two processes accelerate wraps the model in DDP: a streamed model's
parameters are left to OffloadedAdamW, which averages their gradients itself, and its collectives
keep to a group of their own."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (a fixture)

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def launch(daemon, tmp_path, processes, optimizer, streamed=False, sft=None):  # noqa: F811
    out = tmp_path / f"{optimizer}-{processes}-{streamed}-{bool(sft)}.pt"
    with tempfile.TemporaryDirectory(prefix="tierd-ranks-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1",
                   PYTHONFAULTHANDLER="1", TMPDIR=tmp, ACCELERATE_DISABLE_RICH="1")
        how = ["--multi_gpu", "--main_process_port", "0"] if processes > 1 else ["--cpu"]
        r = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes",
             str(processes), "--num_machines", "1", "--mixed_precision", "no",
             "--dynamo_backend", "no", os.path.join(HERE, "accelerate_job.py"), daemon,
             str(out), optimizer] + (["--streamed"] if streamed else []) +
            (["--sft", sft] if sft else []),
            capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return torch.load(out)


def assert_trains_alike(got, want):
    assert len(got["losses"]) == len(want["losses"])
    for mine, theirs in zip(got["losses"], want["losses"]):
        assert mine[0] == theirs[0], "the first loss, before any step, differs"
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=0)
    assert got["weights"].keys() == want["weights"].keys()
    for k, v in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_streamed_model_trains_under_accelerate_as_in_memory(daemon, tmp_path,  # noqa: F811
                                                                processes):
    want = launch(daemon, tmp_path, processes, "torch")
    got = launch(daemon, tmp_path, processes, "tierd", streamed=True)
    assert want["wrapped"] == got["wrapped"] == \
        ("DistributedDataParallel" if processes > 1 else "LlamaForCausalLM")
    assert_trains_alike(got, want)
    if processes > 1:
        assert got["losses"][0] != got["losses"][1], "the processes saw the same batches"
        in_memory = launch(daemon, tmp_path, processes, "tierd")
        assert_trains_alike(in_memory, want)


def test_trl_sft_with_lora_on_a_streamed_model_under_two_processes(daemon, tmp_path):  # noqa: F811,E501
    """TRL's SFTTrainer with LoRA under `accelerate launch` with two processes: the streamed
    model (offloaded(SFTTrainer), the optimizer sharded over the processes) logs the losses and
    saves the adapters of SFTTrainer on the model in memory with torch's AdamW under DDP."""
    pytest.importorskip("trl")
    from test_pretrained import saved
    ckpt = str(saved(tmp_path, "llama"))
    want = launch(daemon, tmp_path, 2, "torch", sft=ckpt)
    got = launch(daemon, tmp_path, 2, "tierd", sft=ckpt)
    assert want["wrapped"] == got["wrapped"] == "DistributedDataParallel"
    assert len(got["losses"]) == len(want["losses"]) == 3
    assert got["losses"][0] == want["losses"][0]  # before any update
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
    assert got["weights"].keys() == want["weights"].keys() and len(want["weights"]) == 16
    for k, v in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-4, atol=1e-5, msg=k)
