"""Zero-copy DLPack views of acquired chunks (tierd_chunk_dlpack) against a real daemon: the
tensor sees the daemon's bytes, and holds what it views for as long as it lives."""
import gc
import os
import sys
import time

import numpy
import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd  # noqa: E402
import tierd.torch  # noqa: E402


@pytest.fixture
def client(daemon):  # noqa: F811
    with tierd.connect(daemon, "pytest-dlpack") as c:
        yield c


def test_a_tensor_writes_the_chunk_in_place_and_reads_it_back_from_nvme(client):
    with client.allocate([1 << 20], home=tierd.Tier.NVME) as chunks:
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE) as held:
            t = tierd.torch.as_tensor(held, 0, torch.float32, [256, 1024])
            t.copy_(torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
            # The same bytes through another view: no copy was made.
            assert bytes(held.memoryview(0)[:8]) == torch.tensor([0.0, 1.0]).numpy().tobytes()
            del t
        client.evict(chunks, tierd.Tier.NVME).wait(timeout=30)
        assert client.tier_usage(tierd.Tier.HOST).used_bytes == 0
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.READ) as held:
            back = tierd.torch.as_tensor(held, 0, torch.float32, [256, 1024], offset=0)
            assert torch.equal(back, torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
            tail = tierd.torch.as_tensor(held, 0, torch.bfloat16, [4], offset=4096)
            assert tail.dtype == torch.bfloat16 and tail.data_ptr() == back.data_ptr() + 4096
            del back, tail


def test_numpy_reads_the_same_bytes(client):
    with client.allocate([4096]) as chunks:
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE) as held:
            t = tierd.torch.as_tensor(held, 0, torch.int64, [512])
            t.copy_(torch.arange(512))
            a = numpy.from_dlpack(held.dlpack(0, "int64", [512]))  # numpy's views are read-only
            assert a.sum() == 511 * 512 // 2 and a.ctypes.data == t.data_ptr()
            del a, t


def test_releasing_or_freeing_under_a_live_tensor_fails_and_loses_nothing(client):
    chunks = client.allocate([8192])
    held = client.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE)
    t = tierd.torch.as_tensor(held, 0, torch.int32, [2048])
    t.fill_(7)
    row = t[100:200]  # a view of the tensor's storage holds the chunk too
    del t
    gc.collect()
    with pytest.raises(tierd.TierdError) as release:
        held.release()
    assert release.value.code_name == "FAILED_PRECONDITION"
    assert "live DLPack view" in release.value.message
    with pytest.raises(tierd.TierdError) as free:
        chunks.free()
    assert free.value.code_name == "FAILED_PRECONDITION"
    assert int(row.sum()) == 700  # still the daemon's bytes, still there
    del row
    held.release()
    chunks.free()


def test_a_tensor_outliving_its_with_blocks_holds_the_chunk_until_it_goes(client):
    """Python variables outlive `with` blocks: leaving them while a tensor views the chunk hands
    the release and the free to the tensor, and the chunk's memory is never anyone else's while
    the tensor lives."""
    before = client.tier_usage(tierd.Tier.HOST).used_bytes
    with client.allocate([1 << 20]) as chunks:
        client.evict(chunks, tierd.Tier.NVME).wait(timeout=30)
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE) as views:
            weights = tierd.torch.as_tensor(views, 0, torch.float32)
            weights.fill_(2.5)
    # Both blocks ended without an error; the chunk is still held, still these bytes.
    assert client.tier_usage(tierd.Tier.HOST).used_bytes >= before + (1 << 20)
    with client.allocate([1 << 20] * 4) as others:  # new chunks do not take its memory
        with client.acquire(others, tierd.Tier.HOST, tierd.Access.OVERWRITE) as held:
            for i in range(4):
                mine = tierd.torch.as_tensor(held, i, torch.float32)
                mine.fill_(-1.0)
                del mine
    assert float(weights.sum()) == 2.5 * (1 << 18)
    row = weights[10:20]
    del weights
    gc.collect()
    assert float(row.sum()) == 25.0  # a view of the storage holds it too
    del row
    gc.collect()
    # The last view gone: released and freed (released only, its host copy would remain).
    assert client.tier_usage(tierd.Tier.HOST).used_bytes == before


def test_a_tensor_keeps_the_session_after_close(daemon):  # noqa: F811
    with tierd.connect(daemon, "pytest-dlpack-observer") as observer:
        before = observer.tier_usage(tierd.Tier.HOST).used_bytes
        c = tierd.connect(daemon, "pytest-dlpack-closed")
        chunks = c.allocate([1 << 20])
        held = c.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE)
        t = tierd.torch.as_tensor(held, 0, torch.float32)
        t.fill_(3.0)
        c.close()
        # The closed client's chunk is still there and still this tensor's.
        assert observer.tier_usage(tierd.Tier.HOST).used_bytes >= before + (1 << 20)
        assert float(t.sum()) == 3.0 * (1 << 18)
        del t, held, chunks
        gc.collect()
        # The last view gone, the session ends and the daemon reclaims its chunk.
        deadline = time.monotonic() + 10
        while observer.tier_usage(tierd.Tier.HOST).used_bytes > before:
            assert time.monotonic() < deadline, "the closed session's chunk was not reclaimed"
            time.sleep(0.02)


def test_bad_views_are_refused_with_reasons(client):
    with client.allocate([8192, 4096]) as chunks:
        with client.acquire(chunks.ids[:1], tierd.Tier.HOST, tierd.Access.OVERWRITE) as held:
            cases = [
                (dict(dtype="float32", shape=[4096]), "OUT_OF_RANGE"),  # 16 KiB in 8 KiB
                (dict(dtype="float32", shape=[1], offset=8192), "OUT_OF_RANGE"),
                (dict(dtype="float32", shape=[1], offset=2), "INVALID_ARGUMENT"),
                (dict(dtype="float32", shape=[-1]), "INVALID_ARGUMENT"),
                (dict(dtype="int64", shape=[1 << 62, 1 << 62]), "INVALID_ARGUMENT"),
                (dict(dtype="complex64", shape=[1]), "INVALID_ARGUMENT"),
                (dict(dtype="uint8", shape=[1] * 17), "INVALID_ARGUMENT"),
            ]
            for kwargs, code in cases:
                with pytest.raises(tierd.TierdError) as e:
                    held.dlpack(0, **kwargs)
                assert e.value.code_name == code, kwargs
            # A chunk of the session that is not acquired has no view.
            other = tierd.Acquisition(client, chunks.ids[1:], [0], [4096], held.ready, host=True)
            with pytest.raises(tierd.TierdError) as e:
                other.dlpack(0)
            assert e.value.code_name == "FAILED_PRECONDITION"
            # A view is consumed once; one never consumed holds nothing once dropped.
            view = held.dlpack(0, "uint8", [16])
            torch.utils.dlpack.from_dlpack(view)
            with pytest.raises(BufferError):
                view.__dlpack__()
            unused = held.dlpack(0, "uint8", [16])
            del unused
            gc.collect()
        # Leaving `held` released it: no view was left alive.


def test_the_emulated_device_tier_is_viewed_as_cpu_memory(client):
    with client.allocate([65536]) as chunks:
        with client.acquire(chunks, tierd.Tier.DEVICE, tierd.Access.OVERWRITE) as held:
            view = held.dlpack(0, "float32", [16384])
            assert view.__dlpack_device__() == (1, 0)
            t = torch.utils.dlpack.from_dlpack(view)
            t.fill_(1.5)
            del t
        with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.READ) as held:
            assert float(tierd.torch.as_tensor(held, 0, torch.float32).sum()) == 1.5 * 16384
