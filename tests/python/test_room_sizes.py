"""Rooms that stay small: a room past its size is a signal that it holds two concerns.

Reports any Python module of the package over MODULE_LINES lines, any Python class over
CLASS_LINES, and any C++ source file over CXX_LINES (tests, fuzz targets and test helpers
aside), naming it and saying "split by concern". A room that is larger is listed in LARGER with
its size as a ceiling and the reason: either one concern that is honestly that large, or the two
concerns it holds and is to be split into. A listed room that grows past its ceiling fails, and
so does one that has shrunk under the limit (its entry goes). The check itself is checked.
"""
import ast
import os
import subprocess

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

MODULE_LINES = 450
CLASS_LINES = 350
CXX_LINES = 600

# room -> (ceiling in lines, why it is larger). A room is a path from the root, or
# "path:Class" for a Python class.
LARGER = {
    "daemon/chunks/chunk_service.cc": (966, "the coordinator, one lock and one file in sections; "
                                            "next out: the operators' requests over every "
                                            "session's chunks"),
    "tools/doctor.cc": (735, "one concern: the doctor's checks, each a function of its own, "
                             "side by side in the order they run"),
}


def sizes(root: str):
    """{room: lines} for every room of the house past its limit."""
    found = {}
    for path in _tracked(root, ("*.py",)):
        if not path.startswith("python/tierd/"):
            continue
        with open(os.path.join(root, path)) as f:
            text = f.read()
        lines = text.count("\n")
        if lines > MODULE_LINES:
            found[path] = lines
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > CLASS_LINES:
                    found[f"{path}:{node.name}"] = n
    for path in _tracked(root, ("*.cc", "*.h", "*.hpp", "*.cu")):
        if path.split("/")[0] in ("tests", "fuzz", "testing") or "_test." in path:
            continue
        with open(os.path.join(root, path)) as f:
            lines = f.read().count("\n")
        if lines > CXX_LINES:
            found[path] = lines
    return found


def _tracked(root: str, patterns):
    """The files of the house: git's, where the root is a clone; else every file under it."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", *patterns], check=True,
                             capture_output=True, text=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
        for f in files:
            if any(f.endswith(p[1:]) for p in patterns):
                found.append(os.path.relpath(os.path.join(top, f), root))
    return found


def problems(found, larger):
    """What the report says: rooms to split by concern, listed rooms past their ceiling, and
    entries that no longer need to be there."""
    out = []
    for room, lines in sorted(found.items()):
        limit = CLASS_LINES if ":" in room else \
            MODULE_LINES if room.endswith(".py") else CXX_LINES
        if room not in larger:
            out.append(f"{room}: {lines} lines, over {limit}: split by concern (or list it in "
                       "LARGER with the reason)")
        elif lines > larger[room][0]:
            out.append(f"{room}: {lines} lines, past its ceiling of {larger[room][0]}: split "
                       "by concern")
    for room in sorted(set(larger) - set(found)):
        out.append(f"{room}: within its limit now: take it out of LARGER")
    return out


def test_every_room_is_within_its_size_or_listed_with_the_reason():
    assert problems(sizes(ROOT), LARGER) == []


def test_a_room_that_grows_or_a_new_large_room_is_reported():
    found = sizes(ROOT)
    room, (ceiling, _) = next(iter(LARGER.items()))
    grown = dict(found, **{room: ceiling + 1})
    assert problems(grown, LARGER) == [
        f"{room}: {ceiling + 1} lines, past its ceiling of {ceiling}: split by concern"]
    new = dict(found, **{"python/tierd/torch/_window.py": 451})
    assert problems(new, LARGER) == [
        "python/tierd/torch/_window.py: 451 lines, over 450: split by concern (or list it in "
        "LARGER with the reason)"]
    shrunk = {k: v for k, v in found.items() if k != "tools/doctor.cc"}
    assert problems(shrunk, LARGER) == ["tools/doctor.cc: within its limit now: take it out of "
                                        "LARGER"]


def test_classes_are_measured(tmp_path):
    package = tmp_path / "python" / "tierd"
    package.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    (package / "big.py").write_text(f"class Big:\n{body}\n")
    assert sizes(str(tmp_path)) == {"python/tierd/big.py:Big": CLASS_LINES + 1}
