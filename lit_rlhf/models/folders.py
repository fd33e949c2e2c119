"""Reading a pretrained model folder before (and instead of) a plain ``from_pretrained``.

Two kinds of folder need more than ``AutoModel*.from_pretrained(name_or_path)``:

- a saved peft adapter (``adapter_config.json``, e.g. a LoRA SFT run's ``save_pretrained``): transformers
  would load base + adapter frozen, and a new ``lora:`` would replace the adapter (training from the base).
  Here the adapter is merged into its base at load (peft ``PeftModel.from_pretrained`` then
  ``merge_and_unload``), so the starting policy is exactly the adapter's; ``spec.lora`` then adds fresh
  adapters on top, and the reference (a LoRA actor with its adapters disabled) is that same policy.
- a classifier with several labels given as a reward model or critic: refused with one line, before
  transformers' size-mismatch report.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig

from lit_rlhf.models.spec import ModelSpec

__all__ = ["adapter_base", "adapter_config", "check_one_label", "load_pretrained"]


def adapter_config(name_or_path: str) -> dict | None:
    """A local peft adapter folder's ``adapter_config.json``; None for a model folder or a hub id."""
    file = Path(name_or_path) / "adapter_config.json"
    return json.loads(file.read_text()) if file.is_file() else None


def adapter_base(name_or_path: str) -> str | None:
    """The base model of a local peft adapter folder (its ``adapter_config.json``'s
    ``base_model_name_or_path``); None for a model folder or a hub id.

    Raises:
        ValueError: an adapter folder that does not name its base.
    """
    config = adapter_config(name_or_path)
    if config is None:
        return None
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{name_or_path} is a peft adapter folder whose adapter_config.json has no base_model_name_or_path: "
            "set it to the base model's folder or hub id"
        )
    return base


def check_one_label(name_or_path: str, trust_remote_code: bool = False) -> None:
    """Refuse a sequence classifier with other than one label as a reward model or critic (a causal-LM folder,
    whose config's ``num_labels`` is transformers' unused default of 2, gets a new one-label head instead).

    Raises:
        ValueError: naming the folder and its label count.
    """
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or ())
    if classifier and config.num_labels != 1:
        raise ValueError(
            "a reward model or critic needs a one-label score head (num_labels=1); "
            f"{name_or_path} has {config.num_labels} labels"
        )


def load_pretrained(auto_class: type, spec: ModelSpec, **kwargs) -> nn.Module:
    """``auto_class.from_pretrained`` of ``spec.name_or_path`` (``kwargs`` passed on); a peft adapter folder is
    loaded on its base (:func:`adapter_base`, with the same ``kwargs``) and merged into it."""
    base = adapter_base(spec.name_or_path)
    try:
        model = auto_class.from_pretrained(
            base or spec.name_or_path, dtype=spec.torch_dtype, trust_remote_code=spec.trust_remote_code, **kwargs
        )
    except SafetensorError as err:  # it names no file
        raise OSError(
            f"could not load the weights of {base or spec.name_or_path!r}: {err} (a truncated or corrupt"
            " .safetensors file: a half-written export or an interrupted download? Re-create it)"
        ) from err
    if base is None:
        return model
    from peft import PeftModel

    # peft froze the base for the adapter; merged, every weight trains as a plain model's does
    return PeftModel.from_pretrained(model, spec.name_or_path).merge_and_unload().requires_grad_(True)
