"""tierctl against a real daemon: what it reports, and drain/evict moving other sessions' chunks.

Run by CTest with TIERD_BIN, TIERD_CLIENT_LIB and TIERCTL_BIN set.
"""
import ctypes
import json
import os
import subprocess

from tierd_abi import BaseCreate, BaseInfo

from test_c_abi import (ACCESS_READ, ACCESS_WRITE, DIES_WITH_TEST, OK, TIER_HOST,  # noqa: F401
                        Completion, client, daemon, lib, load_library)

WAIT_NS = 10_000_000_000


def tierctl(daemon_dir, *args):
    r = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon_dir}", *args],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def tierctl_json(daemon_dir, *args):
    rc, out, err = tierctl(daemon_dir, "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def fill(lib, client, ids, n, size, value, access=ACCESS_WRITE):
    ptrs = (ctypes.c_void_p * n)()
    ready = Completion()
    assert lib.tierd_acquire(client, n, ids, TIER_HOST, access, ptrs, None,
                             ctypes.byref(ready)) == OK, lib.tierd_last_error()
    assert lib.tierd_wait(client, ready, WAIT_NS) == OK
    for i in range(n):
        if access == ACCESS_WRITE:
            ctypes.memset(ptrs[i], value + i, size)
        else:
            assert ctypes.string_at(ptrs[i], size) == bytes([value + i]) * size
    assert lib.tierd_release(client, n, ids) == OK


def test_status_chunks_drain_and_evict(lib, client, daemon):
    n, size = 3, 1 << 20
    sizes = (ctypes.c_uint64 * n)(*[size] * n)
    ids = (ctypes.c_uint64 * n)()
    assert lib.tierd_allocate(client, n, sizes, TIER_HOST, ids) == OK, lib.tierd_last_error()
    fill(lib, client, ids, n, size, 0x30)
    # One chunk stays acquired: drain must leave it.
    ptr = ctypes.c_void_p()
    ready = Completion()
    held = (ctypes.c_uint64 * 1)(ids[2])
    assert lib.tierd_acquire(client, 1, held, TIER_HOST, ACCESS_READ, ctypes.byref(ptr), None,
                             ctypes.byref(ready)) == OK
    session = lib.tierd_session_id(client)

    status = tierctl_json(daemon, "status", "--sample=0.2s")
    host = next(t for t in status["tiers"] if t["tier"] == "host")
    assert host["configured"] and host["used_bytes"] >= n * size
    assert {p["path"] for p in status["paths"]} == {
        "nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host"}
    assert status["sample_seconds"] == 0.2
    mine = next(s for s in status["session_list"] if s["id"] == session)
    assert mine["client_name"] == "pytest" and mine["chunks"] >= n and mine["pinned_chunks"] == 1
    rc, out, _ = tierctl(daemon, "status", "--sample=0")
    assert rc == 0 and "host" in out and "pytest" in out

    listed = tierctl_json(daemon, "chunks", "--tier=host", f"--session={session}")
    assert sorted(c["id"] for c in listed) == sorted(ids)
    pinned = tierctl_json(daemon, "chunks", "--pinned", f"--session={session}")
    assert [c["id"] for c in pinned] == [ids[2]]

    drained = tierctl_json(daemon, "drain", "--tier=host")
    assert drained["ok"] and drained["pinned_chunks"] >= 1
    assert drained["chunks"] >= n - 1 and drained["bytes"] >= (n - 1) * size
    on_host = {c["id"] for c in tierctl_json(daemon, "chunks", "--tier=host")}
    assert ids[0] not in on_host and ids[1] not in on_host and ids[2] in on_host
    assert lib.tierd_release(client, 1, held) == OK
    fill(lib, client, ids, n, size, 0x30, access=ACCESS_READ)  # nothing lost on the way

    # Evict names chunks; one that does not exist is a clear error, and nothing moves.
    rc, _, err = tierctl(daemon, "evict", "--tier=host", str(ids[0]), "987654321")
    assert rc == 1 and "chunk 987654321 does not exist" in err
    rc, out, _ = tierctl(daemon, "evict", "--tier=host", str(ids[0]))
    assert rc == 0 and out.startswith("done: moved 1 chunk(s)")
    assert lib.tierd_free(client, n, ids) == OK


def test_health_is_an_exit_code_for_probes(daemon, tmp_path):
    rc, out, _ = tierctl(daemon, "health")
    assert rc == 0 and out.startswith("ok: tierd ")
    assert tierctl_json(daemon, "health")["healthy"] is True
    rc, out, _ = tierctl(str(tmp_path), "--json", "health")
    assert rc == 1
    answer = json.loads(out)
    assert answer["healthy"] is False and "cannot reach tierd" in answer["reason"]


def test_bench_measures_every_path_beside_its_probe_and_frees_its_chunks(daemon):
    before = tierctl_json(daemon, "status", "--sample=0")
    bench = tierctl_json(daemon, "bench", "--size=8MiB", "--chunk=2MiB")
    assert bench["chunk_bytes"] == 2 << 20
    paths = {p["path"]: p for p in bench["paths"]}
    assert set(paths) == {"host_to_nvme", "nvme_to_host", "host_to_device", "device_to_host"}
    for p in paths.values():
        assert p["bytes"] == 8 << 20 and p["seconds"] > 0 and p["bytes_per_second"] > 0
        assert p["probed_bytes_per_second"] > 0  # the fixture's daemon probes at start-up
    after = tierctl_json(daemon, "status", "--sample=0")
    moved = {p["path"]: p["bytes_total"] for p in after["paths"]}
    for p in before["paths"]:
        assert moved[p["path"]] - p["bytes_total"] >= 8 << 20, p["path"]
    assert after["chunks"] == before["chunks"]  # the bench's chunks are gone
    rc, _, err = tierctl(daemon, "bench", "--size=1GiB")
    assert rc == 1 and "try --size=" in err


def test_bad_usage_says_why_and_exits_2(daemon):
    for args, why in [(["bogus"], "unknown command 'bogus'"),
                      (["drain"], "--tier is device or host"),
                      (["drain", "--tier=nvme"], "--tier is device or host"),
                      (["evict", "--tier=host"], "evict takes the ids"),
                      (["evict", "--tier=host", "x1"], "'x1' is not a chunk id"),
                      (["chunks", "--tier=gpu"], "--tier is device, host or nvme"),
                      (["status", "--sample=soon"], "--sample takes a duration"),
                      (["status", "--frobnicate"], "'status' takes no --frobnicate"),
                      (["bench", "--size=lots"], "--size takes a size"),
                      (["bench", "--size=1MiB", "--chunk=2MiB"], "--chunk is larger than --size"),
                      ([], "usage: tierctl")]:
        rc, _, err = tierctl(daemon, *args)
        assert rc == 2 and why in err, (args, err)


def test_quotas_are_enforced_and_reported_by_status_and_metrics(lib, tmp_path):
    """A user's quota: RESOURCE_EXHAUSTED naming it, and what it holds in tierctl and /metrics."""
    import re
    import signal
    import time
    import urllib.request
    config = tmp_path / "tierd.toml"
    config.write_text("[quota]\nhost = \"4MiB\"\n\n[limits]\nchunks_per_session = 10\n")
    run = tmp_path / "run"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen(
        [*DIES_WITH_TEST, os.environ["TIERD_BIN"], f"--config={config}", f"--socket_dir={run}",
         f"--state_dir={tmp_path}/state", "--nvme_regions=none", "--host_capacity=32MiB",
         "--host_segment_size=16MiB", "--lock_memory=false", "--device=none",
         "--metrics_listen=127.0.0.1:0"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not (run / "tierd.sock").exists():
            assert proc.poll() is None, open(log.name).read()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        handle = ctypes.c_void_p()
        assert lib.tierd_connect(str(run).encode(), b"quota", ctypes.byref(handle)) == OK
        one = (ctypes.c_uint64 * 1)(4 << 20)
        ids = (ctypes.c_uint64 * 1)()
        assert lib.tierd_allocate(handle, 1, one, TIER_HOST, ids) == OK, lib.tierd_last_error()
        assert lib.tierd_allocate(handle, 1, one, TIER_HOST, ids) == 8  # RESOURCE_EXHAUSTED
        assert b"quota of 4 MiB (quota.host)" in lib.tierd_last_error()

        status = tierctl_json(str(run), "status", "--sample=0")
        me = next(t for t in status["tenants"] if t["uid"] == os.getuid())
        host = next(t for t in me["tiers"] if t["tier"] == "host")
        assert host == {"tier": "host", "used_bytes": 4 << 20, "quota_bytes": 4 << 20}
        assert me["sessions"] == 2 and me["chunks"] == 1  # tierctl has a session too
        assert me["refusals"] == {"quota.host": 1}
        assert status["limits"]["chunks_per_session"] == 10
        rc, out, _ = tierctl(str(run), "status", "--sample=0")
        assert rc == 0 and "4 MiB/4 MiB" in out and "quota.host 1" in out, out

        url = re.search(r"serving metrics on (http://\S+)", open(log.name).read()).group(1)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        uid = os.getuid()
        assert f'tierd_user_bytes{{uid="{uid}",tier="host"}} 4194304' in text
        assert f'tierd_user_quota_bytes{{uid="{uid}",tier="host"}} 4194304' in text
        assert f'tierd_limit_refusals_total{{uid="{uid}",limit="quota.host"}} 1' in text
        assert f'tierd_user_sessions{{uid="{uid}"}} 1' in text
        lib.tierd_close(handle)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, open(log.name).read()


# The shape of every --json output (tierctl_json_schema.json), recorded from the hand-written
# printers before tierctl moved to a JSON library: object keys in order, value types, and each
# list's element shapes. "a|b": either type; {"*": t}: an object whose keys are data (fallbacks,
# refusals by limit), each value a t.
SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tierctl_json_schema.json")


def shape(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    shapes = []
    for v in value:
        if shape(v) not in shapes:
            shapes.append(shape(v))
    return shapes


def mismatch(value, schema, where):
    """Why `value` does not have the shape `schema`, or None."""
    if isinstance(schema, str):
        return None if shape(value) in schema.split("|") else f"{where}: {shape(value)}, not {schema}"
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where}: {shape(value)}, not an object"
        if list(schema) == ["*"]:
            return next((m for k, v in value.items()
                         if (m := mismatch(v, schema["*"], f"{where}.{k}"))), None)
        if list(value) != list(schema):
            return f"{where}: keys {list(value)}, not {list(schema)}"
        return next((m for k in schema if (m := mismatch(value[k], schema[k], f"{where}.{k}"))),
                    None)
    if not isinstance(value, list):
        return f"{where}: {shape(value)}, not a list"
    for i, v in enumerate(value):
        whys = [mismatch(v, s, f"{where}[{i}]") for s in schema]
        if all(whys):
            return " / ".join(whys) if whys else f"{where}[{i}]: the list should be empty"
    return None


def json_outputs(lib, client, daemon, tmp_path):
    """Every --json output of tierctl, for a session with chunks on a daemon with every tier."""
    n, size = 2, 1 << 20
    sizes = (ctypes.c_uint64 * n)(*[size] * n)
    ids = (ctypes.c_uint64 * n)()
    assert lib.tierd_allocate(client, n, sizes, TIER_HOST, ids) == OK, lib.tierd_last_error()
    fill(lib, client, ids, n, size, 0x40)
    session = lib.tierd_session_id(client)
    create = BaseCreate(1, (ctypes.c_uint64 * 1)(size), (ctypes.c_int * 1)(TIER_HOST), b"d", 1,
                        0, 0)
    base, info = ctypes.c_void_p(), BaseInfo()
    assert lib.tierd_base_open(client, b"schema/base@1", ctypes.byref(create), ctypes.byref(base),
                               ctypes.byref(info)) == OK, lib.tierd_last_error()
    lib.tierd_base_free(base)
    assert lib.tierd_base_seal(client, b"schema/base@1", None, 0) == OK
    rc, doctor, err = tierctl(daemon, "--json", "doctor")
    assert rc in (0, 1), err  # 1: a check failed on this machine; the output is the same shape
    rc, unhealthy, _ = tierctl(str(tmp_path), "--json", "health")
    assert rc == 1
    outputs = {
        "status": tierctl_json(daemon, "status", "--sample=0.2s"),
        "health": tierctl_json(daemon, "health"),
        "unhealthy": json.loads(unhealthy),
        "chunks": tierctl_json(daemon, "chunks", f"--session={session}"),
        "bases": tierctl_json(daemon, "bases"),
        "drain": tierctl_json(daemon, "drain", "--tier=device"),
        "evict": tierctl_json(daemon, "evict", "--tier=host", str(ids[0])),
        "bench": tierctl_json(daemon, "bench", "--size=4MiB", "--chunk=2MiB"),
        "doctor": json.loads(doctor),
    }
    assert lib.tierd_free(client, n, ids) == OK
    assert lib.tierd_base_release(client, b"schema/base@1") == OK
    return outputs


def test_json_outputs_keep_their_shape(lib, client, daemon, tmp_path):
    with open(SCHEMA) as f:
        schema = json.load(f)
    outputs = json_outputs(lib, client, daemon, tmp_path)
    assert list(outputs) == list(schema)
    for command, value in outputs.items():
        why = mismatch(value, schema[command], command)
        assert why is None, why


def test_a_clients_name_cannot_break_status_for_the_operator(lib, daemon):
    """Not UTF-8 and a terminal escape in a client's name: status (JSON and text) still answers,
    with the name as printable ASCII."""
    handle = ctypes.c_void_p()
    assert lib.tierd_connect(daemon.encode(), b"bad\xff\xfe \x1b[31mname", ctypes.byref(handle)) == OK
    try:
        status = tierctl_json(daemon, "status", "--sample=0")
        session = lib.tierd_session_id(handle)
        mine = next(s for s in status["session_list"] if s["id"] == session)
        assert mine["client_name"] == "bad?? ?[31mname"
        rc, out, err = tierctl(daemon, "status", "--sample=0")
        assert rc == 0 and "bad?? ?[31mname" in out and "\x1b" not in out, err
    finally:
        lib.tierd_close(handle)
