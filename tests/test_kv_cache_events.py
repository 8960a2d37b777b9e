"""The prefix cache's event journal (llmsvc.core.kv_events): off until read, then every stored,
evicted and cleared block, numbered, with the chained hashes the cache itself uses."""
from __future__ import annotations

from llmsvc.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from llmsvc.core.kv_events import KVEventJournal
from llmsvc.core.request import Request
from llmsvc.sampling_params import SamplingParams

BS = 4


def req(rid, tokens) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def fill(kv: KVCacheManager, r: Request) -> None:
    assert kv.allocate_slots(r, r.num_tokens) is not None
    r.num_computed_tokens = r.num_tokens


def test_nothing_is_recorded_until_a_reader_asks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    fill(kv, req("a", list(range(8))))
    assert kv.events.take(0).events == []  # the first take turns recording on
    fill(kv, req("b", list(range(20, 28))))
    page = kv.events.take(0)
    assert [e[1] for e in page.events] == ["stored", "stored"] and page.block_size == BS


def test_stored_chain_removed_on_eviction_cleared_on_reset():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.events.take(0)
    a = req("a", list(range(9)))  # two full blocks and one partial
    fill(kv, a)
    h0 = hash_block_tokens(None, range(4))
    h1 = hash_block_tokens(h0, range(4, 8))
    page = kv.events.take(0)
    assert page.events == [(1, "stored", h0, None, (0, 1, 2, 3)), (2, "stored", h1, h0, (4, 5, 6, 7))]
    kv.free(a)
    b = req("b", list(range(50, 66)))  # four fresh blocks: both cached ones are evicted
    fill(kv, b)
    removed = [e[2] for e in kv.events.take(2).events if e[1] == "removed"]
    assert sorted(removed) == sorted([h0, h1])
    kv.free(b)
    assert kv.pool.reset_prefix_cache()
    assert kv.events.take(page.last_seq).events[-1][1] == "cleared"


def test_a_reader_sees_where_it_fell_behind():
    j = KVEventJournal(block_size=BS, capacity=3)
    j.take(0)
    for i in range(5):
        j.removed(bytes([i]) * 32)
    page = j.take(0)
    assert (page.first_seq, page.last_seq) == (3, 5) and [e[0] for e in page.events] == [3, 4, 5]
    assert j.take(5).events == [] and j.take(4).events[0][0] == 5


def test_a_mirror_fed_by_drains_reads_like_the_journal():
    # the engine-core process drains its journal into each output batch; the front end's
    # mirror must number, dedupe and report falling behind as the journal itself does
    src, mirror = KVEventJournal(block_size=BS), KVEventJournal(block_size=BS, capacity=3)
    src.removed(b"x" * 32)
    assert src.drain() == []  # nothing is recorded before a reader asks
    src.take(0)
    for i in range(2):
        src.removed(bytes([i]) * 32)
    first = src.drain()
    assert [e[0] for e in first] == [1, 2] and src.drain() == []
    mirror.extend(first)
    mirror.extend(first[1:])  # already held: skipped
    assert [e[0] for e in mirror.take(0).events] == [1, 2]
    for i in range(2, 4):
        src.removed(bytes([i]) * 32)
    src.drain()  # lost on the way: the mirror sees a gap
    src.removed(b"z" * 32)
    mirror.extend(src.drain())
    page = mirror.take(2)
    assert page.first_seq == 5 and [e[0] for e in page.events] == [5] and page.first_seq > 2 + 1


def test_a_block_back_from_the_host_tier_is_stored_again():
    import random

    from tests.test_swap_scheduler import make_core, run

    rng = random.Random(1)
    shared = [rng.randrange(200) for _ in range(24)]  # 6 full blocks
    core, _ = make_core(num_blocks=12, num_host_blocks=32, max_num_batched_tokens=64)
    journal = core.kv_cache_manager.events
    journal.take(0)
    core.add_request(req("first", shared + [5]))
    run(core)
    for i in range(3):  # unrelated prompts evict the shared blocks from the device (into the host tier)
        core.add_request(req(f"x{i}", [rng.randrange(200) for _ in range(40)]))
        run(core)
    live: dict = {}
    for _, kind, *fields in journal.take(0).events:
        if kind == "stored":
            live[fields[0]] = fields[2]
        elif kind == "removed":
            live.pop(fields[0])
    bs = core.kv_cache_manager.block_size
    blocks = [tuple(shared[i:i + bs]) for i in range(0, 24, bs)]
    assert not set(blocks) & set(live.values())  # evicted: a router must not count on them
    last = journal.take(0).last_seq
    core.add_request(req("back", shared + [7, 8]))
    run(core)
    assert core.scheduler.swap.num_host_hits == 6
    back = [tuple(e[4]) for e in journal.take(last).events if e[1] == "stored"]
    assert back[:6] == blocks
