"""The Kubernetes manifest: its ConfigMap is a configuration the real daemon accepts, and its
probes and volumes agree with it.

Run by CTest with TIERD_BIN and TIERCTL_BIN set.
"""
import os
import re
import signal
import subprocess
import tempfile
import time

import yaml

from test_c_abi import DIES_WITH_TEST

MANIFEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy",
                        "kubernetes", "tierd.yaml")


def documents():
    with open(MANIFEST) as f:
        return {d["kind"]: d for d in yaml.safe_load_all(f)}


def test_the_configmap_is_a_config_the_daemon_runs_with():
    config = documents()["ConfigMap"]["data"]["tierd.toml"]
    with tempfile.TemporaryDirectory(prefix="tierd-k8s-") as d:
        path = os.path.join(d, "tierd.toml")
        with open(path, "w") as f:
            f.write(config)
        # Every key as written (the socket group as a gid included); only what needs the node
        # (paths, sizes, the GPU, the port) is overridden by flags.
        log_path = os.path.join(d, "daemon.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*DIES_WITH_TEST, os.environ["TIERD_BIN"], f"--config={path}",
                 f"--socket_dir={d}/run",
                 f"--state_dir={d}/state", "--host_capacity=64MiB",
                 "--host_segment_size=16MiB", "--lock_memory=false",
                 f"--nvme_regions={d}/r0:128MiB", "--device=none", "--probe_bytes=0",
                 "--metrics_listen=127.0.0.1:0"],
                stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 30
            while True:
                r = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={d}/run", "health"],
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    break
                assert proc.poll() is None, open(log_path).read()
                assert time.monotonic() < deadline, r.stdout + open(log_path).read()
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, open(log_path).read()


def test_probes_volumes_and_memlock_agree_with_the_config():
    docs = documents()
    config = docs["ConfigMap"]["data"]["tierd.toml"]
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert 'socket_dir = "/run/tierd"' in config
    assert 'socket_group = "2000"' in config
    assert hostpaths[mounts["/run/tierd"]] == "/run/tierd"
    assert 'state_dir = "/var/lib/tierd"' in config and "/var/lib/tierd" in mounts
    assert "/mnt/nvme0/tierd/tierd.region" in config and "/mnt/nvme0/tierd" in mounts
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert pod["hostIPC"] is True
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"] == [
            "/usr/bin/tierctl", "--socket_dir=/run/tierd", "health"], probe
    assert container["ports"][0]["containerPort"] == 9477 and 'listen = "0.0.0.0:9477"' in config
    # The pinned host tier fits in the container's memory limit.
    assert 'capacity = "64GiB"' in config
    assert int(container["resources"]["limits"]["memory"].rstrip("Gi")) >= 64 + 4


JOB = os.path.join(os.path.dirname(MANIFEST), "training-job.yaml")


def test_the_training_job_agrees_with_itself_and_with_the_daemonset():
    with open(JOB) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    service, job = docs["Service"], docs["Job"]
    pod = job["spec"]["template"]["spec"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    (container,) = pod["containers"]
    args = dict(a[2:].split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)

    # One pod per node, as many as torchrun's nodes, pod 0 reachable by name for the rendezvous.
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(args["nnodes"])
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"].items() <= labels.items()
    host, port = args["rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert int(args["nproc_per_node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    # A failed rank fails the job, not a restart of one node's ranks into a running job.
    assert args["max_restarts"] == "0" and job["spec"]["backoffLimit"] == 0
    assert pod["restartPolicy"] == "Never"

    # Every pod reaches its node's daemon: the DaemonSet's socket directory, its socket group,
    # the node's IPC namespace.
    daemon = documents()
    config = daemon["ConfigMap"]["data"]["tierd.toml"]
    group = int(re.search(r'socket_group = "(\d+)"', config).group(1))
    assert group in pod["securityContext"]["supplementalGroups"]
    assert pod["hostIPC"] is True
    ds_pod = daemon["DaemonSet"]["spec"]["template"]["spec"]
    (ds_container,) = ds_pod["containers"]
    ds_mount = next(m for m in ds_container["volumeMounts"] if m["mountPath"] == "/run/tierd")
    ds_path = next(v["hostPath"]["path"] for v in ds_pod["volumes"]
                   if v["name"] == ds_mount["name"])
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == env["TIERD_SOCKET_DIR"])
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == ds_path
    assert f'socket_dir = "{ds_mount["mountPath"]}"' in config
