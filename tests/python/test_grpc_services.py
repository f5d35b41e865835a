"""The standard gRPC services against a real daemon, through a client that is not tierd's: Python
grpcio with stubs generated from the health checking and reflection protocols' own definitions
(proto/grpc_health/, which the daemon serves, and standard_protos/), as grpc_health_probe,
Kubernetes-style probes and grpcurl speak them.

Run by CTest with TIERD_BIN set.
"""
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2

from test_c_abi import daemon, start_daemon  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = [os.path.join(HERE, "..", "..", "proto"), os.path.join(HERE, "standard_protos")]


@pytest.fixture(scope="module")
def stubs():
    """The protocols' messages and stubs, generated now by protoc and gRPC's Python plugin."""
    with tempfile.TemporaryDirectory(prefix="tierd-stubs-") as out:
        protos = ["grpc_health/v1/health.proto", "grpc_reflection/v1alpha/reflection.proto"]
        subprocess.run(["protoc", *(f"-I{p}" for p in PROTOS), f"--python_out={out}",
                        f"--grpc_python_out={out}",
                        "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin", *protos],
                       check=True)
        sys.path.insert(0, out)
        try:
            yield {name: importlib.import_module(name) for name in (
                "grpc_health.v1.health_pb2", "grpc_health.v1.health_pb2_grpc",
                "grpc_reflection.v1alpha.reflection_pb2",
                "grpc_reflection.v1alpha.reflection_pb2_grpc")}
        finally:
            sys.path.remove(out)


def channel(socket_dir):
    return grpc.insecure_channel(f"unix:{socket_dir}/tierd.sock")


def health(stubs, socket_dir):
    return stubs["grpc_health.v1.health_pb2_grpc"].HealthStub(channel(socket_dir))


def test_health_says_serving_for_the_daemon_and_for_its_api(daemon, stubs):  # noqa: F811
    pb = stubs["grpc_health.v1.health_pb2"]
    probe = health(stubs, daemon)
    for service in ("", "tierd.v1.Tierd"):
        reply = probe.Check(pb.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == pb.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as unknown:
        probe.Check(pb.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_turns_not_serving_when_the_daemon_stops(stubs, tmp_path):
    pb = stubs["grpc_health.v1.health_pb2"]
    root = str(tmp_path)
    proc = start_daemon(root)
    watch = health(stubs, root).Watch(pb.HealthCheckRequest(service=""), timeout=30)
    assert next(watch).status == pb.HealthCheckResponse.SERVING
    proc.send_signal(signal.SIGTERM)
    seen = []
    try:
        for reply in watch:  # until the daemon ends the call, or the call dies with the server
            seen.append(reply.status)
    except grpc.RpcError:
        pass
    assert seen and seen[-1] == pb.HealthCheckResponse.NOT_SERVING, seen
    assert proc.wait(timeout=30) == 0, open(os.path.join(root, "daemon.log")).read()


def test_reflection_lists_the_services_and_describes_the_api(daemon, stubs):  # noqa: F811
    pb = stubs["grpc_reflection.v1alpha.reflection_pb2"]
    reflection = stubs["grpc_reflection.v1alpha.reflection_pb2_grpc"].ServerReflectionStub(
        channel(daemon))
    requests = [pb.ServerReflectionRequest(list_services=""),
                pb.ServerReflectionRequest(file_containing_symbol="tierd.v1.Tierd")]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests), timeout=10))

    names = {s.name for s in listed.list_services_response.service}
    assert {"tierd.v1.Tierd", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names, names

    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    api = next(f for f in files if f.package == "tierd.v1")
    service = next(s for s in api.service if s.name == "Tierd")
    methods = {m.name: m for m in service.method}
    assert {"GetNodeInfo", "Allocate", "Acquire", "Drain"} <= set(methods), sorted(methods)
    assert methods["GetNodeInfo"].input_type == ".tierd.v1.GetNodeInfoRequest"


def test_health_watchers_are_bounded_and_probes_still_answered(daemon, stubs):  # noqa: F811
    """A Watch holds a server thread: past the bound, a watcher is refused, not served."""
    pb = stubs["grpc_health.v1.health_pb2"]
    probe = health(stubs, daemon)
    watches = [probe.Watch(pb.HealthCheckRequest(service=""), timeout=30) for _ in range(8)]
    try:
        for w in watches:
            assert next(w).status == pb.HealthCheckResponse.SERVING
        extra = probe.Watch(pb.HealthCheckRequest(service=""), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            next(extra)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = probe.Check(pb.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == pb.HealthCheckResponse.SERVING
    finally:
        for w in watches:
            w.cancel()
    # The cancelled watchers' threads come back: a new one is served.
    deadline = time.monotonic() + 10
    while True:
        again = probe.Watch(pb.HealthCheckRequest(service=""), timeout=30)
        try:
            assert next(again).status == pb.HealthCheckResponse.SERVING
            again.cancel()
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.1)


def test_an_unknown_service_is_watched_as_unknown(daemon, stubs):  # noqa: F811
    pb = stubs["grpc_health.v1.health_pb2"]
    watch = health(stubs, daemon).Watch(pb.HealthCheckRequest(service="no.such.Service"),
                                        timeout=10)
    assert next(watch).status == pb.HealthCheckResponse.SERVICE_UNKNOWN
    watch.cancel()
