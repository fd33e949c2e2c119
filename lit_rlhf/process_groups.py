"""Tear torch.distributed down before the interpreter exits, so a multi-process run cannot abort at exit.

Why (found under gdb in a two-process CPU test, torch 2.13, Python 3.11): every ``gloo`` process group
runs its collectives on C++ worker threads (``pt_gloo_runloop``). Such a thread drops its reference to a
finished collective just after the Python caller has been told the collective is complete, and when
that reference is the last one to a tensor whose Python object is already gone, it takes the GIL to free
the object. If the process has reached interpreter finalisation by then (the last collective of a
script, a loaded machine that leaves the thread waiting for a core), Python 3.11 ends the thread with
``pthread_exit``; its unwinding runs through a ``noexcept`` C++ destructor and the process aborts:
``terminate called without an active exception``, SIGABRT, a failed rank after a successful run.

Lightning destroys the process group at exit only for NCCL; :func:`release_process_groups` does it for
every backend while the interpreter is whole: it destroys the groups, then frees what still holds them
(the reference cycles of an FSDP1 wrapper or a DDP reducer's autograd hooks; FSDP2's device meshes;
a colocated vLLM engine's own groups, destroyed by vLLM),
so each group's destructor joins its worker threads now (it releases the GIL while joining, so a
thread in the middle of freeing a tensor can finish). ``lit-rlhf`` calls it after its subcommand; a
script that runs ``Trainer.fit`` under ``torchrun`` itself should call it last.
"""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives a gloo process group's worker threads


def gloo_worker_threads() -> int:
    """The number of gloo worker threads alive in this process (0 where ``/proc/self/task`` is unreadable).

    Returns:
        How many threads are named ``pt_gloo_runloop`` (two per live gloo process group by default).
    """
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            continue
    return count


def _empty_device_mesh_registries() -> None:
    """FSDP2's device meshes keep their groups in ``DeviceMesh._pg_registry`` (read only while
    torch.compile traces) and outlive the models in DTensor's sharding caches: empty those registries,
    so the groups are freed. A private field: nothing is done where this torch has no such field."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return
    for obj in gc.get_objects():
        # a check on the class, not the instance: some objects warn when an instance check reads them
        registry = getattr(obj, "_pg_registry", None) if issubclass(type(obj), DeviceMesh) else None
        if isinstance(registry, dict):
            registry.clear()


def _destroy_vllm_groups() -> None:
    """A vLLM engine of this process that joined the trainer's group (one engine per rank) keeps its own
    groups and destroys them in its shutdown at exit, which fails on groups already destroyed: let vLLM
    destroy its groups (and the default one) first; its shutdown then finds none. Nothing without vLLM."""
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    for name in ("destroy_model_parallel", "destroy_distributed_environment"):
        destroy = getattr(parallel_state, name, None)
        if callable(destroy):
            destroy()


def release_process_groups() -> int:
    """Destroy every torch.distributed process group now and free what holds them (joining gloo's threads).

    A no-op (no collection either) when torch.distributed is not initialised. Local: no collective, so a
    rank may call it whatever the others do, but only once no collective of this rank is waiting for a
    peer (a group's destructor waits for its running collectives): after a successful run, or after a
    stop every rank made at the same point.

    Returns:
        The gloo worker threads still alive afterwards (:func:`gloo_worker_threads`): 0 unless something
        this function does not know still holds a group (a vLLM engine that joined the trainer's group
        keeps one of its own until vLLM's shutdown at exit).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return gloo_worker_threads()
    _destroy_vllm_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    _empty_device_mesh_registries()
    gc.collect()  # frees the modules' reference cycles that hold a group: its destructor joins its threads
    return gloo_worker_threads()
