"""tierd.torch.hf.Trainer against transformers' own Trainer with torch.optim.AdamW in memory: each
TrainingArguments knob that touches gradients, the optimizer, saving or resuming gives the same
losses, logged norms and weights, or is refused when the Trainer is made, naming it.

OffloadedAdamW's kernel evaluates AdamW's formula in another order than torch's (fp32 rounding,
docs/optimizer/kernels.md), so from the second step the two runs differ by that rounding only:
the first step's loss and logged norm are equal bit for bit (same weights, same gradients), the
rest within the tolerance test_torch_optimizer.py derives for one kernel against the other.
"""
import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (a fixture)
from test_pretrained import HYPER, VOCAB, _Tokens, on_meta, saved, safetensors_torch, stream, tokens

import tierd.torch  # noqa: E402 (test_pretrained puts python/ on the path)

transformers = pytest.importorskip("transformers")

TORCH_HYPER = dict(lr=HYPER["lr"], betas=HYPER["betas"], weight_decay=HYPER["weight_decay"])


def _args(out, **kwargs):
    options = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=3,
                   logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                   max_grad_norm=0.5, lr_scheduler_type="constant")
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


def _logged(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def _tierd_run(ckpt, out, daemon, **kwargs):  # noqa: F811
    from tierd.torch.hf import Trainer
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt))
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
    try:
        trainer = Trainer(model=model, args=_args(out, **kwargs), train_dataset=_Tokens(),
                          eval_dataset=_Tokens(), optimizers=(opt, None))
        trainer.train()
        trainer.save_model(str(out / "final"))
        return trainer, opt.accumulation_steps
    finally:
        opt.close()
        s.close(keep_weights=False)


def _torch_run(ckpt, out, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    opt = torch.optim.AdamW(model.parameters(), **TORCH_HYPER)
    trainer = transformers.Trainer(model=model, args=_args(out, **kwargs),
                                   train_dataset=_Tokens(), eval_dataset=_Tokens(),
                                   optimizers=(opt, None))
    trainer.train()
    trainer.save_model(str(out / "final"))
    return trainer


def _assert_same_training(got, want, got_dir, want_dir):
    losses, norms = _logged(got)
    want_losses, want_norms = _logged(want)
    assert len(losses) == len(want_losses) > 1
    assert losses[0] == want_losses[0] and norms[0] == want_norms[0]  # before any update
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5,
                               atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-4, atol=0)
    a = transformers.AutoModelForCausalLM.from_pretrained(got_dir).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(want_dir).state_dict()
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_gradient_accumulation_trains_on_every_micro_batch_as_transformers_does(
        daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    got, accumulation = _tierd_run(ckpt, tmp_path / "tierd", daemon,
                                   gradient_accumulation_steps=2)
    assert accumulation == 2  # given to the optimizer
    want = _torch_run(ckpt, tmp_path / "torch", gradient_accumulation_steps=2)
    _assert_same_training(got, want, tmp_path / "tierd" / "final", tmp_path / "torch" / "final")


# Each knob beside transformers' Trainer: the scheduler kinds (Trainer makes the schedule on the
# optimizer given), bf16 autocast, activation checkpointing (transformers 5's default,
# use_reentrant=False), checkpoints every step with a limit, evaluation during training.
KNOBS = {
    "linear-warmup": dict(lr_scheduler_type="linear", warmup_steps=1),
    "cosine": dict(lr_scheduler_type="cosine"),
    "bf16": dict(bf16=True),
    "activation-checkpointing": dict(activation_checkpointing=True),
    "save-steps": dict(save_strategy="steps", save_steps=1, save_total_limit=2),
    "eval-steps": dict(eval_strategy="steps", eval_steps=1),
}


@pytest.mark.parametrize("knob", list(KNOBS))
def test_each_knob_trains_as_transformers_trainer_does(daemon, tmp_path, knob):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    got, _ = _tierd_run(ckpt, tmp_path / "tierd", daemon, **KNOBS[knob])
    want = _torch_run(ckpt, tmp_path / "torch", **KNOBS[knob])
    _assert_same_training(got, want, tmp_path / "tierd" / "final", tmp_path / "torch" / "final")
    if knob == "save-steps":  # the last two checkpoints kept, each with what Trainer writes
        kept = sorted(p.name for p in (tmp_path / "tierd").glob("checkpoint-*"))
        assert kept == sorted(p.name for p in (tmp_path / "torch").glob("checkpoint-*"))
        assert kept == ["checkpoint-2", "checkpoint-3"]
        for name in kept:
            a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tierd" / name)
            b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "torch" / name)
            for k, v in b.state_dict().items():
                torch.testing.assert_close(a.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=k)
            assert (tmp_path / "tierd" / name / "optimizer.pt").exists()
    if knob == "eval-steps":
        evals = [h["eval_loss"] for h in got.state.log_history if "eval_loss" in h]
        want_evals = [h["eval_loss"] for h in want.state.log_history if "eval_loss" in h]
        assert len(evals) == len(want_evals) == 3
        torch.testing.assert_close(torch.tensor(evals), torch.tensor(want_evals), rtol=1e-5,
                                   atol=0)


REFUSED = {
    "torch_compile": dict(torch_compile=True),
    "load_best_model_at_end": dict(load_best_model_at_end=True, eval_strategy="steps",
                                   save_strategy="steps"),
    "activation_checkpointing_kwargs": dict(activation_checkpointing=True,
                               activation_checkpointing_kwargs={"use_reentrant": True}),
}


@pytest.mark.parametrize("knob", list(REFUSED))
def test_a_knob_it_cannot_honour_is_refused_naming_it(daemon, tmp_path, knob):  # noqa: F811
    from tierd.torch.hf import Trainer
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(saved(tmp_path, "llama")))
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
    try:
        with pytest.raises(ValueError, match=f"TrainingArguments.{knob}"):
            Trainer(model=model, args=_args(tmp_path / "out", **REFUSED[knob]),
                    train_dataset=_Tokens(), eval_dataset=_Tokens(), optimizers=(opt, None))
    finally:
        opt.close()
        s.close(keep_weights=False)


def test_resuming_a_streamed_model_goes_on_as_the_run_that_was_not_stopped(daemon, tmp_path):  # noqa: F811,E501
    """train(resume_from_checkpoint=...) loads the checkpoint's weights into the streamed model
    (through the stream: load_state_dict) and its optimizer state, and the last steps are those
    of the run that was not stopped, bit for bit (it died of SIGSEGV inside load_state_dict)."""
    ckpt = saved(tmp_path, "llama")
    whole, _ = _tierd_run(ckpt, tmp_path / "whole", daemon, max_steps=4, save_strategy="steps",
                          save_steps=2)
    from tierd.torch.hf import Trainer
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt))
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
    try:
        trainer = Trainer(model=model, args=_args(tmp_path / "again", max_steps=4),
                          train_dataset=_Tokens(), optimizers=(opt, None))
        trainer.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
        trainer.save_model(str(tmp_path / "again" / "final"))
    finally:
        opt.close()
        s.close(keep_weights=False)
    assert trainer.state.global_step == 4
    assert _logged(trainer) == _logged(whole)  # the first two logs are the checkpoint's
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again" / "final")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "final")
    for k, v in b.state_dict().items():
        assert torch.equal(a.state_dict()[k], v), k


def test_an_accumulation_the_optimizer_was_given_otherwise_is_refused(daemon, tmp_path):  # noqa: F811,E501
    from tierd.torch.hf import Trainer
    model = transformers.AutoModelForCausalLM.from_pretrained(saved(tmp_path, "llama"))
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon,
                                     **dict(HYPER, accumulation_steps=4))
    try:
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=2),
                    train_dataset=_Tokens(), optimizers=(opt, None))
    finally:
        opt.close()


def test_more_backward_passes_than_accumulation_steps_raise_instead_of_dropping_gradients(
        daemon, tmp_path):  # noqa: F811
    model = transformers.AutoModelForCausalLM.from_pretrained(saved(tmp_path, "llama"))
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
    try:
        x = tokens(0)
        model(input_ids=x, labels=x).loss.backward()
        with pytest.raises(RuntimeError, match="accumulation_steps is 1"):
            model(input_ids=x, labels=x).loss.backward()
    finally:
        opt.close()


FIGURES = {"tierd/nvme_read_bytes", "tierd/nvme_written_bytes", "tierd/host_tier_used_bytes",
           "tierd/weights_wait_s", "tierd/h2d_bytes", "tierd/d2h_bytes",
           "tierd/optimizer_tail_s", "tierd/optimizer_state_wait_s"}


def test_each_log_carries_tierds_figures_of_its_steps(daemon, tmp_path):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    got, _ = _tierd_run(ckpt, tmp_path / "tierd", daemon, max_steps=4, logging_steps=2)
    logs = [h for h in got.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [2, 4]
    for h in logs:
        assert FIGURES <= h.keys()
        assert h["tierd/h2d_bytes"] > 0 and h["tierd/d2h_bytes"] > 0  # every block, each step
        assert h["tierd/host_tier_used_bytes"] > 0
    # Only the training logs: the summary at the end has no steps of its own.
    assert not FIGURES & [h for h in got.state.log_history if "train_runtime" in h][0].keys()


class _Recorder(transformers.TrainerCallback):
    """What a report_to integration is given: each log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_log_figures_gives_any_trainer_and_its_reporters_them(daemon, tmp_path):  # noqa: F811
    from tierd.torch.hf import log_figures
    ckpt = saved(tmp_path, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)  # in memory, not streamed
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, lr=1e-3)
    recorder = _Recorder()
    try:
        trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_grad_norm=0),
                                       train_dataset=_Tokens(), optimizers=(opt, None),
                                       callbacks=[recorder])
        log_figures(trainer)
        trainer.train()
    finally:
        opt.close()
    unstreamed = FIGURES - {"tierd/weights_wait_s", "tierd/h2d_bytes", "tierd/d2h_bytes"}
    history = [h for h in trainer.state.log_history if "loss" in h]
    reported = [h for h in recorder.logs if "loss" in h]
    assert len(history) == len(reported) == 3
    for h, r in zip(history, reported):
        assert h.keys() - {"step"} == r.keys()
        assert unstreamed <= r.keys() and not (FIGURES - unstreamed) & r.keys()


def test_the_optimizer_made_from_the_training_arguments_is_torchs_adamw_offloaded(
        daemon, tmp_path):  # noqa: F811
    """No optimizers=: the Trainer makes OffloadedAdamW from the TrainingArguments as
    transformers makes torch's AdamW from them (lr, betas, eps, weight decay and its parameter
    groups), with optimizer_options for the rest; another `optim` is refused, naming it."""
    from tierd.torch.hf import Trainer
    ckpt = saved(tmp_path, "llama")
    knobs = dict(learning_rate=1e-3, adam_beta2=0.95, weight_decay=0.1)
    want = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(ckpt),
                                args=_args(tmp_path / "torch", **knobs), train_dataset=_Tokens())
    want.train()
    want.save_model(str(tmp_path / "torch" / "final"))
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        got = Trainer(model=model, args=_args(tmp_path / "tierd", **knobs),
                      train_dataset=_Tokens(), optimizer_options=dict(
                          socket_dir=daemon, threads=2, home="host", host_budget_bytes=1 << 20,
                          overlap_backward=True))
        got.train()
        got.save_model(str(tmp_path / "tierd" / "final"))
        opt = got.optimizer.optimizer  # inside accelerate's wrapper
        assert isinstance(opt, tierd.torch.OffloadedAdamW) and opt.overlap_backward
        assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups] == \
            [(1e-3, (0.9, 0.95), 0.1), (1e-3, (0.9, 0.95), 0.0)]
        opt.close()
    finally:
        s.close(keep_weights=False)
    _assert_same_training(got, want, tmp_path / "tierd" / "final", tmp_path / "torch" / "final")
    with pytest.raises(ValueError, match="TrainingArguments.optim='sgd'"):
        Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(ckpt),
                args=_args(tmp_path / "sgd", optim="sgd"), train_dataset=_Tokens()).train()
    with pytest.raises(TypeError, match="not a subclass of transformers.Trainer"):
        tierd.torch.hf.offloaded(torch.optim.AdamW)


def _words(n: int = 24):
    """A dataset of short texts over a word-level tokenizer made here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    datasets = pytest.importorskip("datasets")
    words = [f"w{i}" for i in range(VOCAB - 4)]
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<s>", "</s>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>")
    g = torch.Generator().manual_seed(3)
    texts = [" ".join(words[int(j)] for j in torch.randint(0, len(words), (int(k),),
                                                           generator=g))
             for k in torch.randint(6, 20, (n,), generator=g)]
    return datasets.Dataset.from_dict({"text": texts}), tokenizer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trl_sft_trainer_streamed_trains_as_in_memory(daemon, tmp_path, lora):  # noqa: F811
    """TRL's SFTTrainer, with its own defaults (bf16 autocast, activation checkpointing, its
    data preparation) but a short run, on a model streamed from its checkpoint with the optimizer
    made by offloaded(SFTTrainer) — and with LoRA from a peft_config — gives the losses and the
    saved weights (adapters) of SFTTrainer on the model in memory with torch's AdamW."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from tierd.torch.hf import offloaded
    ckpt = saved(tmp_path, "llama")
    data, tokenizer = _words()

    def config(out):
        return trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, learning_rate=1e-3, max_length=32)

    def extra():
        return dict(peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])) \
            if lora else {}
    want = trl.SFTTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(ckpt),
                          args=config(tmp_path / "torch"), train_dataset=data,
                          processing_class=tokenizer, **extra())
    want.train()
    want.save_model(str(tmp_path / "torch" / "final"))
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        got = offloaded(trl.SFTTrainer)(
            model=model, args=config(tmp_path / "tierd"), train_dataset=data,
            processing_class=tokenizer, optimizer_options=dict(
                socket_dir=daemon, threads=2, home="host", host_budget_bytes=1 << 20,
                overlap_backward=True), **extra())
        got.train()
        got.save_model(str(tmp_path / "tierd" / "final"))
        got.optimizer.optimizer.close()
    finally:
        s.close(keep_weights=False)
    losses, _ = _logged(got)
    want_losses, _ = _logged(want)
    assert len(losses) == len(want_losses) == 3
    assert losses[0] == want_losses[0]  # before any update
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5,
                               atol=0)
    if not lora:
        _assert_same_training(got, want, tmp_path / "tierd" / "final",
                              tmp_path / "torch" / "final")
        return
    a = safetensors_torch.load_file(tmp_path / "tierd" / "final" / "adapter_model.safetensors")
    b = safetensors_torch.load_file(tmp_path / "torch" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(b) == 16  # q and v, A and B, in 4 blocks
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
