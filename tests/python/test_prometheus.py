"""The dashboards and alert rules against a real Prometheus scraping a real daemon.

A client moves data through every tier while Prometheus (Debian's `prometheus`) scrapes the
daemon with the shipped configuration; then every PromQL expression of every dashboard panel,
template variable and alert rule is evaluated through Prometheus's HTTP API and must return data.
promtool checks the configuration and the rules and runs the rules' unit tests.

Run by CTest with TIERD_BIN, TIERD_CLIENT_LIB and TIERD_SOURCE_DIR set.
"""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

from test_c_abi import (ACCESS_OVERWRITE, ACCESS_READ, ACCESS_WRITE, DIES_WITH_TEST, NOT_FOUND, OK,
                        TIER_DEVICE, TIER_HOST, TIER_NVME, Completion, ids_array, load_library)

SOURCE = os.environ.get("TIERD_SOURCE_DIR",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
RULES_DIR = os.path.join(SOURCE, "deploy", "prometheus")
DASHBOARDS = [os.path.join(SOURCE, "dashboards", name)
              for name in ("tierd-overview.json", "tierd-detail.json")]
SCRAPE = "1s"
WAIT_NS = 10_000_000_000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*argv):
    r = subprocess.run(argv, capture_output=True, text=True, cwd=RULES_DIR)
    assert r.returncode == 0, f"{' '.join(argv)}:\n{r.stdout}{r.stderr}"
    return r.stdout


def wait_for(what, check, seconds=30):
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory(prefix="tierd-prom-") as d:
        log_path = os.path.join(d, "daemon.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*DIES_WITH_TEST, os.environ["TIERD_BIN"], f"--socket_dir={d}",
                 "--host_capacity=64MiB",
                 "--host_segment_size=16MiB", "--lock_memory=false", f"--state_dir={d}/state",
                 f"--nvme_regions={d}/nvme.region:128MiB", "--nvme_stripe_unit=1MiB",
                 "--device=emulated", "--device_capacity=32MiB", "--device_segment_size=16MiB",
                 "--probe_bytes=8MiB", "--metrics_listen=127.0.0.1:0"],
                stdout=log, stderr=log)

        def address():
            assert proc.poll() is None, open(log_path).read()
            m = re.search(r"serving metrics on http://([^/\s]+)/metrics", open(log_path).read())
            return m and m.group(1)

        target = wait_for("the daemon's metrics endpoint", address)
        wait_for("the daemon's socket", lambda: os.path.exists(os.path.join(d, "tierd.sock")))
        yield {"socket_dir": d, "target": target}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, open(log_path).read()


@pytest.fixture(scope="module")
def prometheus(daemon):
    """Prometheus with the shipped configuration and rules, pointed at the test daemon."""
    with tempfile.TemporaryDirectory(prefix="tierd-prometheus-") as d:
        config = open(os.path.join(RULES_DIR, "prometheus.yml")).read()
        assert "localhost:9477" in config
        config = config.replace("localhost:9477", daemon["target"])
        config = re.sub(r"(scrape_interval|evaluation_interval): \d+s", rf"\1: {SCRAPE}", config)
        shutil.copy(os.path.join(RULES_DIR, "tierd-rules.yml"), d)
        config_path = os.path.join(d, "prometheus.yml")
        with open(config_path, "w") as f:
            f.write(config)
        run("promtool", "check", "config", config_path)
        port = free_port()
        log_path = os.path.join(d, "prometheus.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*DIES_WITH_TEST, "prometheus", f"--config.file={config_path}",
                 f"--storage.tsdb.path={d}/data", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"

        def ready():
            assert proc.poll() is None, open(log_path).read()
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for("Prometheus to be ready", ready)
        yield url
        proc.terminate()
        proc.wait(timeout=30)


def api(url, path, **params):
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def move_data(lib, socket_dir, seconds):
    """A client that moves chunks on every path, misses and hits, and makes one error per round."""
    client = ctypes.c_void_p()
    assert lib.tierd_connect(socket_dir.encode(), b"prometheus-test", ctypes.byref(client)) == OK
    n, size = 4, 1 << 20
    sizes = (ctypes.c_uint64 * n)(*[size] * n)
    ids = (ctypes.c_uint64 * n)()
    assert lib.tierd_allocate(client, n, sizes, TIER_NVME, ids) == OK, lib.tierd_last_error()
    ptrs = (ctypes.c_void_p * n)()
    done = Completion()

    def wait(c):
        assert lib.tierd_wait(client, c, WAIT_NS) == OK, lib.tierd_last_error()

    def acquire(tier, access, fill=None):
        """Acquires the chunks, waits for them, writes `fill` into them if given, releases."""
        assert lib.tierd_acquire(client, n, ids, tier, access, ptrs, None,
                                 ctypes.byref(done)) == OK, lib.tierd_last_error()
        wait(done)
        for i in range(n if fill is not None else 0):
            ctypes.memset(ptrs[i], fill + i, size)
        assert lib.tierd_release(client, n, ids) == OK

    def move(request, tier):
        assert request(client, n, ids, tier, 0, ctypes.byref(done)) == OK
        wait(done)

    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline or rounds < 2:
        acquire(TIER_HOST, ACCESS_OVERWRITE, fill=rounds)
        move(lib.tierd_evict, TIER_NVME)  # host -> NVMe
        acquire(TIER_HOST, ACCESS_READ)  # a miss: on NVMe only, so it waits (and stalls)
        move(lib.tierd_prefetch, TIER_DEVICE)  # host -> device
        acquire(TIER_DEVICE, ACCESS_WRITE)  # a hit, and written there: the eviction copies it
        move(lib.tierd_evict, TIER_HOST)  # device -> host
        assert lib.tierd_free(client, 1, ids_array([1 << 60])) == NOT_FOUND
        rounds += 1
    assert lib.tierd_free(client, n, ids) == OK
    lib.tierd_close(client)
    return rounds


# Grafana's variables, as a dashboard resolves them with every node and path selected.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$instance": ".+",
                     "$path": ".+"}


def resolve(expr):
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unresolved variable in {expr}"
    return expr


def dashboard_expressions():
    """(where, PromQL) for every panel target and query variable of every dashboard."""
    out = []
    for path in DASHBOARDS:
        board = json.load(open(path))
        name = os.path.basename(path)
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{name}: panel '{panel['title']}' {target['refId']}",
                            resolve(target["expr"])))
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]["query"])
                assert m, f"{name}: variable {var['name']}: unexpected query {var['query']}"
                out.append((f"{name}: variable ${var['name']}", m.group(1)))
    return out


def split_threshold(expr):
    """An alert's measure: its expression before the last comparison at the top level."""
    depth, quote, cut = 0, None, None
    for i, ch in enumerate(expr):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "<>=!" and expr[i:i + 2] not in ("=~", "!~"):
            if cut is None or i > cut + 1:
                cut = i
    assert cut is not None and re.fullmatch(r"[=<>]*\s*[-+0-9.e]+\s*", expr[cut + 1:]), \
        f"alert expression is not 'measure OP threshold': {expr}"
    return expr[:cut].strip()


def alert_rules():
    import yaml
    with open(os.path.join(RULES_DIR, "tierd-rules.yml")) as f:
        groups = yaml.safe_load(f)["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_config_and_rules_and_their_unit_tests_pass():
    run("promtool", "check", "config", "prometheus.yml")
    run("promtool", "check", "rules", "tierd-rules.yml")
    run("promtool", "test", "rules", "tierd-rules.test.yml")


def test_dashboards_take_the_datasource_as_a_variable_and_have_unique_ids():
    for path in DASHBOARDS:
        board = json.load(open(path))
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel.get("description"), f"{path}: panel '{panel['title']}' says nothing"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_panel_and_alert_expression_returns_data_from_a_real_scrape(daemon, prometheus):
    # Prometheus finds its targets a few seconds after it starts: the work begins once it scrapes
    # the daemon, so that rates have samples from before, during and after it.
    wait_for("Prometheus to scrape the daemon twice", lambda: any(
        float(s["value"][1]) >= 2
        for s in api(prometheus, "query", query='count_over_time(up{job="tierd"}[1m])')["result"]))
    rounds = move_data(load_library(), daemon["socket_dir"], seconds=4)
    assert rounds >= 2
    # The last round's counters are in a scrape after the work, and Prometheus has evaluated the
    # rules since.
    since = time.time()

    def scraped_and_evaluated():
        targets = api(prometheus, "targets")["activeTargets"]
        rules = [r for g in api(prometheus, "rules")["groups"] for r in g["rules"]]
        scraped = targets and all(
            t["health"] == "up" and _rfc3339(t["lastScrape"]) > since + 1 for t in targets)
        evaluated = rules and all(_rfc3339(r["lastEvaluation"]) > since + 1 for r in rules)
        return scraped and evaluated and (targets, rules)

    targets, rules = wait_for("a scrape and a rule evaluation after the work",
                              scraped_and_evaluated)
    assert [t["labels"]["job"] for t in targets] == ["tierd"]
    assert len(rules) == len(alert_rules())
    for r in rules:
        assert r["health"] == "ok", f"Prometheus failed to evaluate {r['name']}: {r}"

    names = set(api(prometheus, "label/__name__/values"))
    failures = []
    expressions = dashboard_expressions()
    expressions += [(f"alert {r['alert']} (its measure)", split_threshold(r["expr"]))
                    for r in alert_rules()]
    for where, expr in expressions:
        for metric in set(re.findall(r"\btierd_[a-z0-9_]+", expr)):
            if metric not in names:
                failures.append(f"{where}: no metric named {metric}")
        try:
            result = api(prometheus, "query", query=expr)["result"]
        except urllib.error.HTTPError as e:
            failures.append(f"{where}: {expr}: {e.read().decode()}")
            continue
        if not result:
            failures.append(f"{where}: no data for {expr}")
    assert not failures, "\n".join(failures)

    # The figures behind the overview's bandwidth panels are the bytes the client moved.
    def total(expr):
        return sum(float(s["value"][1]) for s in api(prometheus, "query", query=expr)["result"])

    moved = rounds * 4 * (1 << 20)
    assert total('tierd_moved_bytes_total{path="host_to_device"}') >= moved
    assert total('tierd_moved_bytes_total{path="device_to_host"}') >= moved
    assert total("tierd_nvme_written_bytes_total") >= moved
    assert total('tierd_requests_total{op="Free",code="NOT_FOUND"}') == rounds
    assert total('tierd_acquires_total{result="waited"}') >= rounds * 4
    assert total('tierd_acquires_total{result="ready"}') >= rounds * 4
    # A healthy node raises no alert. (The test's 1 MiB moves are too small to reach the probe's
    # bandwidth, so that alert may be pending; it would need 15 minutes of it to fire.)
    raised = [(a["labels"]["alertname"], a["state"]) for a in api(prometheus, "alerts")["alerts"]]
    assert all(name == "TierdBandwidthFarUnderProbe" and state == "pending"
               for name, state in raised), raised


def _rfc3339(stamp):
    """Seconds since the epoch of Prometheus's RFC 3339 time stamps (nanosecond precision)."""
    from datetime import datetime
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    base = datetime.fromisoformat(m.group(1) + zone).timestamp()
    return base + float("0" + (m.group(2) or ""))
