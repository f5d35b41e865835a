"""tierd for PyTorch: an AdamW whose fp32 master weights and moments live in the node's tierd,
parameter streaming, and activation offload.

    import tierd.torch
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                     name="run-42", host_budget_bytes=2 << 30)
    for batch in data:
        loss = model(batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

OffloadedAdamW is a torch.optim.Optimizer with torch.optim.AdamW's constructor, parameter groups
and state_dict format (loadable into and from a plain AdamW). The model keeps its own weights
(fp32, bf16 or fp16, on the CPU or a GPU); the optimizer keeps fp32 master weights, exp_avg and
exp_avg_sq in daemon chunks at home on NVMe or in the host tier, streamed through a bounded host
budget by the client library's fused CPU kernels, and writes the new weights back into the model
after each step. fp32 weights with scratch state on a node without a device tier are their own
master: the chunks then hold the moments only (docs/optimizer/pytorch.md).

`overlap_backward=True` hands gradients to the optimizer as backward produces them (copied off the
GPU on a side stream) and steps each bucket of parameters while backward still runs. The gradients
are taken as they were when produced: change them (clip, unscale) only through the optimizer's own
`max_grad_norm`, `skip_nonfinite` and `step(grad_scale=...)`. With clipping or skipping, those
buckets are stepped speculatively (as if the step would neither clip nor skip, at the last step's
loss scale) into a second version of the state; `step()` then checks the global norm and keeps
the speculative result when it is exactly what the clipped or skipped step gives, or abandons it
and steps again from the first version (`rolled_back_steps`): the result is always torch's.

`stream_parameters(model, ...)` (streaming.py) trains a model whose weights do not fit on the
device through a window of its blocks; `offload_activations(...)` (activations.py) keeps the
tensors autograd saves for backward in tierd chunks too; `as_tensor` views an acquired chunk as a
tensor without a copy; `StepFigures` (_step_figures.py) gives each step's figures for a run's logs.

The package is rooms that import only downward (tests/python/test_layering.py checks it), from
_storage.py at the bottom through the stream's rooms (streaming.py and those it names) to the
optimizer's (optimizer.py and those it names); docs/architecture.md draws them.
"""
from ._step_figures import StepFigures
from ._storage import as_tensor
from .activations import ActivationOffload, ActivationStats, offload_activations
from .optimizer import OffloadedAdamW
from .streaming import ParameterStream, stream_parameters

__all__ = ["ActivationOffload", "ActivationStats", "OffloadedAdamW", "ParameterStream",
           "StepFigures", "as_tensor", "offload_activations", "stream_parameters"]
