"""One copy per node: a frozen base streamed from one read-only set of chunks that every job on the
node opens by name (docs/streaming.md, "One copy per node").

Each job is its own daemon session, as it is its own process in use; the kill and the other-user
cases run real processes. Small configs, random initialisation, no download.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest
import torch

from test_c_abi import daemon, start_daemon, stop_daemon  # noqa: F401 (daemon: a fixture)
from test_pretrained import HYPER, on_meta, saved, stream, tokens

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd.torch  # noqa: E402
from tierd.client import Access, Tier, TierdError, connect  # noqa: E402
from tierd._abi import Status  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def tierctl_json(daemon_dir, *args):  # noqa: F811
    r = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon_dir}", "--json", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def tierd_bases(daemon_dir):  # noqa: F811
    return tierctl_json(daemon_dir, "bases")


def host_used(daemon_dir):  # noqa: F811
    with connect(daemon_dir, "probe") as c:
        return c.tier_usage(Tier.HOST).used_bytes


class Job:
    """One LoRA fine-tuning job: a llama built on meta, streamed from its checkpoint (or opening
    the shared base), peft's adapters, OffloadedAdamW over them."""

    def __init__(self, daemon_dir, ckpt, seed, **stream_options):  # noqa: F811
        self.seed = seed
        self.model = on_meta("llama")
        self.stream = stream(self.model, daemon_dir, checkpoint=str(ckpt), **stream_options)
        torch.manual_seed(seed)  # the adapters' initialisation
        self.model = peft.get_peft_model(self.model, peft.LoraConfig(**LORA))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = tierd.torch.OffloadedAdamW(params, socket_dir=daemon_dir, **HYPER)
        self.losses = []

    def step(self, k):
        x = tokens(100 * self.seed + k)
        loss = self.model(input_ids=x, labels=x).loss
        self.losses.append(loss.item())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def adapters(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items() if "lora" in k}

    def close(self):
        self.opt.close()
        self.stream.close()


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_two_lora_jobs_on_one_shared_base_each_train_as_alone(daemon, tmp_path, home):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    budget = dict(host_budget_bytes=None if home == "host" else 0)
    alone = {}
    for seed in (1, 2):
        job = Job(daemon, ckpt, seed, **budget)
        for k in range(4):
            job.step(k)
        alone[seed] = (job.losses, job.adapters())
        job.close()

    before = host_used(daemon)
    a = Job(daemon, ckpt, 1, shared_base=f"llama-test@{home}", **budget)
    with_one = host_used(daemon) - before
    b = Job(daemon, ckpt, 2, shared_base=f"llama-test@{home}", **budget)
    with_two = host_used(daemon) - before
    try:
        listed = tierctl_json(daemon, "bases")
        assert [x["name"] for x in listed] == [f"llama-test@{home}"]
        assert len(listed[0]["holders"]) == 2 and listed[0]["sealed"]
        base_bytes = listed[0]["bytes"]
        if home == "host":  # the second job adds its own small chunks, not a second base
            assert with_one >= base_bytes and with_two - with_one < base_bytes
        for k in range(4):  # interleaved, as two jobs on one node run
            a.step(k)
            b.step(k)
        for job in (a, b):
            losses, adapters = alone[job.seed]
            assert job.losses == losses
            got = job.adapters()
            assert all(torch.equal(got[k], adapters[k]) for k in adapters)
    finally:
        a.close()
        b.close()
    assert tierctl_json(daemon, "bases") == []  # gone with its last holder


def test_the_base_is_read_only_for_a_job_that_opens_it(daemon, tmp_path):  # noqa: F811
    """Another process that maps the base and writes to it faults; the bytes stay, the daemon
    serves on."""
    ckpt = saved(tmp_path, "llama")
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt), shared_base="ro@1")
    try:
        with s.gathered():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        python = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {python!r})
            from tierd.client import Access, Tier, TierdError, connect
            from tierd._abi import Status
            c = connect({daemon!r}, "scribbler")
            base = c.open_base("ro@1")
            try:
                c.acquire(base.ids[:1], Tier.HOST, Access.WRITE)
                print("write acquired")
            except TierdError as e:
                print("refused:", Status(e.code).name, flush=True)
            held = c.acquire(base.ids[:1], Tier.HOST, Access.READ)
            held.memoryview(0)[0] = 7  # mapped read-only: this faults
            print("wrote")
            """)
        asan = os.environ.get("ASAN_OPTIONS", "")  # let the fault kill it under a sanitizer too
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, ASAN_OPTIONS=asan + ":handle_segv=0"))
        assert "refused: PERMISSION_DENIED" in r.stdout, r.stdout + r.stderr
        assert r.returncode == -signal.SIGSEGV, r.stdout + r.stderr
        with s.gathered():
            after = dict(model.named_parameters())
            assert all(torch.equal(after[n], before[n]) for n in before)
        x = tokens(0)
        with torch.no_grad():
            model(input_ids=x)  # the stream still reads it
        assert len(tierctl_json(daemon, "bases")[0]["holders"]) == 1  # the scribbler's went
    finally:
        s.close()


def test_a_base_of_another_layout_or_other_weights_is_refused_and_left_as_it_is(
        daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    other = saved(tmp_path, "llama", name="fine-tuned", seed=1)  # the same layout, other weights
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt), shared_base="m@1")
    try:
        with s.gathered():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match="another model's layout"):
            stream(transformers.AutoModelForCausalLM.from_config(
                transformers.LlamaConfig(hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128)),
                daemon, shared_base="m@1")
        with pytest.raises(ValueError, match="needs checkpoint="):
            stream(on_meta("llama"), daemon, shared_base="m@1")
        with pytest.raises(ValueError, match="not from this checkpoint"):
            stream(on_meta("llama"), daemon, checkpoint=str(other), shared_base="m@1")
        torch.manual_seed(5)
        in_memory = transformers.AutoModelForCausalLM.from_config(model.config)
        with pytest.raises(ValueError, match="other weights"):
            stream(in_memory, daemon, shared_base="m@1")
        # The same weights in memory, and a model on meta with the same checkpoint, open it.
        same = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
        t = stream(same, daemon, shared_base="m@1")
        u = stream(on_meta("llama"), daemon, checkpoint=str(ckpt), shared_base="m@1")
        listed = tierctl_json(daemon, "bases")
        assert len(listed) == 1 and len(listed[0]["holders"]) == 3
        x = tokens(3)
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, u.model(input_ids=x).logits)
        t.close()
        u.close()
        with s.gathered():
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        s.close()
    assert tierd_bases(daemon) == []


def _wide(tmp_path, name, change=None):
    """A checkpoint of a llama whose blocks' tensors are over 8 KiB (the digest samples 4 KiB at
    each end of a tensor); `change` edits its state_dict before saving."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        tie_word_embeddings=False))
    if change is not None:
        with torch.no_grad():
            change(model.state_dict())
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model.config


def test_a_checkpoint_that_differs_only_mid_tensor_never_steps_nor_shows_an_output(daemon, tmp_path):  # noqa: F811,E501
    """The base's maker records a SHA-256 of every byte it wrote; an opener checks every byte of
    its own checkpoint against it. A fine-tune that differs from the base's checkpoint only in
    the middle of a tensor (where the digest's samples do not look) was opened, and trained on
    the base's weights without a word. The check runs while the job starts: its forward and
    backward go on, and then every optimizer step, forward without gradients, gathered() and
    save_pretrained() raises, each time, having changed nothing."""
    ckpt, config = _wide(tmp_path, "genuine")

    def middle(sd):
        w = sd["model.layers.1.mlp.up_proj.weight"]
        w.view(-1)[w.numel() // 2] += 0.25
    other, _ = _wide(tmp_path, "mid-tensor", middle)

    def meta():
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    refused = "holds other weights than this checkpoint's"
    s = stream(meta(), daemon, checkpoint=str(ckpt), shared_base="wide@1")
    try:
        model = meta()
        t = stream(model, daemon, checkpoint=str(other), shared_base="wide@1")
        try:
            torch.manual_seed(1)
            model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
            adapters = [p for p in model.parameters() if p.requires_grad]
            before = [p.detach().clone() for p in adapters]
            x = tokens(0)
            model(input_ids=x, labels=x).loss.backward()
            for opt in (torch.optim.AdamW(adapters, lr=1e-2),
                        tierd.torch.OffloadedAdamW(adapters, socket_dir=daemon, lr=1e-2)):
                for _ in range(2):
                    with pytest.raises(ValueError, match=refused):
                        opt.step()
            assert all(torch.equal(p, b) for p, b in zip(adapters, before))
            for _ in range(2):
                with torch.no_grad(), pytest.raises(ValueError, match=refused):
                    model(input_ids=x)
            with pytest.raises(ValueError, match=refused):
                with t.gathered():
                    pass
            with pytest.raises(ValueError, match=refused):
                t.save_pretrained(str(tmp_path / "saved"))
            assert not (tmp_path / "saved").exists()
            with pytest.warns(RuntimeWarning, match=refused):
                t.close(keep_weights=True)  # the base's weights are not handed back as its own
            streamed = [p for p in t.model.model.layers.parameters() if not p.requires_grad]
            assert streamed and all(p.untyped_storage().nbytes() == 0 for p in streamed)
        finally:
            t.close()
        q = torch.nn.Parameter(torch.zeros(2))  # closed, it holds no other optimizer back
        q.grad = torch.ones(2)
        torch.optim.SGD([q], lr=1.0).step()
        assert q.tolist() == [-1.0, -1.0]

        # The base's own checkpoint opens, and steps and evaluates as the maker does.
        model = meta()
        u = stream(model, daemon, checkpoint=str(ckpt), shared_base="wide@1")
        try:
            with torch.no_grad():
                assert torch.equal(model(input_ids=x).logits, s.model(input_ids=x).logits)
            assert u.stats["base_check_wait_s"] >= 0
            q.grad = torch.ones(2)
            torch.optim.SGD([q], lr=1.0).step()
        finally:
            u.close()
    finally:
        s.close()


def test_closing_a_job_ends_its_base_check_and_its_files(daemon, tmp_path):  # noqa: F811
    """Closing a stream ends the check of its checkpoint (stopped at the next tensor when it is
    still reading) and closes the check's descriptors: nothing is left running or open."""
    ckpt, config = _wide(tmp_path, "genuine")
    with torch.device("meta"):
        maker = transformers.AutoModelForCausalLM.from_config(config)
    s = stream(maker, daemon, checkpoint=str(ckpt), shared_base="closed@1")

    def open_files():  # this process's descriptors of the checkpoint's files
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass  # the listing's own
        return [f for f in out if f.startswith(str(ckpt))]
    try:
        assert open_files() == []
        for _ in range(3):
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
            stream(model, daemon, checkpoint=str(ckpt), shared_base="closed@1").close()
        assert not [t for t in threading.enumerate() if t.name.startswith("tierd base check")]
        assert open_files() == []
    finally:
        s.close()


def test_a_frozen_base_parameter_cannot_be_trained(daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt), shared_base="frozen@1")
    try:
        streamed = [p for n, p in model.named_parameters() if ".layers." in n]
        assert streamed and not any(p.requires_grad for p in streamed)
        # Given to the optimizer frozen: left out, as torch leaves a parameter without gradient.
        opt = tierd.torch.OffloadedAdamW(list(model.parameters()), socket_dir=daemon, **HYPER)
        x = tokens(0)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.close()
        streamed[0].requires_grad_(True)
        with pytest.raises(ValueError, match="read-only"):
            tierd.torch.OffloadedAdamW(streamed[:1], socket_dir=daemon, **HYPER)
        with pytest.raises(RuntimeError, match="shared base"):
            model(input_ids=x, labels=x).loss.backward()
        streamed[0].requires_grad_(False)
        streamed[0].grad = None
        with pytest.raises(RuntimeError, match="read-only"):
            with s.gathered():
                with torch.no_grad():
                    streamed[0].add_(1.0)
        with s.gathered():  # left as it was
            assert torch.isfinite(streamed[0]).all()
    finally:
        s.close()


HOLDER = """
import os, sys, time
sys.path.insert(0, {python!r}); sys.path.insert(0, {tests!r})
from test_pretrained import on_meta, stream
s = stream(on_meta("llama"), {daemon!r}, checkpoint={ckpt!r}, shared_base="held@1")
print("holding", flush=True)
time.sleep(600)
"""


def test_a_killed_job_lets_go_of_the_base_and_the_others_keep_it(daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    here = os.path.dirname(os.path.abspath(__file__))
    script = HOLDER.format(python=os.path.join(here, "..", "..", "python"), tests=here,
                           daemon=daemon, ckpt=str(ckpt))
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        model = on_meta("llama")
        s = stream(model, daemon, checkpoint=str(ckpt), shared_base="held@1")
        assert len(tierctl_json(daemon, "bases")[0]["holders"]) == 2
        holder.kill()  # made it, and dies holding it
        holder.wait(timeout=30)
        listed = tierctl_json(daemon, "bases")
        assert len(listed) == 1 and len(listed[0]["holders"]) == 1
        x = tokens(1)
        with torch.no_grad():
            model(input_ids=x)
        # Pinned, it outlives its last job.
        subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon}", "bases", "pin",
                        "held@1"], check=True, capture_output=True)
        s.close()
        listed = tierctl_json(daemon, "bases")
        assert listed[0]["pinned"] and listed[0]["holders"] == []
        t = stream(on_meta("llama"), daemon, checkpoint=str(ckpt), shared_base="held@1")
        t.close()
        subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon}", "bases", "unpin",
                        "held@1"], check=True, capture_output=True)
        assert tierctl_json(daemon, "bases") == []
    finally:
        holder.kill()
        holder.wait()


def _kit_for_another_user(root):
    """The package's core and the library where another user can read them (a checkout or the
    virtual environment may be in root's home); the system's interpreter runs them. Returns the
    folder to put on sys.path and the library's path."""
    kit = os.path.join(root, "kit")
    package = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python",
                           "tierd")
    os.makedirs(os.path.join(kit, "tierd"))
    for f in os.listdir(package):  # the package's modules, without tierd.torch
        if f.endswith(".py"):
            shutil.copy(os.path.join(package, f), os.path.join(kit, "tierd", f))
    lib = shutil.copy(os.environ["TIERD_CLIENT_LIB"], kit)
    for d, _, files in os.walk(kit):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o755)
    return kit, lib


OTHER_USER = """
import sys
sys.path.insert(0, {python!r})
from tierd.client import Access, Tier, TierdError, connect
from tierd._abi import Status
c = connect({daemon!r}, "other user")
for name in ("team@1", "private@1"):
    try:
        base = c.open_base(name)
        with c.acquire(base.ids, Tier.HOST, Access.READ) as held:
            print(name, "read", bytes(held.memoryview(0)[:4]).hex(), flush=True)
    except TierdError as e:
        print(name, Status(e.code).name, flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another user")
def test_another_user_opens_a_base_only_when_it_is_shared_with_a_group_it_is_in():
    group = 4242  # a gid nobody else uses; the daemon takes it by number
    root = tempfile.mkdtemp(prefix="tierd-bases-")
    os.chmod(root, 0o755)  # the other user reaches the sockets inside
    proc = start_daemon(root, f"--socket_group={group}", f"--base_groups={group}")
    try:
        os.chown(root, 0, 0)
        with connect(root, "maker") as c:
            for name, shared in (("team@1", group), ("private@1", None)):
                base = c.open_base(name, [4096], [Tier.HOST], b"d", shared)
                with c.acquire(base.ids, Tier.HOST, Access.OVERWRITE) as held:
                    held.memoryview(0)[:4] = b"\x01\x02\x03\x04"
                c.seal_base(name)
            kit, lib = _kit_for_another_user(root)
            script = OTHER_USER.format(python=kit, daemon=root)

            def as_nobody():
                os.setgroups([])
                os.setgid(group)
                os.setuid(65534)
            r = subprocess.run([getattr(sys, "_base_executable", sys.executable), "-c", script],
                               capture_output=True, text=True, timeout=60, preexec_fn=as_nobody,
                               env=dict(os.environ, TIERD_CLIENT_LIB=lib))
            assert r.returncode == 0, r.stdout + r.stderr
            assert "team@1 read 01020304" in r.stdout, r.stdout
            assert "private@1 PERMISSION_DENIED" in r.stdout, r.stdout
            with pytest.raises(TierdError) as refused:  # a group the operator did not name
                c.open_base("other-group@1", [4096], [Tier.HOST], b"d", 4343)
            assert refused.value.code == Status.PERMISSION_DENIED
    finally:
        stop_daemon(proc, root)
        shutil.rmtree(root, ignore_errors=True)


IMPOSTOR = """
import sys
sys.path.insert(0, {python!r})
from tierd.client import Access, Tier, connect
c = connect({daemon!r}, "impostor")
# Another model's bytes under a copy of the genuine base's chunks and descriptor.
base = c.open_base("look-alike@1", {sizes!r}, [Tier.HOST] * {n}, bytes.fromhex({descriptor!r}),
                   {group})
for i, size in enumerate({sizes!r}):
    with c.acquire([base.ids[i]], Tier.HOST, Access.OVERWRITE) as held:
        held.memoryview(0)[:size] = bytes([7]) * size
c.seal_base("look-alike@1")
print("made", flush=True)
import time
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another user")
def test_a_base_another_user_made_opens_only_when_its_maker_is_trusted(tmp_path):
    """A group member publishes other bytes under a copy of a genuine base's descriptor: a job
    holding the genuine checkpoint opened it and computed other logits. A base made by another
    user is now refused unless the job names its maker in trust_base_makers."""
    group = 4243
    root = tempfile.mkdtemp(prefix="tierd-bases-")
    os.chmod(root, 0o755)
    proc = start_daemon(root, f"--socket_group={group}", f"--base_groups={group}")
    impostor = None
    try:
        os.chown(root, 0, 0)
        ckpt = saved(tmp_path, "llama")
        genuine = stream(on_meta("llama"), root, checkpoint=str(ckpt), shared_base="real@1",
                         host_budget_bytes=None)
        with connect(root, "reader") as c:
            opened = c.open_base("real@1")
            sizes, descriptor = list(opened.sizes), opened.descriptor
            c.release_base("real@1")
        genuine.close()
        kit, lib = _kit_for_another_user(root)

        def as_nobody():
            os.setgroups([])
            os.setgid(group)
            os.setuid(65534)
        script = IMPOSTOR.format(python=kit, daemon=root, sizes=sizes, n=len(sizes),
                                 descriptor=descriptor.hex(), group=group)
        impostor = subprocess.Popen([getattr(sys, "_base_executable", sys.executable), "-c",
                                     script], stdout=subprocess.PIPE, text=True,
                                    preexec_fn=as_nobody, env=dict(os.environ,
                                                                   TIERD_CLIENT_LIB=lib))
        assert impostor.stdout.readline().strip() == "made"
        with pytest.raises(PermissionError, match="made by nobody .uid 65534., whom this job "
                                                  "does not trust"):
            stream(on_meta("llama"), root, checkpoint=str(ckpt), shared_base="look-alike@1")
        # Named as trusted, it opens: the user's own choice (its descriptor is taken as said).
        trusted = stream(on_meta("llama"), root, checkpoint=str(ckpt),
                         shared_base="look-alike@1", trust_base_makers=["nobody"])
        trusted.close()
    finally:
        if impostor is not None:
            impostor.kill()
            impostor.wait()
        stop_daemon(proc, root)
        shutil.rmtree(root, ignore_errors=True)
