"""One run of test_accelerate.py, started by `accelerate launch`: a small transformers Llama
trained a few steps through `Accelerator().prepare(model, optimizer, dataloader)` on the CPU, with
torch.optim.AdamW on the model in memory or OffloadedAdamW (the model streamed, or not). The
first process writes every process's losses and the final weights to OUT.

    accelerate_job.py SOCKET_DIR OUT torch|tierd [--streamed]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator

import tierd.torch  # (PYTHONPATH)

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
VOCAB = 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("socket_dir")
    ap.add_argument("out")
    ap.add_argument("optimizer", choices=["torch", "tierd"])
    ap.add_argument("--streamed", action="store_true")
    args = ap.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, vocab_size=VOCAB,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    stream = None
    if args.streamed:
        stream = tierd.torch.stream_parameters(model, device="cpu", device_budget_bytes=4 << 20,
                                               socket_dir=args.socket_dir)
    if args.optimizer == "tierd":
        opt = tierd.torch.OffloadedAdamW(model.parameters(), **HYPER, socket_dir=args.socket_dir,
                                         overlap_backward=True, bucket_params=4096, threads=1)
    else:
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (32, 16), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    every = [None] * accelerator.num_processes
    if accelerator.num_processes > 1:
        dist.all_gather_object(every, losses)
    else:
        every = [losses]
    inner = accelerator.unwrap_model(model)
    if stream is not None:
        with stream.gathered():
            weights = {k: v.clone() for k, v in inner.state_dict().items()}
    else:
        weights = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    if accelerator.is_main_process:
        torch.save({"losses": every, "weights": weights,
                    "wrapped": type(model).__name__}, args.out)
    accelerator.wait_for_everyone()
    if args.optimizer == "tierd":
        opt.optimizer.close()
    if stream is not None:
        stream.close()
    json.dump({"ok": True}, sys.stdout)


if __name__ == "__main__":
    main()
