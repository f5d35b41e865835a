"""One run of test_accelerate.py, started by `accelerate launch`: a small transformers Llama
trained a few steps through `Accelerator().prepare(model, optimizer, dataloader)` on the CPU, with
torch.optim.AdamW on the model in memory or OffloadedAdamW (the model streamed, or not). The
first process writes every process's losses and the final weights to OUT.

--sft CHECKPOINT: instead, TRL's SFTTrainer with LoRA on the checkpoint's model, in memory with
torch's AdamW or streamed with tierd.torch.hf.offloaded(SFTTrainer); the first process writes
the logged losses and the saved adapters to OUT.

    accelerate_job.py SOCKET_DIR OUT torch|tierd [--streamed] [--sft CHECKPOINT]
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
import tierd.torch.hf

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
VOCAB = 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("socket_dir")
    ap.add_argument("out")
    ap.add_argument("optimizer", choices=["torch", "tierd"])
    ap.add_argument("--streamed", action="store_true")
    ap.add_argument("--sft", default=None)
    args = ap.parse_args()
    if args.sft:
        return sft(args)
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
    # As a script must: a process that exits with its gloo group alive may abort in
    # teardown ("terminate called without an active exception", pytorch/pytorch#190489).
    accelerator.end_training()
    json.dump({"ok": True}, sys.stdout)


def sft(args):
    import peft
    import safetensors.torch
    import trl
    from test_hf_trainer import _words
    from test_pretrained import on_meta
    data, tokenizer = _words()
    config = trl.SFTConfig(output_dir=args.out + ".run", per_device_train_batch_size=2,
                           max_steps=3, logging_steps=1, save_strategy="no", report_to=[],
                           use_cpu=True, seed=0, learning_rate=1e-3, max_length=32)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    stream = None
    if args.optimizer == "torch":
        trainer = trl.SFTTrainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(args.sft), args=config,
            train_dataset=data, processing_class=tokenizer, peft_config=lora)
    else:
        model = on_meta("llama")
        stream = tierd.torch.stream_parameters(model, checkpoint=args.sft, device="cpu",
                                               device_budget_bytes=4 << 20,
                                               socket_dir=args.socket_dir)
        trainer = tierd.torch.hf.offloaded(trl.SFTTrainer)(
            model=model, args=config, train_dataset=data, processing_class=tokenizer,
            peft_config=lora, optimizer_options=dict(
                socket_dir=args.socket_dir, threads=1, home="host", host_budget_bytes=1 << 20,
                overlap_backward=True, bucket_params=256))
    trainer.train()
    trainer.save_model(args.out + ".saved")
    if trainer.is_world_process_zero():
        adapters = safetensors.torch.load_file(
            os.path.join(args.out + ".saved", "adapter_model.safetensors"))
        torch.save({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                    "weights": adapters, "wrapped": type(trainer.model_wrapped).__name__},
                   args.out)
    trainer.accelerator.wait_for_everyone()
    if stream is not None:
        trainer.optimizer.optimizer.close()
        stream.close()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
