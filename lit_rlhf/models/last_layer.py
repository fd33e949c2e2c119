"""The last decoder layer computed at the scored positions only.

A reward model reads its scalar head at one position per sequence (the last real token; in the shared-prompt
layout, one per response of a packed row). Every layer but the last must run at every position: later
positions attend to their keys and values. The last layer's output, though, is read at the scored positions
alone, so everything in it that is per query position (the query projection, the attention itself, the
output projection and the MLP) is needed there only; its keys and values are needed everywhere. Computing
just that is exact (same operations on the same numbers, only other matmul shapes, so float rounding) and
removes about (1 - n / L) of the last layer's work at n scored of L positions: about 20% of a 4-layer
model's forward and backward, 2-3% of a 32-layer one's.

Supported: the Llama family's decoder layer (Llama, Mistral, Qwen2, Qwen3: pre-norm attention with
``q_proj``/``k_proj``/``v_proj``/``o_proj``, rotary embeddings, optional ``q_norm``/``k_norm``, then a pre-norm
MLP) and GPT-2's block (pre-norm attention with one fused ``c_attn`` projection, absolute positions added
before the first layer, then a pre-norm MLP), under ``sdpa`` or ``eager`` attention, unsharded (a layer
wrapped by FSDP2 is of another class), without gradient checkpointing or a KV cache, with dropout off while
training (dropout draws one random number per position). Anything else runs the layer as it is.
``set_scored_last_layer`` turns it off per model. The projections are called as modules, so LoRA adapters
on them stay in the path.

Shapes: B rows, L positions, n scored positions per row, H hidden size, h query heads, D head size.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["SUPPORTED_LAYERS", "last_decoder_layer", "scored_last_layer", "set_scored_last_layer"]

LLAMA_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
GPT2_LAYERS = ("GPT2Block",)
SUPPORTED_LAYERS = LLAMA_LAYERS + GPT2_LAYERS
_SETTING_ATTR = "_lit_rlhf_scored_last_layer"


def set_scored_last_layer(model: nn.Module, enabled: bool) -> None:
    """Record whether ``model``'s last decoder layer may run at the scored positions only (default: yes)."""
    setattr(model, _SETTING_ATTR, bool(enabled))


def last_decoder_layer(model: nn.Module) -> nn.Module | None:
    """The last decoder layer of ``model`` (plain or peft) when it can run at scored positions only, else None."""
    if not getattr(model, _SETTING_ATTR, True):
        return None
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    layers = getattr(backbone, "layers", getattr(backbone, "h", None))  # GPT-2 names its blocks ``h``
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    layer = layers[getattr(backbone.config, "num_hidden_layers", len(layers)) - 1]
    if type(layer).__name__ not in SUPPORTED_LAYERS:  # FSDP2 renames the class of the layers it shards
        return None
    if getattr(layer, "gradient_checkpointing", False):  # its checkpointed forward stays as it is
        return None
    llama = type(layer).__name__ in LLAMA_LAYERS
    attention = getattr(layer, "self_attn" if llama else "attn", None)
    if llama:
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config")
    else:  # GPT-2: no cross-attention, no reordered float32 attention (another rounding of the scores)
        needed = ("c_attn", "c_proj", "num_heads", "head_dim", "scaling", "config")
        if hasattr(layer, "crossattention") or getattr(attention, "reorder_and_upcast_attn", True):
            return None
    if attention is None or not all(hasattr(attention, name) for name in needed):
        return None
    if getattr(attention.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    return layer


@contextmanager
def scored_last_layer(
    model: nn.Module, positions: torch.Tensor, valid: torch.Tensor | None = None
) -> Iterator[bool]:
    """Within the block, ``model``'s last decoder layer computes its output at ``positions`` only.

    Its output elsewhere is its input (the residual stream before the layer): finite, meaningless, and read by
    nobody who reads the scored positions only. Yields whether the layer was replaced (False: it runs as is).

    Args:
        model: a causal LM or sequence classifier (plain or peft).
        positions: (B, n) long, the scored positions of each row of the forward's input.
        valid: (B, n) bool, which of them are real (rows with fewer scored positions repeat one); None = all.
            The valid (row, position) pairs must be distinct.
    """
    layer = last_decoder_layer(model)
    if layer is None:
        yield False
        return
    valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
    scored_forward = llama_scored_call if type(layer).__name__ in LLAMA_LAYERS else gpt2_scored_call

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = scored_forward(layer, hidden_states, positions, valid, *args, **kwargs)
        return type(layer).forward(layer, hidden_states, *args, **kwargs) if out is None else out

    layer.forward = forward
    try:
        yield True
    finally:
        del layer.forward


def take(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B or 1, L, ...) -> (B, n, ...): ``x`` at the (B, n) scored ``positions`` of each row."""
    B = positions.shape[0]
    x = x.expand(B, *x.shape[1:])
    index = positions.view(B, -1, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def write_scored(
    hidden_states: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """(B, L, H) ``hidden_states`` with the (B, n, H) ``out`` written at the valid scored positions."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)  # (B, n)
    return hidden_states.index_put((rows[valid], positions[valid]), out[valid])  # (B, L, H)


def llama_scored_call(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *args,
    **kwargs,
) -> torch.Tensor | None:
    """:func:`scored_layer_forward` for a call of a Llama-family layer; None for a calling form not known here."""
    embeddings = kwargs.get("position_embeddings")
    if args or embeddings is None or (layer.training and layer.self_attn.attention_dropout > 0):
        return None
    return scored_layer_forward(
        layer, hidden_states, positions, valid, kwargs.get("attention_mask"), embeddings
    )


def scored_layer_forward(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The Llama-family decoder layer's output at ``positions``, written over its input there.

    Args:
        layer: a decoder layer of :data:`SUPPORTED_LAYERS`.
        hidden_states: (B, L, H) its input.
        positions: (B, n) long; valid: (B, n) bool.
        attention_mask: what the model passes its layers: None (causal, no padding), or a (B or 1, 1, L, L)
            bool (True = attend) or additive float mask.
        position_embeddings: the rotary (cos, sin), each (B or 1, L, D).

    Returns:
        (B, L, H): the layer's output at the valid scored positions, ``hidden_states`` elsewhere.
    """
    attention = layer.self_attn
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    B, L, _ = hidden_states.shape
    D = attention.head_dim
    normed = layer.input_layernorm(hidden_states)  # (B, L, H)
    query = attention.q_proj(take(normed, positions)).view(
        B, -1, attention.config.num_attention_heads, D
    )  # (B, n, h, D)
    key = attention.k_proj(normed).view(B, L, -1, D)  # (B, L, kv, D)
    value = attention.v_proj(normed).view(B, L, -1, D).transpose(1, 2)  # (B, kv, L, D)
    if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
        query, key = attention.q_norm(query), attention.k_norm(key)
    cos, sin = position_embeddings  # (B or 1, L, D)
    query, _ = rotary(
        query.transpose(1, 2), query.transpose(1, 2), take(cos, positions), take(sin, positions)
    )  # (B, h, n, D)
    key, _ = rotary(key.transpose(1, 2), key.transpose(1, 2), cos, sin)  # (B, kv, L, D)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (B, h, L, D)
    mask = scored_rows_mask(attention_mask, positions, L)  # (B, 1, n, L)
    attended = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=attention.scaling
    )  # (B, h, n, D)
    attended = attended.transpose(1, 2).reshape(B, positions.shape[1], -1)  # (B, n, h * D)
    out = take(hidden_states, positions) + attention.o_proj(attended)  # (B, n, H)
    out = out + layer.mlp(layer.post_attention_layernorm(out))  # (B, n, H)
    return write_scored(hidden_states, out, positions, valid)  # (B, L, H)


_signature = functools.cache(inspect.signature)  # a block's forward is bound to its signature every call


def gpt2_scored_call(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *args,
    **kwargs,
) -> torch.Tensor | None:
    """:func:`gpt2_scored_forward` for a call of a GPT-2 block (which takes its cache, mask and encoder states
    positionally); None for a calling form not known here, a KV cache, cross-attention or dropout in training."""
    signature = _signature(type(layer).forward)  # per function: a patched forward is another function
    if "attention_mask" not in signature.parameters:  # a wrapper that does not keep the block's signature
        return None
    try:
        call = signature.bind(layer, hidden_states, *args, **kwargs).arguments
    except TypeError:
        return None
    extra = call.get("kwargs", {})
    if any(
        call.get(name, extra.get(name)) is not None for name in ("cache", "past_key_values", "layer_past")
    ):
        return None
    if call.get("encoder_hidden_states") is not None:
        return None
    dropouts = (layer.attn.attn_dropout.p, layer.attn.resid_dropout.p, layer.mlp.dropout.p)
    if layer.training and max(dropouts) > 0:
        return None
    return gpt2_scored_forward(layer, hidden_states, positions, valid, call.get("attention_mask"))


def gpt2_scored_forward(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """GPT-2's block output at ``positions``, written over its input there (shapes as in
    :func:`scored_layer_forward`; GPT-2 adds its absolute positions before the first block, so no rotation)."""
    attention = layer.attn
    B, L, H = hidden_states.shape
    heads, D = attention.num_heads, attention.head_dim
    normed = layer.ln_1(hidden_states)  # (B, L, H)
    query, key, value = attention.c_attn(normed).split(H, dim=2)  # (B, L, H) each; the module keeps adapters
    query = take(query, positions).view(B, -1, heads, D).transpose(1, 2)  # (B, h, n, D)
    key = key.view(B, L, heads, D).transpose(1, 2)  # (B, h, L, D)
    value = value.view(B, L, heads, D).transpose(1, 2)  # (B, h, L, D)
    mask = scored_rows_mask(attention_mask, positions, L)  # (B, 1, n, L)
    attended = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=attention.scaling
    )  # (B, h, n, D)
    attended = attended.transpose(1, 2).reshape(B, positions.shape[1], H)  # (B, n, H)
    out = take(hidden_states, positions) + attention.c_proj(attended)  # (B, n, H)
    out = out + layer.mlp(layer.ln_2(out))  # (B, n, H)
    return write_scored(hidden_states, out, positions, valid)  # (B, L, H)


def scored_rows_mask(
    attention_mask: torch.Tensor | None, positions: torch.Tensor, width: int
) -> torch.Tensor:
    """The (B, 1, n, L) rows of a layer's attention mask at the scored query ``positions`` (B, n); a causal
    bool mask when the model passes None."""
    B, n = positions.shape
    if attention_mask is None:
        keys = torch.arange(width, device=positions.device)
        return (keys[None, None, None, :] <= positions[:, None, :, None]).expand(B, 1, n, width)
    mask = attention_mask.expand(B, *attention_mask.shape[1:])  # (B, m, L, L)
    index = positions[:, None, :, None].expand(B, mask.shape[1], n, mask.shape[-1])
    return mask.gather(2, index)  # (B, m, n, L)
