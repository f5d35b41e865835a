"""transformers' Trainer with OffloadedAdamW and a streamed model: the recipe, as a class.

    from tierd.torch.hf import Trainer
    stream = tierd.torch.stream_parameters(model, checkpoint=path, device_budget_bytes=...)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=2e-5, overlap_backward=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(opt, get_linear_schedule_with_warmup(opt, 100, 1000)))
    trainer.train()

Without `optimizers`, the Trainer makes OffloadedAdamW from the TrainingArguments as transformers
makes torch's AdamW from them (optimizer_options= gives it the rest: socket_dir, overlap_backward,
home, ...), after the model is final: so a peft_config that a Trainer applies itself (TRL's
SFTTrainer) trains the adapters. offloaded(SFTTrainer) is any Trainer subclass made to do all this:

    trainer = offloaded(trl.SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=data,
                                        peft_config=lora, optimizer_options=dict(...))

What it changes of transformers.Trainer, and why:

- Clipping. Trainer clips with clip_grad_norm_ over the parameters' .grad before step(); with
  overlap_backward (and always for streamed parameters) the gradients have left the device by
  then, so that would clip, and report, the norm of what is left. Here `args.max_grad_norm` is
  given to the optimizer, which clips exactly as clip_grad_norm_ would, over every gradient; the
  logged grad_norm is the optimizer's (none is logged when the optimizer computes none), its
  gradients' norms summed in the model's parameter order, as clip_grad_norm_ sums them.
- Gradient accumulation. With overlap_backward a bucket is stepped once its gradients of
  `accumulation_steps` backward passes are in: `args.gradient_accumulation_steps` is given to the
  optimizer (a different value set on both is refused).
- Saving. The weights of a streamed model are in the daemon, not in its parameters: a
  checkpoint or save_model() writes them with the stream's save_pretrained(). A PEFT model saves
  its adapters as Trainer does (they are not streamed).
- Logs. Each log gets tierd's figures of the steps since the one before (tierd.torch.StepFigures:
  NVMe bytes, the host tier in use, the wait for streamed weights, the optimizer's tail), under
  "tierd/", in the log history and in every report_to integration. log_figures(trainer) adds them
  to any other Trainer.

Imports transformers (the rest of tierd.torch does not).
"""
import logging
import os
from typing import Dict, Optional

import torch
import transformers

from .._errors import InvalidArgument, InvalidType
from ._ddp import DDPIgnored
from ._step_figures import StepFigures, stream_of_params
from .optimizer import OffloadedAdamW
from .streaming import stream_of

__all__ = ["Figures", "Trainer", "log_figures", "offloaded"]

log = logging.getLogger(__name__)


class _Norm(transformers.TrainerCallback):
    """Fills the step's grad_norm once the optimizer has computed it."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        norm, self.trainer._pending_norm = self.trainer._pending_norm, None
        opt = self.trainer._offloaded
        if norm is not None and opt.last_grad_norm is not None:
            norm.fill_(opt.last_grad_norm)


class Figures(transformers.TrainerCallback):
    """Adds tierd's figures to each log of a Trainer whose optimizer is an OffloadedAdamW: the
    means of each step's StepFigures since the last log, in the log history and in the logs the
    callbacks after it are given (log_figures() puts it before the report_to integrations)."""

    def __init__(self):
        self._figures: Optional[StepFigures] = None
        self._sums: Dict[str, float] = {}
        self._steps = 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._sums, self._steps = {}, 0
        if self._figures is None:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
            if isinstance(inner, OffloadedAdamW):
                self._figures = StepFigures(inner)

    def on_step_end(self, args, state, control, **kwargs):
        if self._figures is None:
            return
        got = self._figures.take()
        if got:
            for k, v in got.items():
                self._sums[k] = self._sums.get(k, 0.0) + v
            self._steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._steps or logs is None:
            return
        means = {k: v / self._steps for k, v in self._sums.items()}
        self._sums, self._steps = {}, 0
        # Trainer.log() put a copy of `logs` (with the step) in the history just before.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and all(last.get(k) == v for k, v in logs.items()):
            last.update(means)
        logs.update(means)

    def on_train_end(self, args, state, control, **kwargs):
        if self._figures is not None:
            self._figures.close()
            self._figures = None


def log_figures(trainer: transformers.Trainer) -> Figures:
    """Adds tierd's figures to `trainer`'s logs (Figures), first among its callbacks, so that
    TensorBoard, Weights & Biases and the other report_to integrations log them too."""
    figures = Figures()
    trainer.callback_handler.callbacks.insert(0, figures)
    return figures


def _stream_of_model(model):
    """The stream that streams the model's parameters, if any."""
    return stream_of_params(model.parameters())


def _refuse(args, streamed: bool, who: str) -> None:
    """Refuses, naming the field, each TrainingArguments knob this Trainer cannot honour as
    transformers' own does (docs/models.md has the table of every knob)."""
    why = None
    reentrant = (args.activation_checkpointing_kwargs or {}).get("use_reentrant", False) or \
        (args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False)
    if args.fp16:
        why = ("fp16: Trainer's GradScaler unscales the gradients still on the device, and "
               "OffloadedAdamW has taken them during backward; train in bf16, or scale in "
               "your own loop with step(grad_scale=...)")
    elif args.deepspeed or args.fsdp:
        why = (f"{'deepspeed' if args.deepspeed else 'fsdp'}: OffloadedAdamW is the optimizer "
               "and does its own offload and sharding; the two do not go together")
    elif args.torch_compile:
        why = "torch_compile: not tested with OffloadedAdamW's gradient hooks and streaming"
    elif streamed and reentrant:
        why = ("activation_checkpointing_kwargs use_reentrant=True: a streamed model needs "
               "use_reentrant=False (docs/streaming.md, \"Limits\")")
    elif streamed and args.load_best_model_at_end:
        why = ("load_best_model_at_end: not tested with a streamed model yet (its weights "
               "load through the stream, as resume_from_checkpoint's do)")
    if why is not None:
        raise InvalidArgument(f"{who}: TrainingArguments.{why}")


class _Offloaded:
    """What makes a Trainer class train with OffloadedAdamW (see the module's text); first among
    the bases of Trainer and of offloaded()'s classes."""

    _who = "tierd.torch.hf.Trainer"

    def __init__(self, *args, optimizer_options: Optional[Dict] = None, **kwargs):
        optimizer = (kwargs.get("optimizers") or (None, None))[0]
        cls_and_kwargs = kwargs.get("optimizer_cls_and_kwargs")
        if optimizer is not None and not isinstance(optimizer, OffloadedAdamW) or \
                cls_and_kwargs is not None and not issubclass(cls_and_kwargs[0], OffloadedAdamW):
            raise InvalidType(f"{self._who}: give optimizers=(OffloadedAdamW(...), scheduler), or "
                              "no optimizer (one is made from the TrainingArguments); another "
                              "optimizer would not see streamed gradients")
        if (optimizer is not None or cls_and_kwargs is not None) and optimizer_options:
            raise InvalidArgument(f"{self._who}: optimizer_options are for the optimizer made from "
                                  "the TrainingArguments; give them to the OffloadedAdamW you made")
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        model = kwargs.get("model", args[0] if args else None)
        if given is not None:  # before Trainer changes anything (the model's checkpointing)
            _refuse(given, model is not None and _stream_of_model(model) is not None, self._who)
        self._offloaded: Optional[OffloadedAdamW] = None
        self._pending_norm: Optional[torch.Tensor] = None
        super().__init__(*args, **kwargs)
        if given is None:  # Trainer's defaults
            _refuse(self.args, self._stream() is not None, self._who)
        if optimizer is not None:
            self._adopt(optimizer)
        elif cls_and_kwargs is None:
            self._optimizer_from_args(optimizer_options or {})
        # With more than one process the model is wrapped in DDP, which is to leave the streamed
        # parameters alone (_ddp.py) under the names they have in the model trained (PEFT's).
        DDPIgnored(self.model, (p for p in self.model.parameters()
                                if stream_of(p) is not None)).install()
        self.add_callback(_Norm(self))
        log_figures(self)

    def _optimizer_from_args(self, options: Dict) -> None:
        """Trainer is to make OffloadedAdamW with what it would give torch's AdamW from the
        TrainingArguments (`optim` adamw_torch or adamw_torch_fused): their lr, betas, eps and
        weight decay, in the parameter groups it makes (create_optimizer); and
        optimizer_options."""
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        if cls is not torch.optim.AdamW:
            optim = getattr(self.args.optim, "value", self.args.optim)
            raise InvalidArgument(f"{self._who}: TrainingArguments.optim={optim!r}: tierd steps "
                                  "AdamW (adamw_torch, adamw_torch_fused)")
        self.optimizer_cls_and_kwargs = (OffloadedAdamW, {**kwargs, **options})

    def create_optimizer(self, model=None):
        made = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if made:
            log.info("%s: OffloadedAdamW made from the TrainingArguments with %s", self._who,
                     dict(self.optimizer_cls_and_kwargs[1]))
            self._adopt(optimizer)
        return optimizer

    def _adopt(self, optimizer: OffloadedAdamW) -> None:
        """Gives the optimizer the clipping and accumulation the TrainingArguments ask for."""
        self._offloaded = optimizer
        optimizer.grad_norm_order = self.model.parameters()  # as Trainer's clip_grad_norm_
        wanted = self.args.max_grad_norm
        if wanted and wanted > 0:
            if optimizer.max_grad_norm is None:
                optimizer.max_grad_norm = wanted
            elif optimizer.max_grad_norm != wanted:
                raise InvalidArgument(f"{self._who}: args.max_grad_norm ({wanted}) and the "
                                      f"optimizer's max_grad_norm ({optimizer.max_grad_norm}) "
                                      "differ: set one")
        accumulate = self.args.gradient_accumulation_steps
        if optimizer.accumulation_steps == 1:
            optimizer.accumulation_steps = accumulate
        elif optimizer.accumulation_steps != accumulate:
            raise InvalidArgument(f"{self._who}: args.gradient_accumulation_steps ({accumulate}) "
                                  "and the optimizer's accumulation_steps "
                                  f"({optimizer.accumulation_steps}) differ: set one")

    def _stream(self):
        return _stream_of_model(self.accelerator.unwrap_model(self.model,
                                                              keep_torch_compile=False))

    def _lazy_norm(self) -> Optional[torch.Tensor]:
        if self._offloaded.max_grad_norm is None and not self._offloaded.skip_nonfinite:
            return None  # the optimizer computes no norm
        self._pending_norm = torch.zeros((), dtype=torch.float64)
        return self._pending_norm

    def _clip_grad_norm(self, model):
        return self._lazy_norm()  # the optimizer clips, in step()

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else self._lazy_norm()

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        stream = self._stream()
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        peft = type(model).__module__.startswith("peft.")
        if stream is None or peft:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        stream.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


class Trainer(_Offloaded, transformers.Trainer):
    """transformers.Trainer for OffloadedAdamW (see the module's text). Arguments as Trainer's,
    and optimizer_options: OffloadedAdamW's own arguments (socket_dir, overlap_backward, home,
    ...) for the optimizer made from the TrainingArguments where `optimizers` holds none."""


_MADE: Dict[type, type] = {}


def offloaded(trainer_class: type) -> type:
    """`trainer_class`, a subclass of transformers.Trainer (TRL's SFTTrainer, ...), made to train
    with OffloadedAdamW as Trainer here does: the same arguments and optimizer_options. The same
    class for the same argument."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise InvalidType(f"tierd.torch.hf.offloaded: {trainer_class!r} is not a subclass of "
                          "transformers.Trainer")
    if issubclass(trainer_class, _Offloaded):
        return trainer_class
    if trainer_class not in _MADE:
        _MADE[trainer_class] = type(trainer_class.__name__, (_Offloaded, trainer_class), {
            "__module__": __name__, "__doc__": offloaded.__doc__,
            "_who": f"tierd.torch.hf.offloaded({trainer_class.__name__})"})
    return _MADE[trainer_class]
