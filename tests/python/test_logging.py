"""The library prints nothing: what it does goes to the `tierd` logger (quiet unless the
application configures logging), and what the user should change comes as a warning. A stream's
set-up, an import's bytes, time and rate, a save, and the optimizer made, saved and loaded are
each a line there. A scan of the package finds no print() outside the command line
(python -m tierd) and no logger outside `tierd`.
"""
import ast
import logging
import os
import re

from test_c_abi import daemon  # noqa: F401 (a fixture)
from test_errors import PACKAGE, nodes
from test_pretrained import HYPER, on_meta, saved, stream

import tierd  # noqa: E402 (test_pretrained puts python/ on the path)
import tierd.torch  # noqa: E402

def _calls(package: str):
    """(file, the called name, its arguments' source) of every call in the package."""
    return [(file, ast.unparse(node.func), [ast.unparse(a) for a in node.args])
            for file, node in nodes(package) if isinstance(node, ast.Call)]


def test_only_the_command_line_prints_and_every_logger_is_tierd_s():
    calls = list(_calls(PACKAGE))
    assert {f for f, name, _ in calls if name == "print"} == {"__main__.py"}
    loggers = [(f, args) for f, name, args in calls if name == "logging.getLogger"]
    assert loggers and all(args == ["__name__"] for _, args in loggers), loggers


def test_the_package_is_quiet_unless_logging_is_configured():
    handlers = logging.getLogger("tierd").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def _streamed_bytes(model):
    return sum(p.numel() * p.element_size() for b in model.model.layers for p in b.parameters())


def test_a_streamed_run_logs_its_set_up_import_and_optimizer(daemon, tmp_path, caplog,  # noqa
                                                              capsys):
    ckpt = saved(tmp_path, "llama")
    model = on_meta("llama")
    capsys.readouterr()
    caplog.set_level(logging.INFO, logger="tierd")
    s = stream(model, daemon, checkpoint=str(ckpt), host_budget_bytes=0)
    try:
        opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
        opt.save_checkpoint(str(tmp_path / "state"))
        opt.close()
    finally:
        s.close(keep_weights=False)
    lines = {r.name: r.getMessage() for r in caplog.records}
    loaded = lines["tierd.torch._progress"]
    size = _streamed_bytes(model) / 1024
    assert re.fullmatch(rf"Loading weights: {size:.2f} KiB in [0-9.]+ s \([0-9.]+ [KMG]iB/s\)",
                        loaded), (loaded, size)
    units = len(model.model.layers)
    assert re.match(rf"stream 'LlamaForCausalLM': {units} units \(the largest [0-9.]+ KiB\) "
                    rf"through a window of 3 on cpu, [0-9.]+ KiB resident; 0 units at home in "
                    rf"the host tier, {units} on NVMe$", lines["tierd.torch.streaming"])
    made = [r.getMessage() for r in caplog.records if r.name == "tierd.torch.optimizer"]
    assert made[0].startswith("OffloadedAdamW(") and "buckets" in made[0]
    assert re.fullmatch(rf"OffloadedAdamW: state saved to {tmp_path / 'state'} in [0-9.]+ s",
                        made[1])
    assert all(r.levelno == logging.INFO for r in caplog.records)
    printed = capsys.readouterr()
    assert printed.out == "" and "Loading weights" not in printed.err  # off a terminal: no bar


def test_a_session_is_logged_at_debug_only(daemon, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="tierd")
    tierd.connect(daemon, "quiet").close()
    assert caplog.records == []
    caplog.set_level(logging.DEBUG, logger="tierd")
    with tierd.connect(daemon, "told") as client:
        assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
            ("tierd.client", logging.DEBUG,
             f"session {client.session_id} (told) with the daemon at {os.path.realpath(daemon)}")]
