"""The launch recipes: every one parses; those that can run on one machine run for real.

- `bash -n` on every shell recipe, YAML parsing and the fields that matter for the Kubernetes ones.
- The recipes ship the same rendezvous timing as `elastic_ddp.local_cluster` (the tested values).
- `node.sh` refuses bad settings with one line and exit status 2, before starting anything.
- `slurm.sbatch` trains a tiny job with stand-ins for `srun` and `scontrol` (they run the command
  on this machine), which exercises the script's own logic: node range, rendezvous endpoint from
  the node list, run id from the job id.
- `local_cluster.sh` runs for real in tests/test_report.py: two nodes, one killed as
  docs/getting-started.md says, then the report of that run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_ddp.testbed.local_cluster import MONITOR_INTERVAL_S, RDZV_CONF, free_port
from elastic_ddp.runlog.reader import read_events

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SHELL_RECIPES = sorted([*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")])
TINY_JOB = ["--model", "mlp", "--epochs", "1", "--dataset_size", "256", "--global_batch_size", "64",
            "--micro_batch_size", "32", "--snapshot_every_steps", "2", "--log_interval", "1"]

pytestmark = pytest.mark.timeout(240)


def run_script(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run a recipe in its own session, so that a timeout can take down every process it started."""
    process = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHON": sys.executable, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{args[1]} did not finish in {timeout:.0f} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, process.returncode, out, err)


# ------------------------------------------------------------------------------------- syntax

@pytest.mark.parametrize("recipe", SHELL_RECIPES, ids=lambda path: path.name)
def test_shell_recipes_parse(recipe):
    result = subprocess.run(["bash", "-n", str(recipe)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def kubernetes_documents() -> dict[str, list[dict]]:
    return {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
            for path in sorted((LAUNCH / "kubernetes").glob("*.yaml"))}


def test_kubernetes_pytorchjobs_are_elastic_and_use_the_shipped_settings():
    jobs = [d for documents in kubernetes_documents().values() for d in documents if d["kind"] == "PyTorchJob"]
    assert {job["spec"]["elasticPolicy"]["rdzvBackend"] for job in jobs} == {"c10d", "etcd-v3"}
    for job in jobs:
        assert job["apiVersion"] == "kubeflow.org/v1"
        policy = job["spec"]["elasticPolicy"]
        assert 1 <= policy["minReplicas"] <= job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] \
            <= policy["maxReplicas"]
        assert policy["maxRestarts"] > 0
        timing = [c for c in policy["rdzvConf"] if c["key"] in dict(kv.split("=") for kv in RDZV_CONF.split(","))]
        assert ",".join(f"{c['key']}={c['value']}" for c in timing) == RDZV_CONF
        container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        assert container["command"][:3] == ["python", "-m", "torch.distributed.run"]
        assert "elastic_ddp.train" in container["command"]
        env = {item["name"]: item["value"] for item in container["env"]}
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert float(env["PET_MONITOR_INTERVAL"]) == MONITOR_INTERVAL_S


def test_kubernetes_pytorchjobs_mount_node_memory_at_dev_shm_that_the_memory_tier_accepts():
    """A container's /dev/shm is 64 MiB, too small for a real state's memory copy (issue 27, 6e); an
    emptyDir is 0777 without the sticky bit, which the tier refuses: an init container fixes it."""
    jobs = [d for documents in kubernetes_documents().values() for d in documents if d["kind"] == "PyTorchJob"]
    assert len(jobs) == 2
    for job in jobs:
        pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"].endswith("Gi")
        trainer = pod["containers"][0]
        assert {"name": "shm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]
        assert not any(arg.startswith("--memory_dir") for arg in trainer["command"])  # the default: /dev/shm
        init = pod["initContainers"][0]
        assert init["command"] == ["chmod", "1777", "/dev/shm"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in init["volumeMounts"]


def test_the_etcd_statefulset_and_the_job_agree_on_the_members():
    documents = kubernetes_documents()
    statefulset = next(d for d in documents["etcd.yaml"] if d["kind"] == "StatefulSet")
    members = [f"etcd-{i}" for i in range(statefulset["spec"]["replicas"])]
    assert len(members) == 3
    command = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    initial_cluster = next(arg for arg in command if arg.startswith("--initial-cluster="))
    assert initial_cluster == "--initial-cluster=" + ",".join(f"{m}=https://{m}.etcd:2380" for m in members)
    assert {"--cert-file=/etc/etcd-tls/tls.crt", "--peer-client-cert-auth"} <= set(command)
    assert not [arg for arg in command if arg.startswith("--listen-client-urls=http:")], "clients over TLS only"
    assert any(arg.startswith("--auto-compaction-retention=") for arg in command)
    service = next(d for d in documents["etcd.yaml"] if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == statefulset["spec"]["serviceName"]
    job = next(d for d in documents["pytorchjob-etcd.yaml"] if d["kind"] == "PyTorchJob")
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["ETCD_ENDPOINTS"] == ",".join(f"{m}.etcd:2379" for m in members)
    assert "--rdzv_endpoint=$(ETCD_ENDPOINTS)" in container["command"]
    conf = {c["key"]: c["value"] for c in job["spec"]["elasticPolicy"]["rdzvConf"]}
    assert conf["protocol"] == "https" and conf["user"] == "trainer"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert os.path.dirname(conf["ca_cert"]) in mounts and os.path.dirname(conf["password_file"]) in mounts
    auth_job = next(d for d in documents["etcd.yaml"] if d["kind"] == "Job")
    script = auth_job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "role grant-permission elastic-ddp readwrite --prefix=true /elastic_ddp/rendezvous/" in script
    assert "auth enable" in script


def test_node_sh_ships_the_tested_rendezvous_timing():
    text = (LAUNCH / "node.sh").read_text()
    assert re.search(r'^DEFAULT_RDZV_CONF="([^"]+)"', text, re.M).group(1) == RDZV_CONF
    assert float(re.search(r"^DEFAULT_MONITOR_INTERVAL=(\S+)", text, re.M).group(1)) == MONITOR_INTERVAL_S


# ------------------------------------------------------------------------------------- node.sh

@pytest.mark.parametrize("env, message", [
    ({"RDZV_BACKEND": "zookeeper"}, "launch/node.sh: RDZV_BACKEND: got 'zookeeper'; expected elastic-c10d, c10d or etcd-v3"),
    ({"NNODES": "four"}, "launch/node.sh: NNODES: got 'four'; expected N or MIN:MAX, e.g. 1:4"),
    ({"NPROC_PER_NODE": "0"}, "launch/node.sh: NPROC_PER_NODE: got '0'; expected a positive integer"),
])
def test_node_sh_refuses_bad_settings_in_one_line(env, message):
    result = run_script(["bash", str(LAUNCH / "node.sh"), "--epochs", "1"], env, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == message


def test_slurm_sbatch_refuses_to_run_outside_slurm_and_etcd_without_endpoint(tmp_path):
    outside = run_script(["bash", str(LAUNCH / "slurm.sbatch")], {"SLURM_JOB_NODELIST": ""}, timeout=30)
    assert outside.returncode == 2 and "SLURM_JOB_NODELIST is not set" in outside.stderr
    etcd = run_script(["bash", str(LAUNCH / "slurm.sbatch")],
                      {"SLURM_JOB_NODELIST": "n1", "SLURM_SUBMIT_DIR": str(REPO), "RDZV_BACKEND": "etcd-v3",
                       "RDZV_ENDPOINT": ""}, timeout=30)
    assert etcd.returncode == 2 and "RDZV_ENDPOINT: required for etcd-v3" in etcd.stderr


# ------------------------------------------------------------------------------------- real runs

@pytest.mark.slow
def test_slurm_sbatch_runs_node_sh_on_every_allocated_node(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # srun: drop its options and run the task here (one node); scontrol: the node list is this host.
    (fake_bin / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    (fake_bin / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in fake_bin.iterdir():
        tool.chmod(0o755)
    checkpoint_dir = tmp_path / "ck"
    result = run_script(["bash", str(LAUNCH / "slurm.sbatch"), *TINY_JOB, "--checkpoint_dir", str(checkpoint_dir)],
                        {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[01]",
                         "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(REPO),
                         "RDZV_PORT": str(free_port())}, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nnodes 1:1, 1 per node; rendezvous elastic-c10d at 127.0.0.1:" in result.stderr
    assert "id 4242" in result.stderr
    events = read_events(checkpoint_dir / "events.jsonl")
    assert [(e["world_size"], e["run_id"]) for e in events if e["event"] == "start"] == [(1, "4242")]
    assert events[-1]["event"] == "finished" and events[-1]["global_step"] == 4
