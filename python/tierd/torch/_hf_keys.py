"""A checkpoint's keys as transformers names them: its renaming on load and on save, its ignore
lists. So a checkpoint streams in when `from_pretrained` would load it, and a stream saves what
`save_pretrained` would write.

transformers 5 loads a checkpoint through the model class's conversion mapping: renamings (a
GPT-NeoX checkpoint's `embed_out.weight` is the model's `lm_head.weight`; `LayerNorm.gamma` is
`.weight`), the base model's prefix added or taken off, and converters that merge or split
tensors (experts stacked into one). It ignores keys the class lists as unexpected and legacy
buffers (`rotary_emb.inv_freq`, `position_ids`). Saving reverses the renamings. This room calls
transformers' own functions for each of those, for a transformers model only (transformers is
then imported already; nothing here imports it otherwise); for any other model a key is its
state_dict name. A key that needs a converter is named with the converter's pattern: streaming
reads each tensor into its place as it is stored, so those are refused.
"""
import sys
import types
from typing import Dict, Iterable, Optional, Set, Tuple

import torch.nn as nn


class KeyNames:
    def __init__(self, model: nn.Module):
        tf = sys.modules.get("transformers")
        self._model = model if tf is not None and isinstance(model, tf.PreTrainedModel) \
            else None
        self._renamings, self._converters, self._rename = [], [], None
        self._saving = []
        if self._model is None:
            return
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (PrefixChange, WeightConverter,
                                                     WeightRenaming, rename_source_key)
        mapping = get_model_conversion_mapping(model)
        self._renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self._converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self._rename = rename_source_key
        # As save_pretrained reverts them for a model not made by from_pretrained: no legacy
        # renamings, no prefix changes, the rest reversed in reverse order.
        saving = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                  if not isinstance(t, PrefixChange)]
        self._saving = [t.reverse_transform() for t in saving[::-1]
                        if isinstance(t, WeightRenaming)]

    def to_model(self, key: str, known: Dict[str, bool]) -> Tuple[str, Optional[str]]:
        """The model's name for checkpoint key `key` (`known`: the model's state_dict names, each
        mapped to True, as transformers takes them), and the pattern of the converter it needs
        (None when renaming is all)."""
        if self._rename is None:
            return key, None
        prefix = getattr(self._model, "base_model_prefix", None) or None
        name, pattern = self._rename(key, self._renamings, self._converters, prefix, known)
        if name not in known and key in known:  # as from_pretrained: the key as it is
            name, pattern = self._rename(key, [], [], prefix, known)
        return name, pattern

    def ignored(self, keys: Iterable[str]) -> Set[str]:
        """Which of the checkpoint's unexpected `keys` from_pretrained ignores."""
        keys = set(keys)
        if self._model is None or not keys:
            return set()
        adjust = getattr(self._model, "_adjust_missing_and_unexpected_keys", None)
        if adjust is None:
            return set()
        info = types.SimpleNamespace(missing_keys=set(), unexpected_keys=set(keys))
        adjust(info)
        return keys - set(info.unexpected_keys)

    def to_checkpoint(self, name: str) -> str:
        """The key save_pretrained writes for the model's state_dict name `name`: its renamings
        reversed. (A tensor a converter made is written as the model names it, which
        from_pretrained also takes.)"""
        if self._rename is None:
            return name
        key, _ = self._rename(name, self._saving, [], reverse=True)
        return key
