"""IncrementalDetokenizer: streamed deltas concatenate to decode(), no U+FFFD from split characters, O(window).

Two tokenizer kinds: SmolLM2's byte-level BPE and a small SentencePiece-style BPE (metaspace "▁", byte
fallback ``<0xXX>``, Llama-2 decoder chain) trained here, since no SentencePiece model can be downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pydoc_data.topics
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llmc.request.detokenize import IncrementalDetokenizer, byte_fallback_token_ids

ENGLISH = "\n".join(sorted(pydoc_data.topics.topics.values()))
# Chinese prose written for this test (snownlp is not a dependency of the test suite).
CHINESE = (
    "推理服务的延迟问题大多出在模型前向计算之外：分词、调度、缓存管理、采样、停止条件和流式输出。"
    "一个中文字符在字节级分词器里常常被拆成两三个词元，如果在字符完整之前就把字节解码出来，"
    "用户就会看到替换字符。正确的做法是先把不完整的字节留住，等字符完整以后再一起发送。"
    "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。床前明月光，疑是地上霜。举头望明月，低头思故乡。"
    "今天天气很好，我们去公园散步，看见湖边的柳树发了新芽，孩子们在草地上放风筝，老人们在亭子里下棋。"
    "数据中心的功耗越来越高，散热系统也随之升级；工程师们需要在吞吐量、延迟和成本之间反复权衡。"
    "《论语》有云：“学而时习之，不亦说乎？有朋自远方来，不亦乐乎？”——这句话流传了两千多年。"
    "数字与符号混排：第１２３号、ＡＢＣ全角字母、温度－５℃、价格￥９９．５元、百分比８０％。"
)
EMOJI = "😀 👍🏽 👨‍👩‍👧‍👦 🇨🇳🇫🇷 ❤️‍🔥 🧑🏿‍💻 ✨🎉 ½ ∑ ∞ café naïve Ωmega 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "
MIXED = ENGLISH[:3000] + CHINESE + EMOJI + ENGLISH[-2000:]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_hf_dir: Path):
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(smollm2_hf_dir) / "tokenizer.json"))


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A Llama-2-style tokenizer: Prepend/Replace "▁" normalizer, BPE with byte fallback, strip-first decoder."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=120,
                                  show_progress=False)
    tok.train_from_iterator([ENGLISH[:40000], CHINESE[:60]], trainer)
    # byte-fallback pieces are ordinary vocabulary entries, as in a SentencePiece model
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{b:02X}>": base + b for b in range(256)})
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tokenizer, ids, prompt=(), skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def expected_text(tokenizer, ids, prompt=(), skip_special_tokens=True) -> str:
    kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
    if not prompt:
        return tokenizer.decode(list(ids), **kw)
    head = tokenizer.decode(list(prompt), **kw)
    if head.endswith("\ufffd") or prompt[-1] in byte_fallback_token_ids(tokenizer):
        return tokenizer.decode(list(ids), **kw)  # the prompt ends mid-character: no usable context
    full = tokenizer.decode(list(prompt) + list(ids), **kw)
    assert full.startswith(head)
    return full[len(head):]


def assert_exact(tokenizer, ids, skip_special_tokens=True):
    deltas = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # nothing invalid: no delta may contain a replacement character
        assert not any("\ufffd" in d for d in deltas)
    return deltas


def interesting_ids(tokenizer) -> list[int]:
    """Ids that stress the detokenizer: pieces of CJK / emoji characters, spaces, special tokens."""
    ids = tokenizer.encode(CHINESE[:80] + EMOJI + "  a  b\n\n\t x", add_special_tokens=False)
    return sorted(set(ids) | set(tokenizer.all_special_ids))


def random_ids(tokenizer):
    pool = interesting_ids(tokenizer)
    return st.lists(st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(pool)), max_size=40)


def text_windows(corpus: str):
    return st.tuples(st.integers(0, len(corpus) - 1), st.integers(1, 120)).map(
        lambda t: corpus[t[0]:t[0] + t[1]]
    )


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("kind", ["smollm2_tokenizer", "sp_tokenizer"])
class TestProperties:
    @SETTINGS
    @given(data=st.data(), skip=st.booleans())
    def test_random_ids(self, request, kind, data, skip):
        tokenizer = request.getfixturevalue(kind)
        ids = data.draw(random_ids(tokenizer))
        assert_exact(tokenizer, ids, skip_special_tokens=skip)

    @SETTINGS
    @given(data=st.data(), corpus=st.sampled_from([CHINESE, EMOJI, MIXED, ENGLISH]))
    def test_real_text(self, request, kind, data, corpus):
        tokenizer = request.getfixturevalue(kind)
        text = data.draw(text_windows(corpus))
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = assert_exact(tokenizer, ids)
        assert not any("\ufffd" in d for d in deltas)

    @SETTINGS
    @given(data=st.data(), corpus=st.sampled_from([CHINESE, MIXED]))
    def test_prompt_context(self, request, kind, data, corpus):
        tokenizer = request.getfixturevalue(kind)
        ids = tokenizer.encode(data.draw(text_windows(corpus)), add_special_tokens=False)
        cut = data.draw(st.integers(0, len(ids)))
        prompt, generated = ids[:cut], ids[cut:]
        deltas = stream(tokenizer, generated, prompt=prompt)
        expected = expected_text(tokenizer, generated, prompt=prompt)
        assert "".join(deltas) == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas)


def test_chinese_is_held_until_complete(smollm2_tokenizer, sp_tokenizer):
    for tokenizer in (smollm2_tokenizer, sp_tokenizer):
        ids = tokenizer.encode("中文😀", add_special_tokens=False)
        deltas = stream(tokenizer, ids)
        assert len(ids) > 3  # characters really are split across tokens
        assert "".join(deltas) == "中文😀"
        assert all("\ufffd" not in d for d in deltas)


def test_leading_space_after_the_prompt(sp_tokenizer, smollm2_tokenizer):
    for tokenizer in (sp_tokenizer, smollm2_tokenizer):
        prompt = tokenizer.encode("Hello", add_special_tokens=False)
        generated = tokenizer.encode("Hello world again", add_special_tokens=False)[len(prompt):]
        assert "".join(stream(tokenizer, generated, prompt=prompt)) == " world again"
    # without the prompt a SentencePiece decode drops the first space, as decode() does
    sp_gen = sp_tokenizer.encode("Hello world", add_special_tokens=False)
    assert "".join(stream(sp_tokenizer, sp_gen)) == sp_tokenizer.decode(sp_gen) == "Hello world"


def test_incomplete_character_is_released_only_at_flush(smollm2_tokenizer, sp_tokenizer):
    sp_bytes = sp_tokenizer.convert_tokens_to_ids(["<0xE4>", "<0xB8>"])  # first two bytes of "中"
    for tokenizer, pending in ((sp_tokenizer, sp_bytes), (smollm2_tokenizer, [])):
        if not pending:  # a byte-level token that is the first part of a multi-byte character
            pieces = smollm2_tokenizer.encode(CHINESE + EMOJI, add_special_tokens=False)
            pending = [next(i for i in pieces if smollm2_tokenizer.decode([i]) == "\ufffd")]
        word = tokenizer.encode("ok", add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.add(i) for i in word + pending]
        assert "".join(deltas) == "ok"
        assert deltas[-len(pending):] == [""] * len(pending)
        tail = detok.flush()
        assert tail and set(tail) == {"\ufffd"}  # invalid only because the stream ended
        assert detok.text == tokenizer.decode(word + pending)


def test_window_stays_small(smollm2_tokenizer):
    """Each decode sees O(window) ids, however long the stream (no O(total) re-decoding)."""
    sizes: list[int] = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return self.inner.decode(ids, **kw)

        def convert_tokens_to_ids(self, names):
            return self.inner.convert_tokens_to_ids(names)

        unk_token_id = None

    ids = smollm2_tokenizer.encode(MIXED[:6000], add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(smollm2_tokenizer))
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == smollm2_tokenizer.decode(ids)
    assert len(ids) > 1000 and max(sizes) <= 8


def test_byte_fallback_ids(sp_tokenizer, smollm2_tokenizer):
    assert len(byte_fallback_token_ids(sp_tokenizer)) == 256
    assert byte_fallback_token_ids(smollm2_tokenizer) == frozenset()


def test_fast_tokenizers_decode_through_their_backend(smollm2_tokenizer, sp_tokenizer):
    """A plain fast tokenizer's windows are decoded by the tokenizers library directly (transformers' decode adds
    only input conversion there); a tokenizer class that changes decoding keeps its own decode."""
    from llmc.request.detokenize import backend_decoder

    for tokenizer in (smollm2_tokenizer, sp_tokenizer):
        assert backend_decoder(tokenizer) is not None
        ids = tokenizer.encode(CHINESE[:40] + EMOJI[:20], add_special_tokens=False)
        assert backend_decoder(tokenizer)(ids, skip_special_tokens=True) == tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs).upper()

    shouting = Shouting(tokenizer_object=smollm2_tokenizer.backend_tokenizer)
    assert backend_decoder(shouting) is None
    ids = smollm2_tokenizer.encode("hello world, again", add_special_tokens=False)
    assert "".join(stream(shouting, ids)) == "HELLO WORLD, AGAIN"
    assert backend_decoder(object()) is None  # not a Hugging Face tokenizer: no backend
