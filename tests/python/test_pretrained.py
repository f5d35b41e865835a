"""Real models in and out: transformers models built on the meta device and streamed straight from
a checkpoint in the Hugging Face layout, trained bit-equal to the same model in memory, written
back with save_pretrained and loaded by transformers bit-equal; initialisation on meta; and
checkpoints that are not what they should be, refused before anything is written.

Small configs, random initialisation, no download.
"""
import json
import os
import re
import struct
import sys
import threading
import time

import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (a fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd.torch  # noqa: E402
from tierd.client import Client, Tier, connect  # noqa: E402
from tierd.torch._safetensors import Checkpoint  # noqa: E402

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, home="host", threads=2,
             overlap_backward=True, host_budget_bytes=1 << 20)
VOCAB = 128
BUDGET = 4 << 20  # the device window: the models here are 4 blocks of under 100 KiB


def config(kind: str):
    common = dict(vocab_size=VOCAB)
    if kind == "llama":
        return transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, **common)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0, **common)
    raise ValueError(kind)


def build(kind: str):
    return transformers.AutoModelForCausalLM.from_config(config(kind))


def on_meta(kind: str):
    with torch.device("meta"):
        return build(kind)


def tokens(step: int, n: int = 2, length: int = 16):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, length), generator=g)


def stream(model, daemon, **kwargs):  # noqa: F811
    options = dict(device=torch.device("cpu"), device_budget_bytes=BUDGET, socket_dir=daemon)
    options.update(kwargs)
    return tierd.torch.stream_parameters(model, **options)


def train(model, daemon, steps: int = 4, params=None, ready=lambda: None):  # noqa: F811
    """The losses of a few steps of OffloadedAdamW over `params` (default: the trainable ones);
    ready() is called once the optimizer is made."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    opt = tierd.torch.OffloadedAdamW(params, socket_dir=daemon, **HYPER)
    ready()
    losses = []
    try:
        for step in range(steps):
            x = tokens(step)
            loss = model(input_ids=x, labels=x).loss
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        opt.close()
    return losses


def saved(tmp_path, kind: str, name: str = "ckpt", max_shard_size="20KB", seed: int = 0,
          dtype=None):
    torch.manual_seed(seed)
    model = build(kind)
    if dtype is not None:
        model = model.to(dtype)
    directory = tmp_path / name
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def host_bytes(daemon):  # noqa: F811
    c = connect(daemon, "pytest probe")
    try:
        return c.tier_usage(Tier.HOST).used_bytes
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_a_model_built_on_meta_streams_from_its_checkpoint_and_trains_as_in_memory(
        daemon, tmp_path, kind):  # noqa: F811
    ckpt = saved(tmp_path, kind)
    assert os.path.exists(ckpt / "model.safetensors.index.json")  # sharded
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    model = on_meta(kind)
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        assert not [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                    if t.is_meta], "a tensor left on meta"
        assert len(s.units) == 4
        with torch.no_grad():
            assert torch.equal(model(tokens(99)).logits, reference(tokens(99)).logits)
        assert train(model, daemon) == train(reference, daemon)
        out = tmp_path / "out"
        written = s.save_pretrained(out, max_shard_size="30KB")
        assert str(out / "model.safetensors.index.json") in written
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        want = reference.state_dict()
        got = back.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        if kind != "llama":  # tied: written once, as transformers writes it
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert "lm_head.weight" not in index["weight_map"]
    finally:
        s.close()


def _bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_the_daemon_reads_the_checkpoint_into_the_units_not_the_training_process(
        daemon, tmp_path, home):  # noqa: F811
    """Weights stored in the model's dtype go from the file straight into the units' chunks
    (Client.import_file): this process reads their layout, not their bytes."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, vocab_size=VOCAB,
                                   tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(
        tmp_path / "ckpt", max_shard_size="1MB")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    streamed = sum(p.numel() * p.element_size() for layer in reference.model.layers
                   for p in layer.parameters())
    before = _bytes_read_by_this_process()
    s = stream(model, daemon, checkpoint=str(tmp_path / "ckpt"), device_budget_bytes=16 << 20,
               host_budget_bytes=0 if home == "nvme" else None)
    try:
        read = _bytes_read_by_this_process() - before
        assert {u.home for u in s._units} == {Tier.NVME if home == "nvme" else Tier.HOST}
        assert read < streamed / 10, f"read {read} bytes of the {streamed} streamed"
        with torch.no_grad():
            assert torch.equal(model(tokens(99)).logits, reference(tokens(99)).logits)
    finally:
        s.close()


def _resident_readers():
    return [t for t in threading.enumerate() if t.name.startswith("tierd-resident")]


def test_the_resident_tensors_are_read_while_the_daemon_reads_the_units(
        daemon, tmp_path, monkeypatch):  # noqa: F811
    """The embedding and the head are read by a thread of this process while the daemon reads
    the blocks (a reader that waited for the daemon's reads to end would wait here in vain)."""
    ckpt = saved(tmp_path, "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    daemon_reading = threading.Event()
    residents = {}  # key -> whether the daemon was reading when the thread read it
    import_file, read_into = Client.import_file, Checkpoint.read_into

    def importing(self, *a, **kw):
        daemon_reading.set()
        return import_file(self, *a, **kw)

    def reading(self, key, out):
        if threading.current_thread().name.startswith("tierd-resident"):
            residents[key] = daemon_reading.wait(10)
        read_into(self, key, out)
    monkeypatch.setattr(Client, "import_file", importing)
    monkeypatch.setattr(Checkpoint, "read_into", reading)
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        assert residents.keys() == {"model.embed_tokens.weight", "lm_head.weight",
                                    "model.norm.weight"}
        assert all(residents.values()), "a resident tensor was read before the units'"
        with torch.no_grad():
            assert torch.equal(model(tokens(7)).logits, reference(tokens(7)).logits)
    finally:
        s.close()
    assert not _resident_readers()


@pytest.mark.parametrize("fails", ["resident", "unit"])
def test_a_failed_read_of_either_leaves_no_reader_no_chunk_and_says_why(
        daemon, tmp_path, monkeypatch, fails):  # noqa: F811
    """A resident tensor's read that fails is raised once the units are read; a unit's that
    fails is raised after the residents' reader has ended, before the files close."""
    ckpt = saved(tmp_path, "llama")
    events = []
    import_file, read_into, close = Client.import_file, Checkpoint.read_into, Checkpoint.close

    def importing(self, *a, **kw):
        if fails == "unit":
            raise OSError(5, "the unit's read failed")
        return import_file(self, *a, **kw)

    def reading(self, key, out):
        if threading.current_thread().name.startswith("tierd-resident"):
            if fails == "resident":
                raise OSError(5, f"{key}: the resident's read failed")
            time.sleep(0.2)
            events.append("resident read")
        read_into(self, key, out)

    def closing(self):
        events.append("closed")
        close(self)
    monkeypatch.setattr(Client, "import_file", importing)
    monkeypatch.setattr(Checkpoint, "read_into", reading)
    monkeypatch.setattr(Checkpoint, "close", closing)
    before = host_bytes(daemon)
    with pytest.raises(OSError, match=f"the {fails}'s read failed"):
        stream(on_meta("llama"), daemon, checkpoint=str(ckpt))
    assert host_bytes(daemon) == before, "a chunk was left behind"
    assert not _resident_readers()
    assert events[-1] == "closed"
    if fails == "unit":
        assert events.count("resident read") == 3


def test_a_single_file_in_another_dtype_is_converted_to_the_models(daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama", max_shard_size="1GB", dtype=torch.bfloat16)
    assert os.listdir(ckpt).count("model.safetensors") == 1
    want = safetensors_torch.load_file(ckpt / "model.safetensors")
    model = on_meta("llama")  # fp32
    s = stream(model, daemon, checkpoint=str(ckpt / "model.safetensors"))
    try:
        with s.gathered():
            got = model.state_dict()
            for k, v in want.items():
                assert got[k].dtype == torch.float32
                assert torch.equal(got[k], v.float()), k
    finally:
        s.close(keep_weights=False)


def test_a_model_on_meta_without_a_checkpoint_gets_its_own_initialisation(daemon):  # noqa: F811
    model = on_meta("llama")
    s = stream(model, daemon)
    try:
        reference = build("llama")
        with s.gathered():
            for n, p in model.named_parameters():
                assert torch.isfinite(p).all(), n
                if n.endswith("norm.weight"):
                    assert torch.equal(p, torch.ones_like(p)), n  # RMSNorm: ones
                else:
                    assert 0.005 < float(p.detach().std()) < 0.05, n  # normal(0, 0.02)
        # The RoPE table, not saved, recomputed by the model's own code.
        assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
        x = tokens(0)
        assert torch.isfinite(model(input_ids=x, labels=x).loss)
    finally:
        s.close()


def test_init_is_applied_to_each_unit_on_a_staging_copy(daemon):  # noqa: F811
    seen = []

    def init(module):
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=True):
            torch.nn.init.constant_(p, 0.25)

    model = on_meta("llama")
    s = stream(model, daemon, init=init)
    try:
        assert seen.count("LlamaDecoderLayer") == 4
        with s.gathered():
            for n, p in model.named_parameters():
                assert torch.equal(p, torch.full_like(p, 0.25)), n
    finally:
        s.close()


def test_init_and_a_checkpoint_together_or_init_for_a_built_model_are_refused(
        daemon, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="not both"):
        stream(on_meta("llama"), daemon, checkpoint=str(tmp_path), init=lambda m: None)
    with pytest.raises(ValueError, match="built on the meta device"):
        stream(build("llama"), daemon, init=lambda m: None)


def nvme_written(daemon):  # noqa: F811
    c = connect(daemon, "pytest probe")
    try:
        return c.path_bytes("host_to_nvme")
    finally:
        c.close()


@pytest.mark.parametrize("which", ["trainable", "all"])
def test_lora_on_a_streamed_frozen_base_trains_as_the_same_peft_model_in_memory(
        daemon, tmp_path, which):  # noqa: F811
    """peft's LoRA on a base streamed from its checkpoint, at home on NVMe: the same losses and
    adapters as in memory; the frozen base sends no gradient off the device and is never
    written back. `which`: the optimizer gets the trainable parameters (as transformers'
    Trainer gives them), or every parameter (frozen ones are left alone, as AdamW leaves
    them)."""
    peft = pytest.importorskip("peft")
    ckpt = saved(tmp_path, "llama")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    def run(streamed):
        s = None
        if streamed:
            base = on_meta("llama")
            s = stream(base, daemon, checkpoint=str(ckpt), host_budget_bytes=0)
        else:
            base = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
        torch.manual_seed(7)
        model = peft.get_peft_model(base, peft.LoraConfig(**lora))
        params = [p for p in model.parameters() if p.requires_grad or which == "all"]
        written = []  # NVMe bytes written when training starts (the import's are done by then)
        losses = train(model, daemon, params=params,
                       ready=lambda: written.append(nvme_written(daemon)))
        adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora" in k}
        stats = s.stats if s is not None else None
        if s is not None:
            assert stats["units_on_nvme"] == 4
            assert nvme_written(daemon) == written[0], "the frozen base was written back"
            # Saved as the user would: the base by the stream (as it was before peft), the
            # adapters by peft; loaded back by transformers and peft.
            s.save_pretrained(tmp_path / f"base-{which}")
            model.save_pretrained(tmp_path / f"adapters-{which}")
            x = tokens(50)
            with torch.no_grad():
                trained = model(input_ids=x).logits
            s.close(keep_weights=False)
            back = peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"base-{which}"),
                tmp_path / f"adapters-{which}")
            with torch.no_grad():
                assert torch.equal(back(input_ids=x).logits, trained)
        return losses, adapters, stats

    got, adapters, stats = run(True)
    want, want_adapters, _ = run(False)
    assert got == want
    assert adapters.keys() == want_adapters.keys() and adapters
    for k in adapters:
        assert torch.equal(adapters[k], want_adapters[k]), k
    assert stats["d2h_bytes"] == 0  # weights in only
    assert stats["h2d_bytes"] > 0


def test_generate_and_gradient_checkpointing_are_as_in_memory(daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        x = tokens(3)[:, :6]
        mask = torch.ones_like(x)
        got = model.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False,
                             pad_token_id=0)
        want = reference.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  pad_token_id=0)
        assert got.shape[1] == 16 and torch.equal(got, want)  # through the KV cache
        # Each of its 10 forwards fetched the 4 blocks, each but the first prefetched while the
        # one before computed; and none is left in the window.
        stats = s.stats
        assert stats["fetches"] == 40 and stats["on_demand"] == 10, stats
        assert stats["device_live_bytes"] == s.resident_bytes
        for m in (model, reference):  # transformers 5 for gradient_checkpointing_enable
            m.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
            m.train()
        assert train(model, daemon) == train(reference, daemon)
        assert s.stats["device_live_bytes"] == s.resident_bytes  # every recompute released
    finally:
        s.close()


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = tokens(i, n=1)[0]
        return {"input_ids": x, "labels": x}


def test_the_trainer_recipe_trains_clips_logs_and_saves_as_in_memory(daemon, tmp_path):  # noqa: F811,E501
    from tierd.torch.hf import Trainer
    ckpt = saved(tmp_path, "llama")

    def run(streamed):
        s = None
        if streamed:
            model = on_meta("llama")
            s = stream(model, daemon, checkpoint=str(ckpt))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
        opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        out = tmp_path / f"trainer-{streamed}"
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, max_steps=4, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, max_grad_norm=0.5, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens(),
                          optimizers=(opt, schedule))
        trainer.train()
        assert opt.max_grad_norm == 0.5  # the optimizer clips
        logs = [h for h in trainer.state.log_history if "loss" in h]
        trainer.save_model(str(out / "final"))
        opt.close()
        if s is not None:
            s.close(keep_weights=False)
        return ([h["loss"] for h in logs], [h["grad_norm"] for h in logs],
                transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict())

    losses, norms, weights = run(True)
    want_losses, want_norms, want_weights = run(False)
    assert losses == want_losses
    assert norms == want_norms and all(n > 0.5 for n in norms)  # before clipping, as Trainer's
    for k in want_weights:
        assert torch.equal(weights[k], want_weights[k]), k
    with pytest.raises(TypeError, match="OffloadedAdamW"):
        Trainer(model=build("llama"), args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "x"), report_to=[], use_cpu=True),
            optimizers=(torch.optim.AdamW(build("llama").parameters()), None))


# ---- checkpoints that are not what they should be ----

def _rewrite(path, change):
    tensors = safetensors_torch.load_file(path)
    change(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def _single(tmp_path):
    return saved(tmp_path, "llama", max_shard_size="1GB") / "model.safetensors"


def _missing_key(tmp_path):
    f = _single(tmp_path)
    _rewrite(f, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    return f, "no key 'model.layers.2.mlp.up_proj.weight'"


def _unexpected_key(tmp_path):
    f = _single(tmp_path)
    _rewrite(f, lambda t: t.update({"model.layers.9.extra": torch.zeros(2)}))
    return f, "key 'model.layers.9.extra' is not a parameter"


def _wrong_shape(tmp_path):
    f = _single(tmp_path)
    _rewrite(f, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    return f, r"key 'model.norm.weight' has shape \(31,\)"


def _wrong_dtype(tmp_path):
    f = _single(tmp_path)
    _rewrite(f, lambda t: t.update({"model.layers.0.input_layernorm.weight":
                                    torch.ones(32, dtype=torch.int32)}))
    return f, "key 'model.layers.0.input_layernorm.weight' is torch.int32"


def _truncated(tmp_path):
    f = _single(tmp_path)
    size = os.path.getsize(f)
    with open(f, "r+b") as h:
        h.truncate(size - 1000)
    return f, "not a readable safetensors file"


def _not_safetensors(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"PK\x03\x04 this is a zip file, not a checkpoint" * 10)
    return f, "not a readable safetensors file"


def _overlapping_offsets(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    raw = json.dumps(header).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(24))
    return f, "not a readable safetensors file"


def _index_names_a_missing_shard(tmp_path):
    d = saved(tmp_path, "llama")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    os.remove(d / shard)
    return d, f"is in the shard '{shard}', which is missing"


def _index_reaches_outside(tmp_path):
    d = saved(tmp_path, "llama")
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    path.write_text(json.dumps(index))
    return d, "which is not a file in the index's directory"


def _index_key_not_in_its_shard(tmp_path):
    d = saved(tmp_path, "llama")
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(
        s for s in shards if s != index["weight_map"]["model.norm.weight"])
    path.write_text(json.dumps(index))
    return d, "the index puts 'model.norm.weight' in this shard, which does not hold it"


def _no_checkpoint_there(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", "no model.safetensors and no model.safetensors.index.json"


# Special files, anywhere a checkpoint names a file: refused at once (a FIFO would block the
# reader forever), naming the path and what it is.

def _fifo_in_the_directory(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.mkfifo(d / "model.safetensors")
    return d, "model.safetensors: the checkpoint's file is a FIFO"


def _fifo_given_as_the_file(tmp_path):
    f = tmp_path / "model.safetensors"
    os.mkfifo(f)
    return f, "the checkpoint is a FIFO"


def _a_shard_is_a_fifo(tmp_path):
    d = saved(tmp_path, "llama")
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][
        "model.norm.weight"]
    os.remove(d / shard)
    os.mkfifo(d / shard)
    return d, f"{shard}: the shard of key '.*' is a FIFO"


def _a_shard_is_a_directory(tmp_path):
    d = saved(tmp_path, "llama")
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][
        "model.norm.weight"]
    os.remove(d / shard)
    os.mkdir(d / shard)
    return d, f"{shard}: the shard of key '.*' is a directory"


def _the_file_links_to_a_device(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink("/dev/zero", d / "model.safetensors")
    return d, "model.safetensors: the checkpoint's file is a character device"


def _the_index_is_a_socket(tmp_path):
    import socket
    d = tmp_path / "ckpt"
    d.mkdir()
    s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
    os.chdir(d)  # a socket's path is short: bound relative to its directory
    try:
        s.bind("model.safetensors.index.json")
    finally:
        os.chdir(cwd)
        s.close()
    return d, "model.safetensors.index.json: the checkpoint's index is a socket"


BAD = [_missing_key, _unexpected_key, _wrong_shape, _wrong_dtype, _truncated, _not_safetensors,
       _overlapping_offsets, _index_names_a_missing_shard, _index_reaches_outside,
       _index_key_not_in_its_shard, _no_checkpoint_there, _fifo_in_the_directory,
       _fifo_given_as_the_file, _a_shard_is_a_fifo, _a_shard_is_a_directory,
       _the_file_links_to_a_device, _the_index_is_a_socket]


@pytest.mark.parametrize("bad", BAD, ids=[b.__name__[1:] for b in BAD])
def test_a_bad_checkpoint_is_refused_naming_it_before_anything_is_written(
        daemon, tmp_path, bad):  # noqa: F811
    path, message = bad(tmp_path)
    model = on_meta("llama")
    before = host_bytes(daemon)
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        stream(model, daemon, checkpoint=str(path))
    assert re.search(message, str(refused.value)), str(refused.value)
    assert str(path.name) in str(refused.value) or str(path) in str(refused.value)
    assert host_bytes(daemon) == before, "a chunk was left behind"
    assert all(p.is_meta for p in model.parameters()), "the model was changed"
