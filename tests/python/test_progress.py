"""Progress bars (tierd/torch/_progress.py) while a checkpoint streams in, a stream saves its
weights and a job fills a shared base: shown at once when asked for, never when refused, and by
default only on a terminal, for work that lasts more than a moment, unless TIERD_PROGRESS=0. A bar
counts bytes, with their rate, up to the weights' size.
"""
import io
import re
import sys

import pytest

from test_c_abi import daemon  # noqa: F401 (a fixture)
from test_pretrained import on_meta, saved, stream

from tierd.torch import _progress  # noqa: E402 (test_pretrained puts python/ on the path)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _streamed_bytes(model):
    return sum(p.numel() * p.element_size() for b in model.model.layers for p in b.parameters())


def _final(text: str, what: str) -> str:
    """The bar's last state: tqdm redraws it in place (carriage returns)."""
    lines = [line for line in re.split(r"[\r\n]", text) if line.startswith(what)]
    assert lines, text
    return lines[-1]


def test_a_bar_asked_for_counts_the_weights_loaded_and_saved(daemon, tmp_path,  # noqa: F811
                                                              capsys):
    ckpt = saved(tmp_path, "llama")
    model = on_meta("llama")
    s = stream(model, daemon, checkpoint=str(ckpt), host_budget_bytes=0, progress=True)
    try:
        loaded = _final(capsys.readouterr().err, "Loading weights")
        s.save_pretrained(str(tmp_path / "out"), max_shard_size="20KB")
        saved_bar = _final(capsys.readouterr().err, "Saving weights")
    finally:
        s.close(keep_weights=False)
    size = _streamed_bytes(model) / 1024
    # "Loading weights: 100%|...| 338k/338k [00:00<00:00, 12.3MB/s]", in KiB (unit_divisor 1024)
    assert "100%" in loaded and "B/s" in loaded
    assert re.search(rf"{size:.0f}k/{size:.0f}k", loaded), (loaded, size)
    assert "100%" in saved_bar and "B/s" in saved_bar


@pytest.mark.parametrize("progress,terminal", [(False, True), (None, False)])
def test_no_bar_when_refused_or_off_a_terminal(daemon, tmp_path, capsys, monkeypatch,  # noqa: F811
                                               progress, terminal):
    ckpt = saved(tmp_path, "llama")
    monkeypatch.setattr(_progress, "DELAY_S", 0.0)  # the work here takes less than a moment
    monkeypatch.delenv("TIERD_PROGRESS", raising=False)
    out = _Terminal() if terminal else None
    if out is not None:
        monkeypatch.setattr(sys, "stderr", out)
    s = stream(on_meta("llama"), daemon, checkpoint=str(ckpt), progress=progress)
    s.save_pretrained(str(tmp_path / "out"))
    s.close(keep_weights=False)
    shown = out.getvalue() if out is not None else capsys.readouterr().err
    assert "weights" not in shown, shown


@pytest.mark.parametrize("env,shown", [(None, True), ("0", False)])
def test_by_default_a_bar_on_a_terminal_unless_turned_off(daemon, tmp_path,  # noqa: F811
                                                          monkeypatch, env, shown):
    ckpt = saved(tmp_path, "llama")
    monkeypatch.setattr(_progress, "DELAY_S", 0.0)
    if env is None:
        monkeypatch.delenv("TIERD_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("TIERD_PROGRESS", env)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    s = stream(on_meta("llama"), daemon, checkpoint=str(ckpt))
    s.close(keep_weights=False)
    assert ("Loading weights" in terminal.getvalue()) == shown


def test_a_job_filling_a_shared_base_shows_its_bar(daemon, tmp_path, capsys):  # noqa: F811
    ckpt = saved(tmp_path, "llama")
    s = stream(on_meta("llama"), daemon, checkpoint=str(ckpt), shared_base="progress-base",
               progress=True)
    try:
        assert "100%" in _final(capsys.readouterr().err, "Filling shared base progress-base")
    finally:
        s.close(keep_weights=False)


def test_a_bar_is_closed_when_the_work_fails(capsys):
    with pytest.raises(RuntimeError):
        with _progress.bar("Loading weights", 100, True) as done:
            done(40)
            raise RuntimeError("failed half way")
    last = _final(capsys.readouterr().err, "Loading weights")
    assert "40%" in last and "40.0/100" in last
