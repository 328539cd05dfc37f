"""Prefixes shared across replicas (model/engine/kv/share.py): engines pointed at one directory
load the blocks another computed instead of recomputing them, and outputs never change:
greedy and seeded tokens equal those with prefix caching off, one by one and batched under
preemption. A block file that does not check out (corrupt, truncated, another block's) is removed
and recomputed; a write that fails drops the block; engines of another model never see the
blocks; the directory stays near its size. The prefix router sees the same files (its holder's
allowance shrinks when every replica can load the prefix)."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.kv.block_manager import BlockManager
from model.engine.kv.share import SharedTier
from model.engine.kv.share_layout import HEADER, leading_files
from model.engine.sequence import Sequence
from tests.model.engine.test_kv_offload import MODEL, run_one_by_one, workload

SIZE = 64 << 20
POOL = 12  # blocks: one 85-token prompt and its 16 new tokens at a time (7 blocks)


def engine(directory, size: int = SIZE, model: str = MODEL, **fields) -> LLM:
    return LLM(model, engine_config=EngineConfig(num_kv_blocks=POOL, kv_share_dir=str(directory),
                                                 kv_share_bytes=size, **fields))


def block_files(llm: LLM) -> list[str]:
    d = llm.engine.kv_share.directory
    return sorted(os.path.join(d, n) for n in os.listdir(d) if not n.startswith("."))


@pytest.fixture(scope="module")
def reference() -> list:
    prompts, params = workload()
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, enable_prefix_caching=False))
    return [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]


def warm(directory) -> LLM:
    """An engine that ran the first ask of each system prompt, its blocks written to `directory`."""
    a = engine(directory)
    prompts, params = workload()
    for p, sp in zip(prompts[:4], params[:4]):
        a.generate([p], [sp])
    a.engine.kv_share.flush()
    return a


def test_a_second_engine_loads_the_prefixes_the_first_computed_with_the_same_tokens(reference, tmp_path) -> None:
    a = warm(tmp_path)
    # the 5 full blocks of each prompt when computed, and blocks of generated tokens when evicted
    assert a.engine.stats().kv_share_saved_blocks >= 4 * 5
    b = engine(tmp_path)
    prompts, params = workload()
    got = [b.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    assert got == reference
    stats = b.engine.stats()
    # every ask of the eight finds its 5 system blocks: from the directory (or, the second ask, the pool)
    assert stats.kv_share_loaded_blocks >= 4 * 5 and stats.kv_share_errors == 0
    assert stats.prefix_cache_hits >= 8 * 80
    assert stats.kv_share_bytes_read == stats.kv_share_loaded_blocks * b.engine.kv_share.block_nbytes
    b.engine.kv_share.flush()
    saved = a.engine.stats().kv_share_saved_blocks + b.engine.stats().kv_share_saved_blocks
    assert len(block_files(a)) == saved  # each block written once, whichever engine computed it


def test_batched_and_preempted_from_the_shared_directory_gives_the_same_tokens(reference, tmp_path) -> None:
    warm(tmp_path)
    prompts, params = workload()
    b = engine(tmp_path)
    assert [o.token_ids for o in b.generate(prompts, params)] == reference
    stats = b.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.kv_share_loaded_blocks > 0
    assert stats.num_free_blocks == POOL


def test_a_shared_tier_beside_the_private_one_gives_the_same_tokens(reference, tmp_path) -> None:
    llm = engine(tmp_path, kv_offload_bytes=SIZE)
    assert run_one_by_one(llm) == reference
    stats = llm.engine.stats()
    assert stats.kv_offload_loaded_blocks + stats.kv_share_loaded_blocks >= 4 * 5


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another block"])
def test_a_block_file_that_does_not_check_out_is_removed_and_recomputed(reference, tmp_path, damage) -> None:
    a = warm(tmp_path)
    files = block_files(a)
    for i, path in enumerate(files):
        raw = open(path, "rb").read()
        if damage == "garbage":  # the header intact, every payload byte changed
            raw = raw[:HEADER.size] + bytes((x + 1) % 256 for x in raw[HEADER.size:HEADER.size + 64]) \
                + raw[HEADER.size + 64:]
        elif damage == "truncated":
            raw = raw[:len(raw) // 2]
        else:  # a whole, valid file of another block under this name
            raw = open(files[(i + 1) % len(files)], "rb").read()
        open(path, "wb").write(raw)
    b = engine(tmp_path)
    prompts, params = workload()
    got = [b.generate([p], [sp])[0].token_ids for p, sp in zip(prompts[4:], params[4:])]
    assert got == reference[4:]
    stats = b.engine.stats()
    assert stats.kv_share_errors == 4  # the first block of each prefix: the lookup stops there
    assert stats.kv_share_loaded_blocks == 0
    b.engine.kv_share.flush()  # recomputed blocks are written again, whole
    assert all(open(p, "rb").read() != b"" for p in block_files(b))
    assert stats.kv_share_errors == b.engine.stats().kv_share_errors


def test_a_failed_write_drops_the_block_and_leaves_no_file(reference, tmp_path, monkeypatch) -> None:
    """ENOSPC from os.write's stand-in (a disk cannot be filled safely here): no block file, no
    temporary file left, the tokens recomputed."""
    real = os.write

    def full(fd, data):  # a block's payload into a file under tmp_path fails; any other write goes through
        if len(data) > 1000 and os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    llm = engine(tmp_path)
    monkeypatch.setattr(os, "write", full)
    assert run_one_by_one(llm) == reference
    llm.engine.kv_share.flush()
    stats = llm.engine.stats()
    assert stats.kv_share_errors > 0 and stats.kv_share_saved_blocks == 0 and stats.kv_share_bytes_written == 0
    assert os.listdir(llm.engine.kv_share.directory) == []


def test_engines_of_another_model_never_see_the_blocks(tmp_path) -> None:
    a = warm(tmp_path)
    other = engine(tmp_path, kv_cache_dtype="bfloat16")  # same weights, blocks of another layout
    assert other.engine.kv_share.directory != a.engine.kv_share.directory
    prompts, params = workload()
    for p, sp in zip(prompts[:4], params[:4]):  # each prompt's blocks are in the first engine's namespace
        other.generate([p], [sp])
    assert other.engine.stats().kv_share_loaded_blocks == 0 and other.engine.stats().prefix_cache_hits == 0


def test_the_directory_stays_near_its_size(tmp_path) -> None:
    probe = engine(tmp_path / "probe")
    per_file = probe.engine.kv_share.file_nbytes
    llm = engine(tmp_path / "small", size=6 * per_file)
    run_one_by_one(llm)
    llm.engine.kv_share.flush()
    files = block_files(llm)
    assert 0 < len(files) <= 6 and llm.engine.stats().kv_share_saved_blocks > 6
    with pytest.raises(ValueError, match="smaller than one KV block"):
        engine(tmp_path / "tiny", size=1000)


@pytest.mark.parametrize("fields, message", [
    ({"kv_share_dir": "/tmp/x"}, "kv_share_dir and kv_share_bytes go together"),
    ({"kv_share_bytes": 1 << 20}, "kv_share_dir and kv_share_bytes go together"),
    ({"kv_share_bytes": -1}, "kv_share_bytes must be an integer >= 0, got -1"),
    ({"kv_share_dir": "/tmp/x", "kv_share_bytes": 1 << 20, "enable_prefix_caching": False},
     "kv_share_dir needs enable_prefix_caching"),
    ({"kv_share_dir": "/tmp/x", "kv_share_bytes": 1 << 20, "tensor_parallel_size": 2},
     "kv_share_dir is not supported with tensor_parallel"),
])
def test_bad_settings_are_refused_with_what_is_allowed(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


# ---- the router sees the directory ----------------------------------------------------------------

def test_the_router_finds_the_engines_blocks_and_lets_the_busy_holder_go(tmp_path) -> None:
    from service.routing.router import _route
    from tests.service.routing.test_prefix_router import DEPLOYMENT, FakeReplica, ReplicaID, ids, pick, router

    a = warm(tmp_path)
    prompts, _ = workload()
    share = {"dir": a.engine.kv_share.directory, "salt": a.engine.prefix_salt.hex()}
    bm = BlockManager(POOL, 16, enable_prefix_caching=True, salt=a.engine.prefix_salt)
    assert leading_files(share["dir"], bm.hashes(Sequence("x", prompts[0], SamplingParams()))) == 5  # the engine's hashes

    async def scenario() -> None:
        r = router(block_size=16, imbalance_threshold=8, tier_imbalance_threshold=1)
        holder, other = (FakeReplica(ReplicaID(n, DEPLOYMENT), replica_metadata={"kv_share": share})
                         for n in ("holder", "other"))
        fresh = [7] * 85  # a prompt no engine computed

        def held(prompt: list[int]) -> None:  # as if the router had sent `prompt` to "holder"
            r._remember(_route(pick(prompt)), r._hashes(_route(pick(prompt))), holder.replica_id)

        held(prompts[0])
        held(fresh)
        r._in_flight[holder.replica_id] = {"x", "y"}  # two more requests than "other"
        # The directory holds the prefix: two more requests is more than the holder's allowance of 1.
        assert ids(await r.choose_replicas([holder, other], pick(prompts[0]))) == [["other"], ["holder"]]
        assert r.tier_blocks_seen == 5
        # A prefix only the holder has: its allowance is 8, it keeps the request.
        assert ids(await r.choose_replicas([holder, other], pick(fresh))) == [["holder"], ["other"]]
        assert r.tier_blocks_seen == 5
        # Without the tier's metadata the router cannot look: the holder keeps it too.
        held(prompts[0])  # (the pick above made "other" its holder)
        plain = [FakeReplica(holder.replica_id), FakeReplica(other.replica_id)]
        assert ids(await r.choose_replicas(plain, pick(prompts[0]))) == [["holder"], ["other"]]

    asyncio.run(scenario())
