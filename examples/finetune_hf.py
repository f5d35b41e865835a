"""LoRA fine-tuning of a Hugging Face model streamed from its checkpoint, the path a user copies.

1. A Llama-shaped model's checkpoint is written in the Hugging Face layout (safetensors shards
   and an index; here from a small config with random weights, as a download would leave it).
2. The model is built on the meta device and streamed from that checkpoint: each block's weights
   go straight into tierd's chunks (on NVMe past --host-budget), never whole in this process.
3. peft's LoRA adapters are added and trained with tierd.torch.OffloadedAdamW on the licence
   texts of the machine (bytes as tokens); the frozen base only streams in.
4. The adapters are saved with peft and the base with the stream's save_pretrained; transformers
   and peft load both back, and the loaded model's logits are checked equal to the trained one's.

    PYTHONPATH=python python3 examples/finetune_hf.py --socket-dir var/run --out var/finetune
"""
import argparse
import glob
import os
import shutil
import sys
import time

import torch

import tierd.torch

TEXTS = "/usr/share/common-licenses/*"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket-dir", default=None)
    ap.add_argument("--out", default="var/finetune", help="checkpoints are written here")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--host-budget", type=int, default=2 << 20,
                    help="bytes of the base's chunks at home in host memory (the rest on NVMe)")
    args = ap.parse_args()
    try:
        import peft
        import transformers
    except ImportError as e:
        sys.exit(f"finetune_hf: {e} (make deps installs requirements.txt)")
    torch.manual_seed(0)

    # 1. The checkpoint, as it would come from the Hub.
    base_dir = os.path.join(args.out, "base")
    shutil.rmtree(args.out, ignore_errors=True)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.ctx, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
        base_dir, max_shard_size="2MB")
    shards = len([f for f in os.listdir(base_dir) if f.endswith(".safetensors")])
    print(f"== checkpoint: {base_dir} ({shards} safetensors shards and an index)")

    # 2. Built on meta, streamed from the checkpoint.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    stream = tierd.torch.stream_parameters(
        model, checkpoint=base_dir, device=torch.device("cpu"), device_budget_bytes=16 << 20,
        host_budget_bytes=args.host_budget, socket_dir=args.socket_dir, name="finetune-hf")
    stats = stream.stats
    print(f"== streamed from it: {len(stream.units)} units, {stats['units_on_nvme']} at home on "
          f"NVMe")

    # 3. LoRA on the frozen base.
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"== LoRA: {sum(p.numel() for p in trainable):,} trainable parameters of "
          f"{sum(p.numel() for p in model.parameters()):,}")
    opt = tierd.torch.OffloadedAdamW(trainable, lr=2e-3, weight_decay=0.0, home="host",
                                     socket_dir=args.socket_dir, overlap_backward=True)
    data = b"".join(open(p, "rb").read() for p in sorted(glob.glob(TEXTS)) if os.path.isfile(p))
    data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(0)
    first = last = None
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g)
        x = torch.stack([data[s:s + args.ctx] for s in starts])
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = loss.item()
        first = first if first is not None else last
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {last:.3f}  {time.perf_counter() - t0:.2f} s")
    stats = stream.stats
    print(f"== base traffic: {stats['h2d_bytes'] / 2**20:.1f} MiB of weights in, "
          f"{stats['d2h_bytes']} bytes of gradients out (frozen)")

    # 4. Saved, and loaded back by transformers and peft.
    adapters_dir = os.path.join(args.out, "adapters")
    saved_dir = os.path.join(args.out, "saved-base")
    model.save_pretrained(adapters_dir)
    stream.save_pretrained(saved_dir, max_shard_size="2MB")
    x = data[:args.ctx].unsqueeze(0)
    with torch.no_grad():
        want = model(input_ids=x).logits
    opt.close()
    stream.close()
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(saved_dir), adapters_dir)
    with torch.no_grad():
        got = loaded(input_ids=x).logits
    if not torch.equal(got, want):
        sys.exit("finetune_hf: the model loaded back differs from the one trained")
    print(f"== saved: {saved_dir} and {adapters_dir}; loaded back by transformers and peft, "
          f"logits equal to the trained model's (loss {first:.3f} -> {last:.3f})")


if __name__ == "__main__":
    main()
