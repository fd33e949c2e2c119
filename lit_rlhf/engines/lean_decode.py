"""A lean decoding loop: the tokens of Hugging Face ``generate`` under the same seed, with less per step.

``generate_responses`` samples with ``generate`` and the behaviour recorder as its last logits processor
(``lit_rlhf.models.sampling``). Per decoding step ``generate`` also concatenates every layer's KV cache
(``DynamicLayer.update``: a copy of the whole cache, ~2 ms a step for the W1 benchmark's 8 rows), copies the
logits, grows the ids, mask and position ids by concatenation, runs its logits-processor and
stopping-criteria lists, and takes the inverse-CDF sampler's token back by an argmax over one-hot scores.
This loop runs the same forwards (the same inputs, positions, masks and cache contents, so the same logits;
the same shapes unless finished rows are dropped, last item) and the same draws in the same order (one step
for every row until all rows stopped, as ``generate``; so the same random numbers), without those:

* the KV cache grows in place: after the prefill each ``DynamicLayer`` becomes a :class:`GrowingLayer`,
  a buffer of the final length whose keys and values are views of the filled columns (the attention
  reads the same values, in the same layout per head);
* ids, attention mask and tokens live in buffers of the final width, the forwards take views of them;
* the inverse-CDF sampler returns its token (``InverseCDFSampler.draw``), suppressing the pad token in
  the logits themselves (no copy); multinomial sampling and greedy decoding run as ``generate`` runs them;
* with ``drop_finished`` (``generation.drop_finished``), rows that have stopped leave the batch the forwards
  run (their cache, mask and positions index-selected; at least :func:`min_rows` kept), where ``generate`` runs
  them to the end only to replace their tokens by pad: under greedy decoding or the inverse-CDF sampler,
  whose uniforms are still drawn for every row, so the remaining rows get the same logits and draws.

What it supports is what ``generate_responses`` asks of ``generate``: left-padded prompts with explicit
position ids, a cache continued after a shared group prefill, EOS and stop ids, the pad token suppressed,
temperature/top-k/top-p, both samplers, greedy. :func:`lean_unsupported` says when ``generate`` must run
instead: stop strings (matched on decoded text), ``synced_gpus``, encoder-decoder models, peft prompt
learning, and a model ``generation_config`` that would add logits processors, warpers, stopping criteria
or another cache (any field beyond the token ids and lengths; ``generate_responses`` runs with the model's
config reduced to its token ids, ``hf_generate.rollout_generation_config``, so a model file's
``repetition_penalty`` and the like never reach a rollout).

Shapes: B rows, P prompt length (left-padded), N = max_new_tokens, T <= N response length.
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from lit_rlhf.models.decoding import packed_linear, transposed_linear
from lit_rlhf.models.prefill import _accepts, cache_argument
from lit_rlhf.models.sampling import BehaviourRecorder, InverseCDFSampler, MultinomialRecorder
from lit_rlhf.models.scoring import position_ids_from_mask

__all__ = ["GrowingLayer", "lean_decode", "lean_unsupported", "min_rows"]

# generation_config fields that change nothing the lean loop does (ids, lengths, bookkeeping)
_NEUTRAL_FIELDS = frozenset(
    {"max_new_tokens", "max_length", "do_sample", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
     "decoder_start_token_id", "transformers_version", "_from_model_config", "vocab_size"}
)  # fmt: skip

# fields that change nothing while off (extra outputs only go into a dict generate is not asked for)
_OFF_FIELDS = (
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "output_logits",
    "return_dict_in_generate",
)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of a buffer of the final length, filled in place.

    ``DynamicLayer.update`` concatenates (copies the whole layer cache every step); here each step copies
    only its new columns. The views have the layout of the concatenated tensors within each (row, head)
    (contiguous columns of ``head_dim``), so the attention reads the same values.

    Args:
        keys, values: (B, H, L, D) the cache after the prefill.
        capacity: the final length (L plus the tokens still to decode).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        self._key_buffer = keys.new_empty(*keys.shape[:2], capacity, keys.shape[3])  # (B, H, capacity, D)
        self._value_buffer = values.new_empty(*values.shape[:2], capacity, values.shape[3])
        self.device, self.is_initialized, self.keys, self.values = keys.device, True, keys, values
        self._fill(keys, values, 0)

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        end = start + keys.shape[-2]
        if end > self._key_buffer.shape[-2]:
            raise RuntimeError(
                f"GrowingLayer: {end} cached columns exceed the capacity {self._key_buffer.shape[-2]}"
            )
        self._key_buffer[:, :, start:end].copy_(keys)
        self._value_buffer[:, :, start:end].copy_(values)
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append (B, H, m, D) new keys and values; the (B, H, L+m, D) views of all of them."""
        self._fill(key_states, value_states, self.keys.shape[-2])
        return self.keys, self.values

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the (b,) ``rows`` of the batch, in that order: new (b, H, capacity, D) buffers holding
        their filled columns (the same values, in the same layout)."""
        keys, values = self.keys.index_select(0, rows), self.values.index_select(0, rows)  # (b, H, L, D)
        self._key_buffer = self._key_buffer.new_empty(len(rows), *self._key_buffer.shape[1:])
        self._value_buffer = self._value_buffer.new_empty(len(rows), *self._value_buffer.shape[1:])
        self._fill(keys, values, 0)


def lean_unsupported(model: torch.nn.Module, generate_kwargs: dict) -> str | None:
    """Why the lean loop cannot stand in for ``model.generate(**generate_kwargs)`` (None: it can).

    ``generate_kwargs`` are ``generation_kwargs``'s; the model's ``generation_config`` merged with them (as
    ``generate`` merges them) may set nothing beyond :data:`_NEUTRAL_FIELDS`, and ``suppress_tokens`` only
    to the pad token of a greedy run (what the loop suppresses itself).
    """
    if generate_kwargs.get("synced_gpus"):
        return "synced_gpus (every rank runs generate's loop)"
    if generate_kwargs.get("stop_strings") or generate_kwargs.get("stopping_criteria"):
        return "stop strings (generate matches them on decoded text)"
    config = getattr(model, "config", None)
    if (
        config is None
        or getattr(config, "is_encoder_decoder", False)
        or not hasattr(model, "generation_config")
    ):
        return f"{type(model).__name__} is not a decoder-only Hugging Face model"
    if cache_argument(model) is None:
        return f"{type(model).__name__}.forward takes no KV cache argument"
    peft_config = getattr(model, "peft_config", None)
    if peft_config and any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        return "peft prompt learning (generate prepends the virtual tokens)"
    merged = copy.deepcopy(model.generation_config)
    merged.update(**{k: v for k, v in generate_kwargs.items() if hasattr(merged, k)})
    fields = {k for k, v in merged.to_diff_dict().items() if k not in _NEUTRAL_FIELDS}
    fields -= {k for k in _OFF_FIELDS if not getattr(merged, k, None)}
    greedy = "logits_processor" not in generate_kwargs  # sampling: the recorder suppresses the pad itself
    if greedy and list(merged.suppress_tokens or ()) == [generate_kwargs["pad_token_id"]]:
        fields.discard("suppress_tokens")
    return f"generation_config sets {sorted(fields)}" if fields else None


def _growing(cache: object, capacity: int) -> object:
    """``cache`` with every ``DynamicLayer`` made a :class:`GrowingLayer` (other caches as they are)."""
    if type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers):
        if all(layer.is_initialized and layer.keys.dim() == 4 for layer in cache.layers):
            cache.layers = [GrowingLayer(layer.keys, layer.values, capacity) for layer in cache.layers]
    return cache


def drops_rows(recorder: BehaviourRecorder | None) -> bool:
    """Whether the loop can drop finished rows under this sampler and still make ``generate``'s draws:
    greedy decoding draws nothing, the inverse-CDF sampler one uniform per row (drawn for the whole batch
    anyway); ``torch.multinomial``'s variates depend on the batch's shape, so that sampler keeps every row."""
    return recorder is None or isinstance(recorder, InverseCDFSampler)


def _next_tokens(
    logits: torch.Tensor, recorder: BehaviourRecorder | None, ids: torch.Tensor, pad: int, rows: torch.Tensor,
    batch_size: int,
):  # fmt: skip
    """(b, V) float32 logits of the last position (owned: overwritten) of the batch's ``rows`` (b,) of
    ``batch_size`` -> (b,) the tokens ``generate`` would take: greedy argmax with the pad suppressed, the
    inverse-CDF draw, or the multinomial one (every row: ``ids`` are then the (B, P+t) ids so far)."""
    if recorder is None:
        return logits.index_fill_(1, torch.tensor([pad], device=logits.device), float("-inf")).argmax(dim=-1)
    if isinstance(recorder, InverseCDFSampler):
        dropped = len(rows) < batch_size
        return recorder.draw(logits, inplace=True, rows=rows if dropped else None, batch_size=batch_size)
    if isinstance(recorder, MultinomialRecorder):
        probs = torch.nn.functional.softmax(recorder(ids, logits), dim=-1)  # generate's do_sample step
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    raise TypeError(f"lean_decode: no sampling step for {type(recorder).__name__}")


@torch.no_grad()
def lean_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: list[int],
    pad_token_id: int,
    recorder: BehaviourRecorder | None,
    cache: object | None = None,
    drop_finished: bool = False,
) -> torch.Tensor:
    """The (B, T) tokens ``generate`` returns after the prompt (see the module docstring), T <= N.

    Args:
        model: causal LM (or peft model), in the mode it generates in.
        input_ids, attention_mask: (B, P) left-padded prompts.
        max_new_tokens: N.
        stop_ids: token ids that end a row (EOS and the configured stops).
        pad_token_id: put after a row's stop, never drawn.
        recorder: the sampler (records the behaviour log-probs); None = greedy.
        cache: the KV cache of the first ``L < P`` prompt columns (a shared group prefill), or None.
        drop_finished: drop rows that have stopped from the batch the forwards run (see
            :func:`_keep_rows`), where the sampler allows it (:func:`drops_rows`) and the cache is the
            loop's own; else every row runs until all have stopped, as in ``generate``.
    """
    (B, P), N, device = input_ids.shape, max_new_tokens, input_ids.device
    ids = input_ids.new_full((B, P + N), pad_token_id)  # (B, P+N) prompt and response tokens
    ids[:, :P] = input_ids
    mask = attention_mask.new_ones(B, P + N)  # (b, P+N), b = rows still in the batch
    mask[:, :P] = attention_mask
    positions = position_ids_from_mask(attention_mask)  # (B, P)
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    cache_name = cache_argument(model)
    stops = torch.tensor(stop_ids, device=device)
    rows = torch.arange(B, device=device)  # (b,) which of the B rows the batch holds
    unfinished = torch.ones(B, dtype=torch.bool, device=device)  # (b,)
    start = 0 if cache is None else cache.get_seq_length()  # prompt columns already cached
    step_ids, step_positions = input_ids[:, start:], positions[:, start:]
    drop_finished = drop_finished and drops_rows(recorder)
    fewest = min_rows(model, B) if drop_finished else B
    for t in range(N):
        out = model(
            input_ids=step_ids, attention_mask=mask[:, : P + t], position_ids=step_positions, use_cache=True,
            **{cache_name: cache}, **extra,
        )  # fmt: skip
        cache = getattr(out, cache_name) if t else _growing(getattr(out, cache_name), P + N)
        if not t:  # rows are dropped from the loop's own cache only
            drop_finished = drop_finished and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        # (b, V) float32, overwritten by the suppression: a view of this forward's logits (nothing else
        # reads them), contiguous as generate's copy
        logits = out.logits[:, -1].float().contiguous()
        drawn = _next_tokens(logits, recorder, ids[:, : P + t], pad_token_id, rows, B)  # (b,)
        tokens = torch.where(unfinished, drawn, pad_token_id)  # (b,)
        ids[rows, P + t] = tokens
        unfinished &= ~torch.isin(tokens, stops)
        running = int(unfinished.sum())  # one host read of b flags a step, as generate's stopping check
        if not running:
            return ids[:, P : P + t + 1]
        step_ids, step_positions = tokens[:, None], step_positions[:, -1:] + 1
        if drop_finished and _worth_dropping(len(rows), running, fewest):
            keep = _keep_rows(unfinished, fewest)  # (b',) positions in the batch
            rows, unfinished, mask = rows[keep], unfinished[keep], mask[keep]
            step_ids, step_positions = step_ids[keep], step_positions[keep]
            for layer in cache.layers:
                layer.keep_rows(keep)
    return ids[:, P:]


# The batch never shrinks below MIN_ROWS rows, nor to a row count whose products a probe finds rounded
# otherwise than the whole batch's (:func:`min_rows`): a BLAS multiplies a few rows by other kernels (one row:
# a matrix-vector product) whose float rounding differs. W1's actor (8 rows, 1 thread): each row's logits
# bit-identical from 2 rows on with the BLAS on an Intel Xeon, from 4 on on an AMD EPYC, where 2-3 rows
# changed a token in one call of eight (scripts/bench/RESULTS.md).
MIN_ROWS = 2
PROBE_ROWS = 16  # the largest batch the probe compares with (larger ones are taken to round rows as it does)
# output features probed at most (the kernel for a few rows is chosen by the rows and the depth)
_PROBE_COLUMNS = 4096


def min_rows(model: torch.nn.Module, batch: int) -> int:
    """The fewest rows a decoding batch of ``batch`` rows of ``model`` may shrink to with each row's results
    bit-identical to the whole batch's: at least ``MIN_ROWS``, and above every row count at which one of
    the model's linear products (each shape, product, dtype and device; probed once per process, thread
    count and batch) rounds a row otherwise than a batch of ``min(batch, PROBE_ROWS)`` rows does. The
    product is the one the module runs: ``nn.Linear``'s, GPT-2's ``Conv1D`` (``x @ W``), or a decoding
    LM head's layout (``models.decoding.decoding_lm_head``). ``batch`` or more means: never shrink."""
    shapes = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        transposed = type(module).__name__ == "Conv1D"  # GPT-2's (in, out) weights, x @ W + b
        if not (isinstance(module, torch.nn.Linear) or transposed) or weight is None or weight.dim() != 2:
            continue
        depth, width = weight.shape if transposed else weight.shape[::-1]
        # the product it runs: a decoding head's layout, else Conv1D's x @ W (as the transposed layout) or F.linear
        kind = getattr(module.__dict__.get("forward"), "layout", "transposed" if transposed else "linear")
        shapes.add((depth, min(width, _PROBE_COLUMNS), kind, weight.dtype, weight.device.type))
    reference, threads = min(batch, PROBE_ROWS), torch.get_num_threads()
    probed = [_rounding_rows(*shape, threads, reference) for shape in sorted(shapes, key=str)]
    return max([MIN_ROWS, *probed])


@functools.cache
def _rounding_rows(
    depth: int, width: int, kind: str, dtype: torch.dtype, device: str, threads: int, reference: int
) -> int:
    """1 + the largest row count under ``reference`` whose (n, depth) x (depth, width) product rounds a row
    otherwise than the same rows in a batch of ``reference`` rows (1 when none does). ``kind``: how it is
    multiplied: ``"linear"`` (``F.linear``), ``"transposed"`` (``models.decoding.transposed_linear``: by a
    (depth, width) copy, as GPT-2's ``Conv1D`` multiplies) or ``"packed"`` (``models.decoding.packed_linear``)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(reference, depth, generator=generator).to(device=device, dtype=dtype)  # (R, depth)
    weight = torch.randn(width, depth, generator=generator).to(device=device, dtype=dtype)  # (width, depth)
    products = {"packed": packed_linear, "transposed": transposed_linear}
    if kind in products:
        product = products[kind](weight)  # (n, depth) -> (n, width), as the layer multiplies
    else:
        product = lambda rows: torch.nn.functional.linear(rows, weight)  # noqa: E731
    with torch.no_grad():
        batch = product(x)  # (R, width)
        for n in range(reference - 1, 0, -1):
            if not torch.equal(product(x[:n].clone()), batch[:n]):
                return n + 1
    return 1


def _worth_dropping(batch: int, running: int, fewest: int = MIN_ROWS) -> bool:
    """Whether to drop the finished rows of a batch of ``batch`` rows with ``running`` unfinished: when at
    least an eighth of them (one row in batches under 16) has finished and the batch can shrink below
    ``batch`` without going under ``fewest`` rows; so a batch of B rows is copied (its KV cache) at most
    ~log(B) / log(8/7) times."""
    return batch > fewest and batch - running >= max(1, batch // 8)


def _keep_rows(unfinished: torch.Tensor, fewest: int = MIN_ROWS) -> torch.Tensor:
    """(b,) unfinished flags -> the positions to keep: every unfinished row, and the first finished ones
    as fillers up to ``fewest`` rows (their tokens are replaced by pad, as every finished row's)."""
    keep = unfinished.nonzero().squeeze(1)  # (b',)
    if len(keep) < fewest:
        fillers = (~unfinished).nonzero().squeeze(1)[: fewest - len(keep)]
        keep = torch.cat([keep, fillers]).sort().values
    return keep
