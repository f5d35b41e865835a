"""The wheel a user installs: `deploy/make-wheel.sh` (what `make wheel` runs) builds it from the
build tree, pip installs it into a fresh virtual environment, and there — no PYTHONPATH, no
TIERD_CLIENT_LIB, no build tree on any path — `python -m tierd status` reaches a real daemon and a
streamed model trains two steps as torch's AdamW trains it in memory, with the client library and
the libraries it loads taken from the installed package."""
import os
import re
import site
import subprocess
import sys
import textwrap

import pytest

from test_c_abi import daemon  # noqa: F401 (a fixture)

pytest.importorskip("torch")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BUILD = os.path.dirname(os.path.dirname(os.environ.get(
    "TIERD_CLIENT_LIB", os.path.join(ROOT, "build", "client", "libtierd_client.so.0"))))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtual environment with the wheel installed; torch and the rest of the test's own
    environment are seen through a .pth file (tierd is not among them)."""
    work = tmp_path_factory.mktemp("wheel")
    made = subprocess.run([os.path.join(ROOT, "deploy", "make-wheel.sh"), BUILD, work / "dist",
                           sys.executable], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    (wheel,) = (work / "dist").glob("tierd-*.whl")
    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", env], check=True)
    python = str(env / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    str(wheel)], check=True)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    theirs = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(purelib.stdout.strip(), "the_tests_own.pth"), "w") as f:
        f.write("\n".join(theirs) + "\n")
    return wheel, python, env


def run(python, code_or_args, cwd):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "TIERD_CLIENT_LIB", "LD_LIBRARY_PATH")}
    args = ["-c", textwrap.dedent(code_or_args)] if isinstance(code_or_args, str) \
        else code_or_args
    return subprocess.run([python, *args], capture_output=True, text=True, cwd=cwd, env=clean,
                          timeout=300)


def test_the_wheel_is_named_for_the_release_and_the_glibc_it_needs(installed):
    wheel, _, _ = installed
    with open(os.path.join(BUILD, "CPackConfig.cmake")) as f:
        deb = re.search(r'set\(CPACK_PACKAGE_VERSION "([^"]+)"\)', f.read()).group(1)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from tierd._version import __version__
    assert __version__ == deb
    assert re.fullmatch(rf"tierd-{re.escape(deb)}-py3-none-manylinux_2_\d+_x86_64\.whl",
                        wheel.name), wheel.name


def test_status_reaches_the_daemon_from_the_installed_package(installed, daemon,  # noqa: F811
                                                              tmp_path):
    _, python, _ = installed
    got = run(python, ["-m", "tierd", "status", "--socket-dir", daemon], tmp_path)
    assert got.returncode == 0, got.stderr
    assert re.search(r"^session \d+$", got.stdout, re.M), got.stdout
    assert re.search(r"^host +[\d.]+ \w+ of", got.stdout, re.M), got.stdout


def test_streamed_steps_train_as_in_memory_from_the_installed_package(
        installed, daemon, tmp_path):  # noqa: F811
    _, python, env = installed
    got = run(python, f"""
        import copy, os
        import torch, torch.nn as nn
        import tierd, tierd.torch
        here = os.path.realpath({str(env)!r})
        assert os.path.realpath(tierd.__file__).startswith(here), tierd.__file__
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        twin = copy.deepcopy(model)
        x, y = torch.randn(8, 64), torch.randn(8, 64)
        stream = tierd.torch.stream_parameters(model, units=list(model), device="cpu",
                                               device_budget_bytes=1 << 20,
                                               socket_dir={daemon!r})
        opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=1e-2, socket_dir={daemon!r})
        ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        for o, m in ((opt, model), (ref, twin)):
            for _ in range(2):
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        with torch.no_grad():  # one AdamW in another order: within fp32 rounding
            torch.testing.assert_close(model(x), twin(x), rtol=1e-4, atol=1e-5)
        with open("/proc/self/maps") as f:
            libs = {{line.split()[-1] for line in f if ".so" in line}}
        ours = [p for p in libs if "libtierd_client" in p or "libgrpc" in p or "libprotobuf" in p]
        opt.close()
        stream.close()
        assert ours and all(os.path.realpath(p).startswith(here) for p in ours), ours
    """, tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
