"""The prefix cache serves generated tokens too: a chat's next turn, whose prompt repeats the previous answer, finds
the answer's computed full blocks (before, only the previous prompt's), in the serial and the overlapped step paths,
and its outputs stay exact."""

from __future__ import annotations

import pytest

from tests.runtime.engine_helpers import GREEDY, assert_all_blocks_free, hf_greedy, make_engine
from tests.runtime.test_api import random_prompts


@pytest.mark.parametrize("overlap", [False, True])
def test_the_next_turn_reuses_the_blocks_of_the_previous_answer(tiny_build_dir, tiny_hf_dir, overlap):
    """A chat's next prompt repeats the previous answer: its computed full blocks are found in the prefix cache
    (before, only the previous prompt's were) and the outputs stay exact."""
    engine = make_engine(tiny_build_dir, overlap=overlap)
    first, tail = random_prompts(5, [21, 5])
    answer = engine.generate([first], GREEDY)[0].token_ids  # 12 tokens: 21 + 11 computed = 4 full blocks of 8
    before = engine.stats()["prefix_cache_hit_tokens"]
    second = first + list(answer) + tail
    (reply,) = engine.generate([second], GREEDY)
    assert engine.stats()["prefix_cache_hit_tokens"] - before == 32  # the prompt's 2 full blocks + 2 of the answer
    assert reply.metrics.cached_tokens == 32
    assert list(reply.token_ids) == hf_greedy(tiny_hf_dir, second, GREEDY.max_new_tokens)
    assert_all_blocks_free(engine)
