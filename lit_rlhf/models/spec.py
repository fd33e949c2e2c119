"""``ModelSpec``: where a model comes from and how it is prepared, as a plain dataclass.

It is the type of every ``model:`` / ``reward_model:`` / ``critic:`` entry of the YAML configs, so
jsonargparse/LightningCLI validate it and document its fields (from the ``Args:`` below) in ``--help``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

DTypeName = Literal["float32", "bfloat16", "float16"]
LogitsChunking = Literal["auto", "on", "off"]


def _lora_field_names() -> set[str]:
    from peft import LoraConfig

    return {f.name for f in dataclasses.fields(LoraConfig) if f.init}


@dataclass
class ModelSpec:
    """How to build one model (policy, reward model or critic).

    Args:
        name_or_path: hub id or local folder (``save_pretrained`` output), loaded with ``from_pretrained``.
        config: inline transformers config with a ``model_type`` key; the model is randomly initialised.
        tokenizer: hub id or folder of the tokenizer; defaults to ``name_or_path``.
        dtype: parameter dtype of the model (log-probs and losses are float32 regardless).
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        lora: peft ``LoraConfig`` fields (e.g. r, lora_alpha, lora_dropout, target_modules); None = full fine-tuning.
        trust_remote_code: allow model/tokenizer code from the hub repository to run.
        seed: seed of every random initialisation (inline config, new heads, new embedding rows, LoRA);
            None draws them from the global RNG, so ``seed_everything`` decides.
        logits_chunking: how a causal LM's log-probs, entropy and SFT accuracy are computed: ``on``
            applies the LM head to the scored tokens' final hidden states in chunks, recomputed in
            backward, so the (tokens x vocabulary) logits never exist at once; ``off`` computes the full
            logits of every position; ``auto`` takes the head route (the head on the scored tokens only,
            e.g. the real response tokens of a rollout) at vocabularies of >= 8192 tokens, and with
            smaller ones when the logits would hold >= 2**24 elements with gradients; with gradients it
            splits into recomputed chunks only from 2**24 logits on. Equal results either way;
            architectures or FSDP sharding where the route is not exact (logit softcapping, a sharded
            head) always take the full-logits path.
        fused_lm_head: on the head route with gradients, compute a plain ``nn.Linear`` head's log-probs
            and entropy as one autograd function whose backward turns the kept (or, when chunked,
            recomputed) float32 logits into their gradient in place and sums the head's weight gradient
            into one buffer (``lit_rlhf.models.fused_head``); ``False`` leaves it to autograd's graph of
            the same operations, which holds several (tokens x vocabulary) tensors in the backward.
            Equal values; peft-wrapped or quantised heads and autocast always take autograd's graph.
        scored_last_layer: run the last decoder layer at the positions whose output is read only (the
            layer's keys and values still at every position): a reward model's scored tokens (each
            sequence's last real token), a critic's read positions (the T before the response tokens), and
            on the LM head route a causal LM's last ``logits_to_keep`` positions (those that predict the
            response tokens). The same results to float rounding, most of that layer's work saved
            (``lit_rlhf.models.last_layer``; Llama, Mistral, Qwen2/3 layers and GPT-2 blocks under sdpa or
            eager attention, unsharded).
    """

    name_or_path: str | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None
    dtype: DTypeName = "float32"
    gradient_checkpointing: bool = False
    lora: dict[str, Any] | None = None
    trust_remote_code: bool = False
    seed: int | None = None
    logits_chunking: LogitsChunking = "auto"
    fused_lm_head: bool = True
    scored_last_layer: bool = True

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError(
                "ModelSpec: give exactly one of `name_or_path` (pretrained weights) or `config` "
                f"(random init); got name_or_path={self.name_or_path!r}, config={self.config!r}"
            )
        if self.config is not None:
            if "model_type" not in self.config:
                raise ValueError(
                    "ModelSpec.config: an inline config needs a `model_type` key (e.g. 'gpt2', 'llama'); "
                    f"got keys {sorted(self.config)}"
                )
            if self.tokenizer is None:
                raise ValueError(
                    "ModelSpec.tokenizer: required when the model is given as an inline `config` "
                    "(there is no folder to take the tokenizer from)"
                )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"ModelSpec.dtype: expected float32, bfloat16 or float16, got {self.dtype!r}")
        if self.logits_chunking not in ("auto", "on", "off"):
            raise ValueError(
                f"ModelSpec.logits_chunking: expected 'auto', 'on' or 'off', got {self.logits_chunking!r}"
            )
        if not isinstance(self.fused_lm_head, bool):
            raise ValueError(f"ModelSpec.fused_lm_head: expected true or false, got {self.fused_lm_head!r}")
        if not isinstance(self.scored_last_layer, bool):
            raise ValueError(
                f"ModelSpec.scored_last_layer: expected true or false, got {self.scored_last_layer!r}"
            )
        if self.lora is not None:
            self._check_lora()

    def _check_lora(self) -> None:
        from peft import LoraConfig

        if "task_type" in self.lora:
            raise ValueError(
                "ModelSpec.lora: do not set `task_type`; the builder sets CAUSAL_LM or SEQ_CLS itself"
            )
        unknown = sorted(set(self.lora) - _lora_field_names())
        if unknown:
            raise ValueError(
                f"ModelSpec.lora: unknown LoraConfig field(s) {unknown}; "
                "valid ones include r, lora_alpha, lora_dropout, target_modules, modules_to_save, bias"
            )
        rank = self.lora.get("r", 1)  # absent: peft's default rank, which is valid
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"ModelSpec.lora.r: the LoRA rank must be a positive integer, got {rank!r}")
        try:
            LoraConfig(**self.lora)
        except (TypeError, ValueError) as err:
            raise ValueError(f"ModelSpec.lora: invalid LoRA settings {self.lora!r}: {err}") from err

    @property
    def tokenizer_name_or_path(self) -> str:
        """Where the tokenizer is loaded from (``tokenizer``, else ``name_or_path``)."""
        return self.tokenizer if self.tokenizer is not None else self.name_or_path

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype``."""
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def coerce(cls, value: Any, argument: str = "model") -> ModelSpec:
        """A ``ModelSpec`` from what a Python user passes: a spec, a dict of its fields or a path string.

        Args:
            value: ``ModelSpec``, ``dict`` (its fields) or ``str`` (``name_or_path``).
            argument: the constructor argument it was given as (named in error messages).

        Raises:
            TypeError: for any other type, or a dict with unknown fields.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(name_or_path=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise TypeError(
                    f"{argument}: unknown ModelSpec field(s) {unknown}; "
                    f"valid ones are {[f.name for f in dataclasses.fields(cls)]}"
                )
            return cls(**value)
        raise TypeError(
            f"{argument}: expected a ModelSpec, a dict of its fields or a model path string, "
            f"got {type(value).__name__}"
        )
