"""The stores the batch tests run on (service/batch/storage.py)."""

from __future__ import annotations

import contextlib
import uuid

import fsspec
import pytest

from service.batch import storage


@pytest.fixture(params=["directory", "object store"])
def root(request, tmp_path, monkeypatch):
    """Every test on both stores: a directory, and an object store (fsspec's in-memory one, which
    has no append and no file lock: the journal's objects and the lease are what run)."""
    if request.param == "directory":
        yield tmp_path
        return
    with memory_store(monkeypatch) as url:
        yield url


@contextlib.contextmanager
def memory_store(monkeypatch):
    """A fresh `memory://` URL (removed after), its leases read back at once (one process: no
    writer to wait for) and lasting 30 s."""
    monkeypatch.setattr(storage, "LEASE_SETTLE_S", 0.0)
    monkeypatch.setattr(storage, "LEASE_S", 30.0)
    name = f"qkv-batch-{uuid.uuid4().hex}"
    try:
        yield f"memory://{name}"
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)
