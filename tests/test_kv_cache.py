"""BlockPool / KVCacheManager unit tests."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmsvc.core.block_pool import BlockPool, DoubleFreeError
from llmsvc.core.kv_cache_manager import KVCacheManager, hash_block_tokens, salt_hash
from llmsvc.core.request import Request
from llmsvc.sampling_params import SamplingParams


def mkreq(rid, tokens, **kw):
    return Request(rid, tokens, SamplingParams(**kw))


def test_chained_hash_depends_on_prefix():
    a = hash_block_tokens(None, [1, 2])
    assert a == hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_double_free_raises():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b])
    pool.check_invariants()


def test_allocation_and_free_return_all_blocks():
    kv = KVCacheManager(8, 4)
    r = mkreq("a", list(range(10)))
    assert len(kv.allocate_slots(r, 10)) == 3
    assert kv.num_free_blocks == 5 and kv.usage() == pytest.approx(3 / 8)
    r.num_computed_tokens = 10
    r.append_output_token_ids(5)
    assert kv.allocate_slots(r, 1) == []  # position 10 fits block 2
    r.num_computed_tokens = 11
    r.append_output_token_ids([6, 7])
    assert len(kv.allocate_slots(r, 2)) == 1
    assert kv.allocate_slots(mkreq("big", list(range(100))), 100) is None
    assert "big" not in kv.req_to_blocks
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.usage() == 0.0
    kv.check_invariants()


def test_prefix_hits_capped_and_shared_with_refcounts():
    kv = KVCacheManager(16, 4)
    a = mkreq("a", list(range(12)))  # 3 full blocks
    kv.allocate_slots(a, 12)
    b = mkreq("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.get_block_ids("a")[:2]  # never all 12: one token must be computed
    kv.allocate_slots(b, 4, hits)
    assert [kv.pool.ref_cnt[x] for x in hits] == [2, 2]
    c = mkreq("c", list(range(12)) + [50], prompt_logprobs=1)
    assert kv.get_computed_blocks(c) == ([], 0)  # prompt logprobs need every position computed
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 16


def test_freed_cached_blocks_reused_until_evicted_lru():
    kv = KVCacheManager(4, 2)
    a = mkreq("a", [1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    kv.allocate_slots(a, 5)
    a_blocks = list(kv.get_block_ids("a"))
    kv.free(a)
    b = mkreq("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2] and n == 4
    # a hit sitting in the free queue is not counted as free room
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.num_free_blocks == 1
    kv.free(b)
    # fill the pool with unrelated tokens: cached blocks get evicted, tail-first freed order
    c = mkreq("c", [7, 7, 7, 7, 7, 7, 7, 7])
    kv.allocate_slots(c, 8)
    kv.free(c)
    assert kv.get_computed_blocks(mkreq("d", [1, 2, 3, 4, 9])) == ([], 0)
    assert kv.pool.num_evictions >= 2
    kv.check_invariants()


def test_lru_eviction_prefers_least_recently_freed():
    kv = KVCacheManager(4, 2)
    old = mkreq("old", [1, 1, 1])
    kv.allocate_slots(old, 3)
    kv.free(old)
    new = mkreq("new", [2, 2, 2])
    kv.allocate_slots(new, 3)
    kv.free(new)
    # two blocks needed, the least recently freed first: "old"'s prefix is evicted, "new"'s survives
    kv.allocate_slots(mkreq("x", [3, 3, 3, 3]), 4)
    assert kv.get_computed_blocks(mkreq("n2", [2, 2, 5]))[1] == 2
    assert kv.get_computed_blocks(mkreq("o2", [1, 1, 5]))[1] == 0


def test_sliding_window_releases_blocks_no_token_can_see():
    kv = KVCacheManager(16, 4, sliding_window=6)
    r = mkreq("a", list(range(20)))
    blocks = kv.allocate_slots(r, 20)
    assert len(blocks) == 5 and kv.num_free_blocks == 11
    r.num_computed_tokens = 20
    r.append_output_token_ids(7)
    # the token at position 20 sees positions 15..20: blocks 0-2 (positions 0..11) are behind it
    assert len(kv.allocate_slots(r, 1)) == 1  # position 20 opens block 5
    assert kv.num_held_blocks("a") == 6 - 3 and kv.num_free_blocks == 16 - 3
    assert kv.get_block_ids("a")[:3] == blocks[:3]  # ids kept: workers' tables do not change
    kv.check_invariants()
    # released blocks stay in the prefix cache until evicted: a second request hits them
    other = mkreq("b", list(range(20)) + [99])
    hits, n = kv.get_computed_blocks(other)
    assert hits == blocks[:5] and n == 20
    for _ in range(5):  # the window slides one token at a time: at most one more block each step
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)
        kv.allocate_slots(r, 1)
        assert kv.num_held_blocks("a") <= -(-6 // 4) + 2
    kv.check_invariants()
    kv.free(r)
    assert kv.num_free_blocks == 16
    kv.check_invariants()


def test_no_release_without_a_window_or_before_the_first_step():
    full = KVCacheManager(16, 4)
    r = mkreq("a", list(range(40)))
    full.allocate_slots(r, 40)
    r.num_computed_tokens = 40
    r.append_output_token_ids(1)
    full.allocate_slots(r, 1)
    assert full.num_held_blocks("a") == 11
    windowed = KVCacheManager(32, 4, sliding_window=8)
    hit_owner = mkreq("x", list(range(40)))
    windowed.allocate_slots(hit_owner, 40)
    # a new request starting on 9 cached blocks keeps them for its first step (workers get
    # its full list then); the release comes with its next allocation
    late = mkreq("late", list(range(40)) + [5])
    hits, n = windowed.get_computed_blocks(late)
    assert n == 40 and len(windowed.allocate_slots(late, 1, hits)) == 1
    assert windowed.num_held_blocks("late") == 11
    late.num_computed_tokens = 41
    late.append_output_token_ids(6)
    windowed.allocate_slots(late, 1)  # position 41 sees 34..41: blocks 0-7 released
    assert windowed.num_held_blocks("late") == 11 - 8
    windowed.check_invariants()


def test_same_block_content_after_a_different_prefix_is_not_a_hit():
    # a block's K/V depends on every token before it: equal content at another position, or after
    # another prefix, must miss. P Q Y cached; then P Y (Y one block earlier) and Q Y (Y after Q at
    # its own position but with another first block) may reuse only what truly matches.
    P, Q, Y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    kv = KVCacheManager(32, 4)
    a = mkreq("a", P + Q + Y + [0])
    kv.allocate_slots(a, a.num_tokens)
    a_blocks = list(kv.get_block_ids("a"))
    kv.free(a)
    b = mkreq("b", P + Y + [0])
    assert kv.get_computed_blocks(b) == (a_blocks[:1], 4)  # P only, not A's Y block
    c = mkreq("c", Q + Q + Y + [0])
    assert kv.get_computed_blocks(c) == ([], 0)
    d = mkreq("d", P + Q + Y + [7])
    assert kv.get_computed_blocks(d)[1] == 12  # the whole chain still hits


def test_cache_salt_separates_prefix_groups():
    """Blocks are shared only within one salt; no salt is a group of its own."""
    kv = KVCacheManager(32, 4)
    tokens = list(range(12))
    owner = Request("owner", tokens, SamplingParams(), cache_salt="tenant-a")
    kv.allocate_slots(owner, 12)
    for rid, salt, expect in (("same", "tenant-a", 8), ("other", "tenant-b", 0), ("none", None, 0)):
        hits, n = kv.get_computed_blocks(Request(rid, tokens, SamplingParams(), cache_salt=salt))
        assert n == expect, (rid, n)
        assert hits == kv.get_block_ids("owner")[:expect // 4]
    plain = mkreq("plain", tokens)
    kv.allocate_slots(plain, 12)
    assert kv.get_computed_blocks(mkreq("plain2", tokens))[1] == 8
    assert kv.get_computed_blocks(Request("s", tokens, SamplingParams(), cache_salt="tenant-b"))[1] == 0
    # the salt reaches every block through the chain, not only the first
    assert owner.block_hashes[2] != plain.block_hashes[2]
    kv.free(owner)
    kv.free(plain)
    kv.check_invariants()


def test_no_salt_spells_an_adapters_cache_identity():
    # a client picks its salt; an adapter's key is "name\0<load number>". A salt that encodes
    # the key after it must not land in the adapter's cached blocks (its K/V are the base model's)
    lora_key = "all\x000"
    assert salt_hash("\0lora\0" + lora_key, None) != salt_hash("", lora_key)
    assert salt_hash("s\0lora\0" + lora_key, None) != salt_hash("s", lora_key)
    pairs = [(s, k) for s in (None, "", "a", "a\0", "\0a") for k in (None, "a", "\0a", "a\x000")]
    keys = {(s or "", k or ""): salt_hash(s, k) for s, k in pairs}
    assert len(set(keys.values())) == len(keys)  # distinct (salt, adapter) pairs, distinct roots
    assert keys[("", "")] is None  # the base model without a salt shares with every such request


@given(st.text(max_size=12), st.text(max_size=12), st.text(max_size=12), st.text(max_size=12))
def test_salt_hash_is_injective_on_salt_and_adapter(s1, k1, s2, k2):
    if (s1, k1) != (s2, k2):
        assert salt_hash(s1, k1) != salt_hash(s2, k2)
