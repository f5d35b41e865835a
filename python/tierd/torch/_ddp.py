"""A streamed model under DistributedDataParallel (accelerate's prepare() with more than one
process wraps the model in it).

DDP broadcasts every parameter of the module it wraps from the first rank when it is made, and
all-reduces their gradients in backward. A streamed parameter has no storage outside the window
(DDP's C++ would read past it and crash the process), its ranks start from one checkpoint or one
init, and OffloadedAdamW averages its gradients over the ranks itself. So the stream names its
parameters in the model's `_ddp_params_and_buffers_to_ignore`, the list DDP leaves alone (as
DistributedDataParallel._set_params_and_buffers_to_ignore_for_model sets it), and takes them out
again when it closes. The names are the model's own: a module that wraps the streamed model
(PEFT's) names them otherwise, so tierd.torch.hf's Trainers name them in the model they train
too, and a loop of one's own leaves such a module out of DDP (docs/models.md).
"""
from typing import Iterable, List

import torch
import torch.nn as nn

ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


class DDPIgnored:
    def __init__(self, model: nn.Module, streamed: Iterable[torch.Tensor]):
        streamed = {id(p) for p in streamed}
        self._model = model
        self._names: List[str] = [n for n, p in model.named_parameters(remove_duplicate=False)
                                  if id(p) in streamed]

    def install(self) -> None:
        before = list(getattr(self._model, ATTRIBUTE, []))
        setattr(self._model, ATTRIBUTE, before + [n for n in self._names if n not in before])

    def remove(self) -> None:
        left = [n for n in getattr(self._model, ATTRIBUTE, []) if n not in self._names]
        if left:
            setattr(self._model, ATTRIBUTE, left)
        elif hasattr(self._model, ATTRIBUTE):
            delattr(self._model, ATTRIBUTE)
