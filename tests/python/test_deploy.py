"""The Kubernetes manifest: its ConfigMap is a configuration the real daemon accepts, and its
probes and volumes agree with it.

Run by CTest with TIERD_BIN and TIERCTL_BIN set.
"""
import os
import signal
import subprocess
import tempfile
import time

import yaml

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
                [os.environ["TIERD_BIN"], f"--config={path}", f"--socket_dir={d}/run",
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
