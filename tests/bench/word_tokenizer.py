"""A word-level tokenizer like scripts/make_random_llama.py's, for tests of workloads it cannot encode."""

from __future__ import annotations


def word_level_tokenizer(vocab_size: int, eos_id: int):
    """A fast tokenizer whose token i is the word ``t{i}`` and whose unknown token is ``t0``, as the random
    models of scripts/make_random_llama.py have: every pydoc word encodes to id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos_id}", unk_token="t0")
