"""release_process_groups: every process group destroyed and gloo's worker threads joined before exit.

A gloo worker thread that frees a finished collective's tensors after interpreter finalisation has begun
aborts the process ("terminate called without an active exception"; see ``lit_rlhf/process_groups.py``).
Joining the threads while the interpreter is whole rules that out; what keeps a group (and its threads)
alive after ``destroy_process_group`` is what a fit leaves behind: a DDP or FSDP1 model in a reference
cycle, FSDP2's device mesh in DTensor's caches (and a vLLM engine destroys its own groups). One-rank gloo
groups in this process (a HashStore: no port), held those ways; thread counts relative to the test's start.
"""

from __future__ import annotations

import gc
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lit_rlhf import cli
from lit_rlhf.process_groups import gloo_worker_threads, release_process_groups


@pytest.fixture
def threads_before():
    """The gloo worker threads alive before the test; any group the test leaves is destroyed after it."""
    before = gloo_worker_threads()
    yield before
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def start_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gathered: list = [None]
    dist.all_gather_object(gathered, {"rank": 0})  # a collective ran on the group's worker threads


def threads_started(at_least: int) -> int:
    """The gloo worker thread count once it reaches ``at_least`` (a new thread names itself as it starts)."""
    deadline = time.monotonic() + 10
    while gloo_worker_threads() < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return gloo_worker_threads()


def ddp_in_a_cycle() -> None:
    """A trained DDP model reachable only through a reference cycle, as a finished fit leaves its module."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.ones(3, 2)).sum().backward()  # the reducer (holding the group) hooks into the parameters
    holder: dict = {"model": model}
    holder["self"] = holder


def test_release_joins_the_threads_of_a_group_a_model_holds(threads_before):
    start_group()
    ddp_in_a_cycle()
    assert threads_started(threads_before + 2) >= threads_before + 2
    assert release_process_groups() == threads_before
    assert not dist.is_initialized()


def test_release_joins_the_threads_of_a_group_a_device_mesh_holds(threads_before):
    start_group()
    meshes = [init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))]  # kept, as DTensor's caches do
    assert threads_started(threads_before + 2) >= threads_before + 2
    assert release_process_groups() == threads_before
    assert meshes[0].mesh_dim_names == ("data_parallel",)


def test_release_without_a_process_group_does_nothing(threads_before):
    assert release_process_groups() == threads_before
    assert not dist.is_initialized()


def test_the_cli_releases_the_process_groups_after_its_subcommand(threads_before, monkeypatch):
    def fit_that_leaves_a_group(args):
        start_group()
        ddp_in_a_cycle()

    monkeypatch.setattr(cli, "run_cli", fit_that_leaves_a_group)
    cli.main([])
    assert not dist.is_initialized()
    assert gloo_worker_threads() == threads_before


def test_a_vllm_engine_destroys_its_own_groups_first(threads_before, monkeypatch):
    # a colocated vLLM engine (one per rank) keeps groups of its own that its shutdown at exit destroys,
    # failing on groups already destroyed: release lets vLLM destroy them (and the default group) first
    import types

    calls = []
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.destroy_model_parallel = lambda: calls.append("model_parallel")

    def destroy_distributed_environment():  # vLLM's destroys the default group too
        calls.append("environment")
        dist.destroy_process_group()

    state.destroy_distributed_environment = destroy_distributed_environment
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    start_group()
    assert release_process_groups() == threads_before
    assert calls == ["model_parallel", "environment"] and not dist.is_initialized()
