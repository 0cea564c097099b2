"""The gate's held-out domains: windows per domain, skipped domains, disjoint from every calibration source."""

from __future__ import annotations

from llmc.builder import calib_text, heldout
from llmc.builder.seed_prompts import all_prompts


def test_every_domain_holds_2048_tokens_of_smollm2_text(tokenizer, template):
    texts = heldout.domain_windows(heldout.DATA_FILES.keys() | {"pydoc"}, tokenizer, template, 2048, 512)
    assert texts.skipped == {} and {w.shape for w in texts.windows.values()} == {(4, 512)}


def test_chat_windows_hold_chat_markers_and_text_windows_none(tokenizer, template):
    texts = heldout.domain_windows(["chat", "prose"], tokenizer, template, 1024, 512)
    assert bool((texts.windows["chat"] == 1).any())  # <|im_start|>
    assert not bool((texts.windows["prose"] <= 16).any())  # no special token in plain text


def test_short_domains_and_chat_without_template_are_skipped_with_a_reason(tokenizer):
    texts = heldout.domain_windows(["chat", "code"], tokenizer, None, 2048, 512)
    assert "chat" not in texts.windows and "no chat template" in texts.skipped["chat"]
    texts = heldout.domain_windows(["code"], tokenizer, None, 10**6, 512)
    assert texts.windows["code"].shape[0] == len(heldout.domain_ids("code", tokenizer, None)) // 512
    texts = heldout.domain_windows(["code"], tokenizer, None, 2048, 100_000)
    assert texts.windows == {} and "fewer than one window of 100000" in texts.skipped["code"]


def test_held_out_text_is_disjoint_from_calibration_and_seed_prompts():
    pydoc = "\n\n".join(m["content"] for u in calib_text.load_units(_Source("pydoc")) for m in u)
    written = [heldout.domain_text(n) for n in ("prose", "code", "chinese")]
    written.append("\n\n".join(m["content"] for c in heldout.chat_conversations() for m in c))
    for text in written:
        paragraphs = [p for p in calib_text.split_paragraphs(text) if len(p) > 80]
        assert paragraphs and not any(p in pydoc for p in paragraphs)
        assert not any(prompt in text for prompt in all_prompts())
    heldout_pydoc = heldout.domain_text("pydoc")
    assert not any(p in heldout_pydoc for p in calib_text.split_paragraphs(pydoc) if len(p) > 300)


class _Source:
    def __init__(self, dataset: str):
        self.dataset, self.path = dataset, None
