"""Equality on the device first: a Hugging Face model streamed on `--device` trains as the same
model in that device's memory, case by case, each case's verdict written as it is reached (a run
cut short keeps the cases it finished):

- checkpoint: a Llama built on meta, streamed from its safetensors checkpoint, against
  from_pretrained in memory: the same logits before training, losses and weights after 4 steps
  (and the streamed model moved to its own device, as accelerate does, is left as it is);
- lora: peft's LoRA on the streamed frozen base against the same peft model in memory;
- shared-base: the same LoRA in two jobs that share one read-only copy of the base (the first
  makes it, the second opens it while the first holds it), both against in memory;
- bf16-moments: OffloadedAdamW with bf16 moments, streamed against in memory, within their
  rounding (stochastic, its random bits drawn by bucket and tensor: the stream's buckets are
  its units', so the two round differently);
- device-lane: half of the optimizer stepped on the device (device_share=0.5), its state sent home
  each step and kept in the device tier between steps (device_budget_bytes), against all on the
  host, streamed both: bit for bit on the emulated device, within GPU Adam's rounding on a GPU.

Streamed and in-memory runs use OffloadedAdamW both, so what is compared is the stream. On cuda
with deterministic algorithms and eager attention, checkpoint and lora are bit for bit.

    python3 tests/gpu/torch_equality.py --build=DIR [--device=cuda|cpu] [--json=FILE]

DIR holds daemon/tierd and client/libtierd_client.so.0 (a build folder or an unpacked GPU kit).
--device=cpu runs the same cases on the emulated device (CTest's gpu_kit does). Exits 0 when every
case holds, 1 when one does not, 77 when cuda is asked for and torch sees no GPU.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
CASES = ["checkpoint", "lora", "shared-base", "bf16-moments", "device-lane"]
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, home="host", threads=2,
             overlap_backward=True, host_budget_bytes=1 << 20)
STEPS = 4


class Equality:
    """The cases, over one daemon: each builds what it compares on `device`."""

    def __init__(self, root: str, device, workdir: str):
        import torch
        import transformers
        self.torch, self.transformers = torch, transformers
        self.root, self.device, self.workdir = root, device, workdir
        self.config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=False, attn_implementation="eager")
        torch.manual_seed(0)
        self.ckpt = os.path.join(workdir, "ckpt")
        transformers.AutoModelForCausalLM.from_config(self.config).save_pretrained(
            self.ckpt, max_shard_size="100KB")

    def tokens(self, step: int):
        g = self.torch.Generator().manual_seed(1000 + step)
        return self.torch.randint(0, self.config.vocab_size, (2, 32), generator=g).to(self.device)

    def in_memory(self):
        return self.transformers.AutoModelForCausalLM.from_pretrained(
            self.ckpt, attn_implementation="eager").to(self.device)

    def streamed(self, **options):
        import tierd.torch
        with self.torch.device("meta"):
            model = self.transformers.AutoModelForCausalLM.from_config(self.config)
        block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        stream = tierd.torch.stream_parameters(
            model, device=self.device, checkpoint=self.ckpt, socket_dir=self.root,
            device_budget_bytes=(8 << 20) + 5 * block, host_budget_bytes=0, **options)
        return model, stream

    def lora_run(self, base, stream=None):
        """Losses and adapters of peft's LoRA on `base` (streamed by `stream`, or in memory)."""
        import peft
        self.torch.manual_seed(7)
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        return self.train(model), self.weights(model, stream, only=lambda k: "lora" in k)

    def train(self, model, params=None, **options):
        """Losses of STEPS steps of OffloadedAdamW, and the weights after them (on the CPU)."""
        import tierd.torch
        params = params if params is not None else [p for p in model.parameters()
                                                    if p.requires_grad]
        opt = tierd.torch.OffloadedAdamW(params, socket_dir=self.root, **dict(HYPER, **options))
        losses = []
        try:
            for step in range(STEPS):
                x = self.tokens(step)
                loss = model(input_ids=x, labels=x).loss
                losses.append(loss.item())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            self.last_stats = dict(opt.last_stats)
        finally:
            opt.close()
        return losses

    def weights(self, model, stream=None, only=lambda name: True):
        def copy():
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
                    if only(k)}
        if stream is None:
            return copy()
        with stream.gathered():
            return copy()

    # ---- the cases: each returns (holds, what was found) ----

    def checkpoint(self):
        torch = self.torch
        reference = self.in_memory()
        model, stream = self.streamed()
        try:
            model.to(self.device)  # accelerate's prepare() does; the stream's device: left alone
            model.to(self.device.type)
            with torch.no_grad():
                x = self.tokens(99)
                logits = torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits)
            got = self.train(model)
            got_weights = self.weights(model, stream)
        finally:
            stream.close(keep_weights=False)
        want = self.train(reference)
        same = _same(got_weights, self.weights(reference))
        return logits and got == want and same, dict(logits_equal=logits, losses=got,
                                                     memory_losses=want, weights_equal=same)

    def lora(self):
        base, stream = self.streamed()
        try:
            got, got_adapters = self.lora_run(base, stream)
        finally:
            stream.close(keep_weights=False)
        want, want_adapters = self.lora_run(self.in_memory())
        same = bool(got_adapters) and _same(got_adapters, want_adapters)
        return got == want and same, dict(losses=got, memory_losses=want, adapters_equal=same)

    def shared_base(self):
        want, want_adapters = self.lora_run(self.in_memory())
        found, holds, streams = {}, True, []
        try:
            for job in ("made", "opened"):
                base, stream = self.streamed(shared_base="torch-equality")
                streams.append(stream)  # the first holds the base while the second opens it
                got, adapters = self.lora_run(base, stream)
                same = bool(adapters) and _same(adapters, want_adapters)
                found[job] = dict(losses=got, adapters_equal=same)
                holds = holds and got == want and same
        finally:
            for stream in reversed(streams):
                stream.close(keep_weights=False)
        return holds, dict(memory_losses=want, **found)

    def bf16_moments(self):
        torch = self.torch
        reference = self.in_memory()
        model, stream = self.streamed()
        try:
            got = self.train(model, state_dtype=torch.bfloat16)
            got_weights = self.weights(model, stream)
        finally:
            stream.close(keep_weights=False)
        want = self.train(reference, state_dtype=torch.bfloat16)
        want_weights = self.weights(reference)
        close = all(torch.allclose(got_weights[k].float(), v.float(), rtol=0, atol=1e-4)
                    for k, v in want_weights.items()) and \
            torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-4)
        return close, dict(losses=got, memory_losses=want)

    def device_lane(self):
        torch = self.torch
        runs, kept = {}, 0.0
        # All on the host; half on the device, its state sent home each step; the same with its
        # state kept in the device tier between steps.
        for label, knobs in (("host", {}), ("split", dict(device_share=0.5)),
                             ("kept", dict(device_share=0.5, device_budget_bytes=1 << 40))):
            model, stream = self.streamed()
            try:
                runs[label] = self.train(model, **knobs), self.weights(model, stream)
            finally:
                stream.close(keep_weights=False)
            if label == "split":
                on_device = self.last_stats.get("device_params", 0.0)
            if label == "kept":
                kept = self.last_stats.get("device_kept_bytes", 0.0)
        host, host_weights = runs["host"]

        def same(losses, weights) -> bool:
            if self.device.type == "cpu":  # the emulated lane runs the host kernel: bit for bit
                return losses == host and _same(weights, host_weights)
            # GPU Adam fuses multiply-adds the CPU kernel may round twice
            return all(torch.allclose(weights[k].float(), v.float(), rtol=1e-4, atol=1e-5)
                       for k, v in host_weights.items()) and \
                torch.allclose(torch.tensor(losses), torch.tensor(host), rtol=1e-5)

        holds = same(*runs["split"]) and same(*runs["kept"])
        return holds and on_device > 0 and kept > 0, dict(
            losses=runs["split"][0], kept_losses=runs["kept"][0], host_losses=host,
            device_params=on_device, device_kept_bytes=kept)


def _same(a, b) -> bool:
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json")
    ap.add_argument("cases", nargs="*", default=CASES)
    args = ap.parse_args()
    os.environ["TIERD_CLIENT_LIB"] = os.path.join(args.build, "client", "libtierd_client.so.0")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "bench")]
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_equality: torch sees no GPU")
        return 77
    torch.use_deterministic_algorithms(True)
    import benchlib

    device = torch.device(args.device)
    failed = []
    out = open(args.json, "w") if args.json else None
    with benchlib.daemon(args.build, host_capacity="1GiB", device=args.device,
                         emulated="256MiB") as root, \
            tempfile.TemporaryDirectory(prefix="tierd-equality-") as workdir:
        cases = Equality(root, device, workdir)
        for name in args.cases:
            start = time.monotonic()
            try:
                holds, found = getattr(cases, name.replace("-", "_"))()
            except Exception:  # noqa: BLE001 (a case that raises fails; the others still run)
                holds, found = False, dict(error=traceback.format_exc())
            record = dict(case=name, device=str(device), holds=holds,
                          seconds=round(time.monotonic() - start, 2), **found)
            print(f"torch_equality: {name} on {device}: {'holds' if holds else 'FAILS'} "
                  f"({record['seconds']} s) {found}", flush=True)
            if out is not None:
                out.write(json.dumps(record, default=str) + "\n")
                out.flush()
            if not holds:
                failed.append(name)
    if failed:
        print(f"torch_equality: failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
