"""Every error tierd raises is a tierd.TierdError with a gRPC status code (tierd/_errors.py): a
refusal of the daemon as TierdError itself ("CODE: message"), one of tierd's Python as a subclass
that is also the builtin a user catches, reading as its message alone, torch's words where tierd
stands in for torch. The package raises no bare builtin: a scan of its source says so, and is
itself checked on a planted one.
"""
import ast
import builtins
import os
import pickle
import shutil

import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (a fixture)
from test_pretrained import on_meta, stream

import tierd  # noqa: E402 (test_pretrained puts python/ on the path)
import tierd.torch  # noqa: E402
from tierd import Status, TierdError  # noqa: E402

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tierd")
BUILTIN_ERRORS = {n for n, v in vars(builtins).items()
                  if isinstance(v, type) and issubclass(v, BaseException)}


def nodes(package: str):
    """(file relative to the package, node) of every node of the package's source."""
    for root, _, files in os.walk(package):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, file)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                yield os.path.relpath(path, package), node


def builtin_raises(package: str):
    """(file, line, name) of each `raise X(...)` in the package whose X is a builtin exception
    or one of a module's (pickle.UnpicklingError) rather than tierd's."""
    found = []
    for file, node in nodes(package):
        if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
            continue
        func = node.exc.func
        if isinstance(func, ast.Name) and func.id in BUILTIN_ERRORS or \
                isinstance(func, ast.Attribute):
            found.append((file, node.lineno, ast.unparse(func)))
    return found


def test_the_package_raises_only_tierd_errors():
    assert builtin_raises(PACKAGE) == []


def test_the_scan_finds_a_planted_builtin(tmp_path):
    copy = tmp_path / "tierd"
    shutil.copytree(PACKAGE, copy)
    with open(copy / "torch" / "_units.py", "a") as f:
        f.write("\n\ndef _planted():\n    raise ValueError('x')\n\n\n"
                "def _planted_too():\n    raise pickle.UnpicklingError('y')\n")
    found = builtin_raises(str(copy))
    assert [(f, name) for f, _, name in found] == [
        (os.path.join("torch", "_units.py"), "ValueError"),
        (os.path.join("torch", "_units.py"), "pickle.UnpicklingError")]


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1.0), dict(eps=-1e-8), dict(betas=(1.0, 0.9)), dict(betas=(0.9, 1.5)),
    dict(betas=(0, 0.99)), dict(weight_decay=-0.1), dict(lr=-1.0, amsgrad=True)])
def test_a_refused_argument_reads_as_torch_s_own(kwargs):
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW(params, **kwargs)
    with pytest.raises(ValueError) as ours:
        tierd.torch.OffloadedAdamW(params, **kwargs)
    assert str(ours.value) == str(theirs.value)
    assert isinstance(ours.value, tierd.InvalidArgument)
    assert ours.value.code == Status.INVALID_ARGUMENT
    assert ours.value.code_name == "INVALID_ARGUMENT"
    assert ours.value.message == str(theirs.value)


def test_a_missing_checkpoint_is_not_found_and_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        tierd.torch.stream_parameters(on_meta("llama"), checkpoint=str(tmp_path / "absent"))
    assert isinstance(missing.value, tierd.NotFound) and missing.value.code == Status.NOT_FOUND
    assert str(missing.value).startswith(str(tmp_path / "absent"))


def test_a_call_at_the_wrong_time_is_a_failed_precondition(daemon, tmp_path):  # noqa: F811
    model = on_meta("llama")
    s = stream(model, daemon, init=lambda m: None)
    s.close(keep_weights=False)
    with pytest.raises(RuntimeError) as closed:
        s.save_pretrained(str(tmp_path / "out"))
    assert isinstance(closed.value, tierd.FailedPrecondition)
    assert closed.value.code_name == "FAILED_PRECONDITION"
    assert str(closed.value) == "stream_parameters: the stream was closed"


def test_a_daemon_refusal_is_a_tierd_error_with_its_code(daemon):  # noqa: F811
    with tierd.connect(daemon) as client:
        with pytest.raises(TierdError) as refused:
            client.allocate([1 << 40], tierd.Tier.HOST)
    assert type(refused.value) is TierdError
    assert refused.value.code in (Status.RESOURCE_EXHAUSTED, Status.INVALID_ARGUMENT)
    assert str(refused.value) == f"{refused.value.code_name}: {refused.value.message}"
    assert refused.value.message


@pytest.mark.parametrize("error", [
    TierdError(Status.RESOURCE_EXHAUSTED, "the host tier is full"),
    tierd.InvalidArgument("Invalid learning rate: -1"), tierd.InvalidType("a list, not a module"),
    tierd.NotFound("no checkpoint"), tierd.PermissionDenied("made by mallory"),
    tierd.FailedPrecondition("during a step"), tierd.MissingDependency("pip install x"),
    tierd.ViewConsumed("taken"), tierd.UnsafePickle("names posix.system")])
def test_an_error_pickles_whole(error):
    if hasattr(error, "add_note"):  # Python 3.11
        error.add_note("rank 1 on node-b")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert (back.code, back.code_name, back.message, str(back)) == (
        error.code, error.code_name, error.message, str(error))
    assert getattr(back, "__notes__", None) == getattr(error, "__notes__", None)


def test_each_refusal_is_also_its_builtin():
    builtins = {tierd.InvalidArgument: ValueError, tierd.InvalidType: TypeError,
                tierd.NotFound: FileNotFoundError, tierd.PermissionDenied: PermissionError,
                tierd.FailedPrecondition: RuntimeError, tierd.MissingDependency: ImportError,
                tierd.ViewConsumed: BufferError, tierd.UnsafePickle: pickle.UnpicklingError}
    for cls, builtin in builtins.items():
        error = cls("words")
        assert isinstance(error, TierdError) and isinstance(error, builtin), cls
        assert str(error) == "words" and error.code != Status.OK
