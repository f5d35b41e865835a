"""The tierd Python package (python/tierd) against a real daemon."""
import asyncio
import os
import shutil
import subprocess
import sys
import time

import pytest

from test_c_abi import daemon  # noqa: F401 (fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd  # noqa: E402

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")


@pytest.fixture
def client(daemon):  # noqa: F811
    with tierd.connect(daemon, "pytest-package") as c:
        yield c


def test_bytes_written_through_a_view_come_back_from_nvme(client):
    with client.allocate([1 << 20, 3 << 20]) as chunks:
        assert len(chunks) == 2
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE) as views:
            for i in range(2):
                view = views.memoryview(i)
                assert len(view) == chunks.sizes[i]
                view[:] = bytes([i + 1]) * len(view)
        client.evict(chunks, tierd.Tier.NVME).wait(timeout=30)
        assert client.prefetch(chunks, tierd.Tier.HOST).done() in (True, False)
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.READ) as views:
            views.ready.wait(timeout=30)
            for i in range(2):
                assert bytes(views.memoryview(i)) == bytes([i + 1]) * chunks.sizes[i]
        used = client.tier_usage(tierd.Tier.HOST).used_bytes
        assert used >= 4 << 20
    # Leaving the chunk set freed its chunks.
    assert client.tier_usage(tierd.Tier.HOST).used_bytes <= used - (4 << 20)


def test_refusals_are_exceptions_with_the_code_and_the_daemons_words(client):
    with pytest.raises(tierd.TierdError) as full:
        client.allocate([1 << 40])
    assert full.value.code_name in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT")
    assert "host" in full.value.message
    with pytest.raises(tierd.TierdError) as unknown:
        client.prefetch([1 << 60], tierd.Tier.HOST)
    assert unknown.value.code_name == "NOT_FOUND" and unknown.value.code == 5
    with pytest.raises(tierd.TierdError) as empty:
        client.allocate([])
    assert empty.value.code_name == "INVALID_ARGUMENT"
    # The session is still usable after refusals.
    with client.allocate([4096]) as chunks:
        assert len(chunks) == 1


def test_a_gpu_stream_wait_on_an_emulated_device_says_there_is_no_stream(client):
    with client.allocate([4096]) as chunks:
        done = client.prefetch(chunks, tierd.Tier.HOST)
        done.wait(timeout=30)
        with pytest.raises(tierd.TierdError) as e:
            done.stream_wait(0)
        assert e.value.code_name == "FAILED_PRECONDITION"
        assert "emulated" in e.value.message


def test_a_pinned_shared_base_outlives_its_holders_until_unpinned(client):
    made = client.open_base("pinned-base", sizes=[4096], descriptor=b"v1")
    assert made.created
    with pytest.raises(tierd.TierdError) as unsealed:
        client.pin_base("pinned-base")
    assert unsealed.value.code_name == "FAILED_PRECONDITION"
    client.seal_base("pinned-base")
    client.pin_base("pinned-base")
    client.release_base("pinned-base")
    again = client.open_base("pinned-base")  # kept with no holder: opened, not made anew
    assert not again.created and again.descriptor == b"v1"
    client.release_base("pinned-base")
    client.pin_base("pinned-base", False)  # no holder left: it goes
    with pytest.raises(tierd.TierdError) as gone:
        client.open_base("pinned-base")
    assert gone.value.code_name == "NOT_FOUND"


def test_a_view_after_release_is_refused_not_dangling(client):
    with client.allocate([4096]) as chunks:
        views = client.acquire(chunks, tierd.Tier.HOST, tierd.Access.WRITE)
        views.release()
        with pytest.raises(tierd.TierdError) as released:
            views.memoryview(0)
        assert released.value.code_name == "FAILED_PRECONDITION"


def test_a_schedule_is_declared_traced_and_followed_from_python(client):
    with client.allocate([1 << 20] * 3, tierd.Tier.NVME) as chunks:
        steps = [[(i, tierd.Tier.HOST, tierd.Access.READ)] for i in chunks.ids] + [[]]
        client.set_schedule(steps)
        stats = client.stats()
        assert stats.schedule_steps == 4 and not stats.tracing
        client.begin_step(2)
        deadline = time.monotonic() + 5
        while client.stats().cursor != 3 and time.monotonic() < deadline:  # read each ms
            time.sleep(0.01)
        assert client.stats().cursor == 3
        with pytest.raises(tierd.TierdError) as refused:  # NVMe is not a tier to schedule into
            client.set_schedule([[(chunks.ids[0], tierd.Tier.NVME, tierd.Access.READ)]])
        assert refused.value.code_name == "INVALID_ARGUMENT"
        assert client.stats().schedule_steps == 4  # the schedule in force stays
        client.trace_schedule(3)
        assert client.stats().tracing
        client.set_schedule([])
        assert client.stats().schedule_steps == 0


def test_completions_can_be_awaited(client):
    async def move(chunks):
        await client.evict(chunks, tierd.Tier.NVME)
        await client.prefetch(chunks, tierd.Tier.HOST)

    with client.allocate([1 << 20] * 3) as chunks:
        asyncio.run(move(chunks))
        stats = client.stats()
        assert stats.acquired_ready + stats.acquired_waited >= 0


def test_socket_dir_comes_from_the_environment(daemon, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TIERD_SOCKET_DIR", daemon)
    with tierd.connect() as c:
        assert c.session_id > 0
        assert not c.closed
    assert c.closed
    monkeypatch.setenv("TIERD_SOCKET_DIR", "/nonexistent")
    with pytest.raises(tierd.TierdError) as gone:
        tierd.connect()
    assert gone.value.code_name == "UNAVAILABLE"


def test_python_m_tierd_status(daemon):  # noqa: F811
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    out = subprocess.run([sys.executable, "-m", "tierd", "status", "--socket-dir", daemon],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "host" in out.stdout and "nvme" in out.stdout and "emulated" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tierd", "status", "--socket-dir", "/nonexistent"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "UNAVAILABLE" in bad.stderr


def test_the_library_is_found_beside_the_package(tmp_path):
    shutil.copytree(os.path.join(PACKAGE_DIR, "tierd"), tmp_path / "tierd")
    shutil.copy(os.environ["TIERD_CLIENT_LIB"], tmp_path / "tierd" / "libtierd_client.so.0")
    env = {k: v for k, v in os.environ.items() if k != "TIERD_CLIENT_LIB"}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import tierd._abi as a; print(a.library_path())"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(tmp_path / "tierd" / "libtierd_client.so.0"), out.stderr


def test_jobs_are_attributed_in_tierctl_status_and_metrics(tmp_path, monkeypatch):
    """Two jobs on one daemon ($TIERD_JOB): tierctl status and /metrics tell their chunks and
    traffic apart; a malformed job label is refused at connect, naming the rule."""
    import json
    import re
    import urllib.request
    from test_c_abi import start_daemon, stop_daemon
    root = str(tmp_path)
    proc = start_daemon(root, "--device=none", "--probe_bytes=0", "--metrics_listen=127.0.0.1:0")
    try:
        clients = {}
        for job, n in (("run-a", 2), ("sweep/run-b", 1)):
            monkeypatch.setenv("TIERD_JOB", job)
            c = clients[job] = tierd.connect(root, f"trainer {job}")
            chunks = c.allocate([1 << 20] * n)
            with c.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE) as views:
                for i in range(n):
                    views.memoryview(i)[:] = b"\x01" * (1 << 20)
            c.evict(chunks, tierd.Tier.NVME).wait(timeout=30)
        monkeypatch.setenv("TIERD_JOB", "two words")
        with pytest.raises(tierd.TierdError) as bad:
            tierd.connect(root, "bad job")
        assert bad.value.code_name == "INVALID_ARGUMENT" and "job label" in bad.value.message
        monkeypatch.delenv("TIERD_JOB")

        out = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={root}", "--json",
                              "status", "--sample=0"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        sessions = {s["client_name"]: s for s in json.loads(out.stdout)["session_list"]}
        a, b = sessions["trainer run-a"], sessions["trainer sweep/run-b"]
        assert (a["job"], a["chunks"], a["moved_bytes"]) == ("run-a", 2, 2 << 20)
        assert (b["job"], b["chunks"], b["moved_bytes"]) == ("sweep/run-b", 1, 1 << 20)
        assert sessions["tierctl"]["job"] is None
        table = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={root}", "status",
                                "--sample=0"], capture_output=True, text=True, timeout=60).stdout
        assert re.search(r"trainer run-a\s+run-a\s", table), table

        url = re.search(r"serving metrics on (http://\S+)",
                        open(os.path.join(root, "daemon.log")).read()).group(1)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for job, n in (("run-a", 2), ("sweep/run-b", 1)):
            assert f'tierd_job_sessions{{job_name="{job}"}} 1' in text
            assert f'tierd_job_chunks{{job_name="{job}"}} {n}' in text
            assert f'tierd_job_bytes{{job_name="{job}"}} {n << 20}' in text
            assert (f'tierd_job_moved_bytes_total{{job_name="{job}",path="host_to_nvme"}} '
                    f'{n << 20}') in text
        clients.pop("sweep/run-b").close()
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'job_name="sweep/run-b"' not in text and 'job_name="run-a"' in text
        clients.pop("run-a").close()
    finally:
        stop_daemon(proc, root)
