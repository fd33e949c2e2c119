"""Multi-node fits (2 nodes x 1 process, gloo, CPU) launched as torchrun and as SLURM would launch them.

Nodes are simulated on 127.0.0.1: each node is a process (tree) of its own started at the same time,
with a working directory of its own (as two machines without a shared disk have) unless a test says
otherwise. The worker is ``tests/multinode_worker.py``: tiny PPO and GRPO fits (those of
``tests/distributed_worker.py``, same fixed global batch) with ``Trainer(num_nodes=2, devices=1)``
under DDP, a CSVLogger (with the sample tables), a ModelCheckpoint and an HFExport writing relative to
the working directory. Its single-process run (``num_nodes=1``) is the reference.

What is checked:

* torchrun: two ``torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank {0,1}`` launchers
  rendezvous on a free local port; Lightning picks TorchElasticEnvironment with global rank = node rank
  (0, 1), local rank 0, world size 2; the logged per-rollout PPO and GRPO metrics equal the single
  process's (within 1e-4).
* rank-0-only output: node 0's folder holds exactly the files of the single-process run (export with
  its marker, one checkpoint per fit, metrics.csv, hparams.yaml and samples.jsonl; the GRPO sample table
  equals the single process's line for line), node 1's folder stays empty. With one shared folder
  (same working directory for both nodes) and rank 1 held back before HFExport runs, the folder again
  holds exactly the single process's files, and both ranks succeed (a rank checking the export folder
  after rank 0 had written it used to fail with "already holds another run's export").
* FSDP2 across the two nodes: a fit continued from its sharded checkpoint replaces its own export
  (FSDP strategies restore callback states after ``on_fit_start``; HFExport's check used to refuse it).
* SLURM: with the variables ``srun`` sets for a 2-node x 1-task job (SLURM_NTASKS, SLURM_NTASKS_PER_NODE,
  SLURM_NNODES, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_NODELIST)
  a ``Trainer(num_nodes=2, devices=1, strategy=DDPStrategy(gloo))`` picks SLURMEnvironment with the ranks
  SLURM gives (also for a 2 x 2 job); and two plain processes with those variables (plus MASTER_ADDR /
  MASTER_PORT; Lightning launches nothing itself under SLURM) fit PPO and GRPO with the single
  process's metrics, node 1 writing nothing.

Marker ``distributed`` (part of ``make test``); alone: ``pytest -m distributed tests/test_multinode.py``
(about 40 s on two free cores).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import kill_tree

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "multinode_worker.py"
TOL = 1e-4
TIMEOUT = 240  # seconds for one launch (all its nodes)
GRACE = 20  # seconds the other nodes get once one has failed
SAMPLE_ROWS, ROLLOUTS = 2, 3  # multinode_worker.SAMPLE_ROWS; max_epochs of its Trainer
# launcher / rank variables of an outer torchrun or SLURM job: each simulated node gets only its own
LAUNCH_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def slurm_env(
    procid: int, nodes: int = 2, tasks_per_node: int = 1, port: int | None = None
) -> dict[str, str]:
    """The variables ``srun`` sets in task ``procid`` of a ``--nodes N --ntasks-per-node T`` job."""
    env = {
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % tasks_per_node),
        "SLURM_NODEID": str(procid // tasks_per_node),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lit-rlhf-multinode",  # not 'bash' / 'interactive' (Lightning's interactive mode)
        "SLURM_NODELIST": f"node[0-{nodes - 1}]",
    }
    if port is not None:  # real jobs export these in the batch script (MASTER_ADDR from the node list)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def launch(cmds: list[list[str]], cwds: list[Path], envs: list[dict], logs: Path) -> list[int]:
    """Start every node's command at once and wait for all of them; their return codes.

    Once a node has failed the others get GRACE seconds (torchrun's agent would wait 300 s at its exit
    barrier for a failed peer); a launch running past TIMEOUT fails the test. Nodes still running then are
    killed (each node's launcher with all its descendants)."""
    procs = []
    for i, (cmd, cwd, env) in enumerate(zip(cmds, cwds, envs)):
        with open(logs / f"node{i}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    start, failed_at, timed_out = time.monotonic(), None, False
    while any(proc.poll() is None for proc in procs):
        now = time.monotonic()
        if failed_at is None and any(proc.poll() not in (None, 0) for proc in procs):
            failed_at = now
        timed_out = now - start > TIMEOUT
        if timed_out or (failed_at is not None and now - failed_at > GRACE):
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc.pid)  # the launcher and its workers (torchrun gives each a session of its own)
            proc.wait()
    if timed_out and failed_at is None:
        pytest.fail(f"the nodes ran past {TIMEOUT} s:\n{node_logs(logs)}")
    return [proc.returncode for proc in procs]


def node_logs(logs: Path) -> str:
    """The end of each node's output; torchrun prefixes each rank's own traceback with [rankN]."""
    parts = []
    for path in sorted(logs.glob("node*.log")):
        text = path.read_text()
        ranks = "\n".join(line for line in text.splitlines() if line.startswith("[rank"))
        parts.append(f"--- {path.name}\n{(ranks or text)[-3000:]}")
    return "\n".join(parts)


def worker_cmd(tokenizer: str, info: Path, num_nodes: int, runs: str, *extra: str) -> list[str]:
    cmd = [str(WORKER), "--num_nodes", str(num_nodes), "--tokenizer", tokenizer, "--info", str(info)]
    return [*cmd, "--runs", runs, *extra]


class Launch:
    """One simulated job: each node's working directory, the info folder and logs; results and rank infos."""

    def __init__(self, root: Path, nodes: int, shared_cwd: bool = False) -> None:
        self.info, self.logs = root / "info", root / "logs"
        self.cwds = [root / ("shared" if shared_cwd else f"node{i}") for i in range(nodes)]
        for path in (self.info, self.logs, *self.cwds):
            path.mkdir(exist_ok=True)

    def check(self, codes: list[int]) -> Launch:
        assert codes == [0] * len(codes), f"return codes {codes}\n{node_logs(self.logs)}"
        return self

    @property
    def results(self) -> dict:
        return json.loads((self.info / "results.json").read_text())

    def rank(self, global_rank: int) -> dict:
        return json.loads((self.info / f"rank{global_rank}.json").read_text())


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# -- the launches (each once per module) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def single(tokenizer_dir, tmp_path_factory) -> Launch:
    job = Launch(tmp_path_factory.mktemp("single"), nodes=1)
    cmd = [sys.executable, *worker_cmd(tokenizer_dir, job.info, 1, "ppo,grpo")]
    return job.check(launch([cmd], job.cwds, [base_env()], job.logs))


def torchrun_job(tokenizer_dir: str, root: Path, runs: str, shared_cwd: bool = False, *extra: str) -> Launch:
    job, port = Launch(root, nodes=2, shared_cwd=shared_cwd), free_port()
    cmds = [
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
            *worker_cmd(tokenizer_dir, job.info, 2, runs, *extra),
        ]
        for node in (0, 1)
    ]  # fmt: skip
    return job.check(launch(cmds, job.cwds, [base_env()] * 2, job.logs))


@pytest.fixture(scope="module")
def torchrun(tokenizer_dir, tmp_path_factory) -> Launch:
    return torchrun_job(tokenizer_dir, tmp_path_factory.mktemp("torchrun"), "ppo,grpo")


@pytest.fixture(scope="module")
def slurm(tokenizer_dir, tmp_path_factory) -> Launch:
    job, port = Launch(tmp_path_factory.mktemp("slurm"), nodes=2), free_port()
    cmd = [sys.executable, *worker_cmd(tokenizer_dir, job.info, 2, "ppo,grpo")]
    envs = [{**base_env(), **slurm_env(task, port=port)} for task in (0, 1)]
    return job.check(launch([cmd, cmd], job.cwds, envs, job.logs))


# -- metrics -------------------------------------------------------------------------------------------
def assert_metrics_equal(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) == set(expected), what
    for key, values in expected.items():
        assert len(actual[key]) == len(values) == ROLLOUTS, (what, key, actual[key], values)
        for i, (a, e) in enumerate(zip(actual[key], values)):
            assert abs(a - e) <= TOL, f"{what} {key}[{i}]: {a} != {e}"


def test_reference_run_preconditions(single):
    # The worker's conditions for exact equality (see distributed_worker): PPO's greedy responses all
    # have the full length, GRPO's groups carry some signal; and the policies moved.
    ppo, grpo = single.results["ppo"], single.results["grpo"]
    assert ppo["rollout/response_length"] == [6.0] * ROLLOUTS
    assert any(s > 0 for s in ppo["rollout/score"])
    assert any(s > 0 for s in grpo["rollout/group_score_std"])
    assert ppo["rollout/kl_ref"][2] > 0.01 and grpo["rollout/kl_ref"][2] > 0.01


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
@pytest.mark.parametrize("run", ["ppo", "grpo"])
def test_two_nodes_equal_single_process(request, single, launcher, run):
    job = request.getfixturevalue(launcher)
    assert_metrics_equal(job.results[run], single.results[run], f"{launcher} {run}")


@pytest.mark.parametrize(
    "launcher, environment", [("torchrun", "TorchElasticEnvironment"), ("slurm", "SLURMEnvironment")]
)
def test_ranks_resolved_per_node(request, launcher, environment):
    job = request.getfixturevalue(launcher)
    for rank in (0, 1):
        for run, info in job.rank(rank).items():
            assert info == {
                "global_rank": rank, "node_rank": rank, "local_rank": 0, "world_size": 2, "num_nodes": 2,
                "environment": environment, "cwd": str(job.cwds[rank]),
            }, (launcher, run)  # fmt: skip


# -- rank-0-only output --------------------------------------------------------------------------------
def expected_files(single: Launch, runs: tuple[str, ...] = ("ppo", "grpo")) -> list[str]:
    """The single process's output files (of ``runs``), with sanity checks of what they hold."""
    names = files(single.cwds[0])
    for run in runs:
        assert (
            f"export/{run}/lit_rlhf_export.json" in names and f"export/{run}/actor/model.safetensors" in names
        )
        assert sum(n.startswith(f"ckpt/{run}/") and n.endswith(".ckpt") for n in names) == 1, names
        assert f"logs/{run}/version_0/samples.jsonl" in names and f"logs/{run}/version_0/metrics.csv" in names
    return [n for n in names if n.split("/")[1] in runs]


def check_rank_zero_output(folder: Path, single: Launch, runs: tuple[str, ...] = ("ppo", "grpo")) -> None:
    assert files(folder) == expected_files(single, runs), "the same files as one process writes, once"
    for run in runs:
        rows = [
            json.loads(line)
            for line in (folder / f"logs/{run}/version_0/samples.jsonl").read_text().splitlines()
        ]
        assert [(r["step"], r["tag"]) for r in rows] == [
            (step, "rollout/samples") for step in range(ROLLOUTS) for _ in range(SAMPLE_ROWS)
        ], run
        marker = json.loads((folder / f"export/{run}/lit_rlhf_export.json").read_text())
        assert set(marker) == {"run_id"}
    # GRPO: rank 0's first rows are the K = 2 copies of prompt 0, sampled with per-row seeds: the table
    # is the single process's line for line
    if "grpo" in runs:
        samples = "logs/grpo/version_0/samples.jsonl"
        assert (folder / samples).read_text() == (single.cwds[0] / samples).read_text()


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_rank_zero_output_written_once(request, single, launcher):
    # Global rank 0 runs on node 0 (test_ranks_resolved_per_node): its folder holds the export, the
    # checkpoints and the logs with sample tables; node 1 (global rank 1) writes nothing at all.
    job = request.getfixturevalue(launcher)
    check_rank_zero_output(job.cwds[0], single)
    assert files(job.cwds[1]) == [], "node 1 wrote files"


def test_shared_folder_rank_zero_output_once(tokenizer_dir, tmp_path, single):
    # Both nodes in one folder (a shared filesystem); rank 1 reaches the end of the fit 2 s after rank 0
    # (multinode_worker --slow_rank), so rank 0 has written the export by the time rank 1's HFExport looks
    # at the folder: both ranks succeed and the folder holds each file once.
    job = torchrun_job(tokenizer_dir, tmp_path, "grpo", True, "--slow_rank", "2")
    check_rank_zero_output(job.cwds[0], single, runs=("grpo",))
    assert_metrics_equal(job.results["grpo"], single.results["grpo"], "shared folder grpo")


def test_fsdp2_continuation_replaces_its_own_export(tokenizer_dir, tmp_path):
    # FSDP2 (ModelParallelStrategy) over the two nodes, one shared folder: GRPO for one rollout, exported;
    # then continued from its sharded checkpoint by a new Trainer and HFExport on the same folder. FSDP
    # strategies restore the callbacks' states only after on_fit_start, so the export check used to run
    # with a fresh run id and refuse the run's own export ("already holds another run's export").
    job = torchrun_job(tokenizer_dir, tmp_path, "grpo_continue", True, "--strategy", "fsdp2")
    result = job.results["grpo_continue"]
    assert result["sharded"], "the FSDP2 checkpoint should be a sharded (directory) checkpoint"
    first, second = result["marker_run_ids"]
    assert first == second, "the continuation is the same run"
    assert job.rank(1)["grpo_continue"]["node_rank"] == 1


# -- SLURM environment resolution (no launch) --------------------------------------------------------
RESOLVE = """
import json, os, sys
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
for nodes, devices, tasks in json.loads(sys.argv[1]):  # each job's shape and its tasks' srun variables
    for task in tasks:  # in turn (every task sets the same variables)
        os.environ.update(task)
        trainer = Trainer(
            num_nodes=nodes, devices=devices, accelerator="cpu", strategy=DDPStrategy(process_group_backend="gloo"),
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
        )
        env = trainer.strategy.cluster_environment
        print(json.dumps({
            "job": [nodes, devices], "environment": type(env).__name__, "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank, "local_rank": trainer.local_rank, "world_size": trainer.world_size,
            "creates_processes_externally": env.creates_processes_externally,
        }))
"""
SLURM_JOBS = [(2, 1), (2, 2)]  # (nodes, tasks per node)


@pytest.fixture(scope="module")
def slurm_resolved() -> dict[tuple[int, int], list[dict]]:
    """(nodes, tasks per node) -> what a Trainer built with each task's variables resolved, task by task.

    One subprocess (the Trainer sets process-wide rank state) for every job of ``SLURM_JOBS``; nothing
    is launched."""
    jobs = [[n, t, [slurm_env(procid, n, t) for procid in range(n * t)]] for n, t in SLURM_JOBS]
    cmd = [sys.executable, "-c", RESOLVE, json.dumps(jobs)]
    proc = subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved: dict[tuple[int, int], list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            resolved.setdefault(tuple(row.pop("job")), []).append(row)
    return resolved


@pytest.mark.parametrize("nodes, tasks_per_node", SLURM_JOBS)
def test_slurm_environment_resolved(slurm_resolved, nodes, tasks_per_node):
    assert slurm_resolved.get((nodes, tasks_per_node)) == [
        {
            "environment": "SLURMEnvironment",
            "global_rank": procid,  # SLURM_PROCID
            "node_rank": procid // tasks_per_node,  # SLURM_NODEID
            "local_rank": procid % tasks_per_node,  # SLURM_LOCALID
            "world_size": nodes * tasks_per_node,  # SLURM_NTASKS
            "creates_processes_externally": True,  # srun started the processes: Lightning starts none
        }
        for procid in range(nodes * tasks_per_node)
    ]
