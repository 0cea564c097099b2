"""BlockManager: allocation, appends, ref counts, prefix sharing, LRU eviction; free count always restored."""

from __future__ import annotations

import pytest

from llmc.runtime.kv_cache import BlockManager


def make_bm(num_blocks: int = 8, block_size: int = 4, prefix: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)


def test_allocate_append_free_restores_free_count():
    bm = make_bm()
    table = bm.allocate("a", list(range(6)))  # 6 tokens -> 2 blocks of 4
    assert len(table) == 2 and len(set(table)) == 2
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 2
    assert bm.can_append("a", 2)
    assert bm.append("a", 2) == table  # slots 6, 7 fit in the second block
    assert bm.num_slots("a") == 8
    grown = bm.append("a", 1)  # slot 8 opens a third block
    assert len(grown) == 3 and grown[:2] == table
    assert all(bm.ref_count(b) == 1 for b in grown)
    bm.free("a")
    assert bm.num_free_blocks == 8 and all(bm.ref_count(b) == 0 for b in grown)


def test_can_allocate_and_can_append_respect_capacity():
    bm = make_bm(num_blocks=3, block_size=4)
    assert bm.can_allocate(list(range(12)))
    assert not bm.can_allocate(list(range(13)))
    bm.allocate("a", list(range(8)))
    assert bm.can_append("a", 4) and not bm.can_append("a", 5)
    assert not bm.can_allocate(list(range(100, 105)))
    bm.free("a")
    assert bm.num_free_blocks == 3


def test_prefix_blocks_are_shared_only_after_commit():
    bm = make_bm(block_size=4)
    prompt = list(range(10))  # two full blocks + a partial one
    a = bm.allocate("a", prompt)
    b = bm.allocate("b", prompt)  # "a" not computed yet: nothing to share
    assert set(a).isdisjoint(b) and bm.num_cached_tokens("b") == 0
    bm.free("b")
    bm.commit("a", 10)
    c = bm.allocate("c", prompt + [99])
    assert c[:2] == a[:2] and c[2] != a[2]
    assert bm.num_cached_tokens("c") == 8
    assert bm.ref_count(a[0]) == 2 and bm.ref_count(a[2]) == 1
    bm.free("a")
    bm.free("c")
    assert bm.num_free_blocks == 8


def test_generated_tokens_enter_the_prefix_cache_once_their_values_are_known():
    """With the sequence's tokens so far, commit registers the computed full blocks of its output too; a token
    whose value is not on the host yet (negative: a placeholder) holds its block back until a later commit."""
    bm = make_bm(block_size=4)
    prompt, outputs = list(range(1, 7)), [7, -1]  # 6 prompt tokens; the second output token not known yet
    a = bm.allocate("a", prompt)
    bm.append("a", 2)

    def tokens(start: int, end: int) -> tuple[int, ...]:
        return tuple((prompt + outputs)[start:end])

    bm.commit("a", 8, tokens)
    assert bm.num_cached_blocks == 1  # block 1 holds the placeholder
    outputs[1] = 8
    bm.commit("a", 8, tokens)
    assert bm.num_cached_blocks == 2
    b = bm.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 99])  # the next turn: the prompt, the answer, more
    assert b[:2] == a[:2] and bm.num_cached_tokens("b") == 8
    bm.commit("b", 9)  # without the tokens: only the allocation's (the prompt's) blocks, as before
    bm.allocate("c", prompt)  # six tokens: one full block, found
    assert bm.num_cached_tokens("c") == 4


def test_shared_prefix_diverges_after_first_differing_block():
    bm = make_bm(block_size=4)
    bm.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.commit("a", 9)
    b = bm.allocate("b", [1, 2, 3, 4, 0, 6, 7, 8, 9])  # second block differs -> its chain hash differs
    assert bm.num_cached_tokens("b") == 4
    assert b[0] == bm.block_table("a")[0] and b[1] != bm.block_table("a")[1]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_fully_cached_prompt_still_computes_its_last_block():
    bm = make_bm(block_size=4)
    prompt = list(range(8))
    a = bm.allocate("a", prompt)
    bm.commit("a", 8)
    b = bm.allocate("b", prompt)
    assert bm.num_cached_tokens("b") == 4  # the last block is private: its last token needs logits
    assert b[0] == a[0] and b[1] != a[1]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_freed_blocks_stay_reusable_until_evicted_lru():
    bm = make_bm(num_blocks=4, block_size=4)
    prompt = list(range(9))
    a = bm.allocate("a", prompt)
    bm.commit("a", 9)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = bm.allocate("b", prompt)  # revives the two cached blocks from the free list
    assert b[:2] == a[:2] and bm.num_cached_tokens("b") == 8
    assert bm.num_free_blocks == 1
    bm.free("b")
    # A prompt that needs every block evicts the cached ones (tail first).
    bm.allocate("c", list(range(100, 116)))
    assert bm.num_cached_blocks == 0
    bm.free("c")
    bm.allocate("d", prompt)
    assert bm.num_cached_tokens("d") == 0
    bm.free("d")
    assert bm.num_free_blocks == 4


def test_eviction_takes_least_recently_freed_first():
    bm = make_bm(num_blocks=4, block_size=2)
    bm.allocate("old", [1, 2, 3])
    bm.commit("old", 3)
    bm.free("old")  # cached block [1, 2] freed first
    bm.allocate("new", [5, 6, 7])
    bm.commit("new", 3)
    bm.free("new")  # cached block [5, 6] freed later
    bm.allocate("x", [9, 9, 9, 9, 9])  # needs 3 of the 4 blocks: evicts the 2 never-cached + oldest
    bm.free("x")
    assert bm.num_cached_blocks == 1
    bm.allocate("y", [5, 6, 0])
    assert bm.num_cached_tokens("y") == 2
    bm.free("y")
    assert bm.num_free_blocks == 4


def test_can_allocate_counts_free_cached_hits_as_consumed():
    bm = make_bm(num_blocks=3, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 5)
    bm.free("a")  # blocks [1, 2] and [3, 4] stay cached while free
    bm.allocate("x", [7])  # takes the uncached (partial) block: least recently freed
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 2
    assert not bm.can_allocate([1, 2, 3, 4, 9])  # 2 revived hits + 1 fresh block > 2 free
    assert bm.can_allocate([1, 2, 3])  # 1 revived hit + 1 fresh block
    bm.allocate("b", [1, 2, 3])
    assert bm.num_cached_tokens("b") == 2 and bm.num_free_blocks == 0
    bm.free("b")
    bm.free("x")
    assert bm.num_free_blocks == 3


def test_prefix_caching_disabled_never_shares():
    bm = make_bm(prefix=False)
    a = bm.allocate("a", list(range(9)))
    bm.commit("a", 9)
    b = bm.allocate("b", list(range(9)))
    assert set(a).isdisjoint(b) and bm.num_cached_tokens("b") == 0
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_double_allocate_and_double_free_are_bugs():
    bm = make_bm()
    bm.allocate("a", [1])
    with pytest.raises(AssertionError):
        bm.allocate("a", [1])
    bm.free("a")
    with pytest.raises(KeyError):
        bm.free("a")
    assert bm.num_free_blocks == 8


@pytest.mark.parametrize("prefix", [True, False])
def test_queried_and_hit_tokens_count_what_the_prefix_cache_served(prefix):
    bm = make_bm(block_size=4, prefix=prefix)
    bm.allocate("a", list(range(10)))
    bm.commit("a", 10)
    bm.allocate("b", list(range(9)) + [99])  # shares the two full blocks of "a" when caching is on
    bm.allocate("c", [50, 51, 52, 53, 54])  # nothing cached
    assert bm.queried_tokens == 10 + 10 + 5
    assert bm.hit_tokens == (8 if prefix else 0) == bm.num_cached_tokens("b")
