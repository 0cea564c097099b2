"""End-of-sequence reconciliation: the pure core, chat-template markers, and a real tokenizer."""

from __future__ import annotations

import logging

from llmc.source.eos import chat_markers, reconcile_eos, reconcile_eos_ids
from llmc.tokenizer import load_tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
LLAMA3_SPECIALS = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006,
                   "<|end_header_id|>": 128007, "<|eot_id|>": 128009}


def test_smollm2_like_disagreement_drops_turn_start_and_warns():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=1, config_eos=2, generation_eos=2, chat_end=2,
                                      turn_start_ids={1})
    assert ids == (2,)
    assert any("disagree" in w for w in warnings)
    assert any("dropped eos candidate 1" in w for w in warnings)


def test_llama3_like_sources_merge_in_order_chat_end_first():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=128009, config_eos=128001, generation_eos=[128001, 128009],
                                      chat_end=128009, turn_start_ids={128006}, bos_token_id=128000)
    assert ids == (128009, 128001)
    assert len(warnings) == 1 and "disagree" in warnings[0]


def test_agreeing_sources_give_no_warning():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=2, config_eos=[2], generation_eos=2, chat_end=2,
                                      turn_start_ids={1})
    assert ids == (2,) and warnings == ()


def test_missing_sources_are_ignored_not_disagreements():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=None, config_eos=None, generation_eos=[5, 6], chat_end=None)
    assert ids == (5, 6) and warnings == ()


def test_no_candidate_at_all_warns():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=1, config_eos=None, generation_eos=None, chat_end=None,
                                      turn_start_ids={1})
    assert ids == ()
    assert any("model.eos_token_ids" in w for w in warnings)


def test_bos_candidate_is_dropped_when_another_candidate_remains():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=1, config_eos=2, generation_eos=None, chat_end=None,
                                      bos_token_id=1)
    assert ids == (2,)
    assert any("dropped eos candidate 1" in w for w in warnings)


def test_base_model_with_one_separator_token_for_bos_and_eos_keeps_it():
    # e.g. SmolLM2 base: bos = eos = <|endoftext|> (0); dropping it would leave nothing to stop on
    ids, warnings = reconcile_eos_ids(tokenizer_eos=0, config_eos=0, generation_eos=0, chat_end=None,
                                      bos_token_id=0)
    assert ids == (0,) and warnings == ()


def test_explicit_list_overrides_but_warns_when_it_omits_the_chat_end_token():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=2, config_eos=2, generation_eos=2, chat_end=2,
                                      explicit=(0,))
    assert ids == (0,)
    assert any("omits the chat template's end token 2" in w for w in warnings)


def test_explicit_list_that_keeps_the_chat_end_token_is_silent():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=2, config_eos=2, generation_eos=2, chat_end=2,
                                      explicit=(2, 0, 2))
    assert ids == (2, 0) and warnings == ()


def test_explicit_turn_start_token_is_kept_with_a_warning():
    ids, warnings = reconcile_eos_ids(tokenizer_eos=2, config_eos=2, generation_eos=2, chat_end=2,
                                      bos_token_id=1, explicit=(2, 1))
    assert ids == (2, 1)
    assert any("turn-start" in w for w in warnings)


def test_chat_markers_chatml():
    markers = chat_markers(CHATML, {"<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 0})
    assert (markers.end, markers.start) == ("<|im_end|>", "<|im_start|>")


def test_chat_markers_llama3():
    markers = chat_markers(LLAMA3, LLAMA3_SPECIALS)
    assert (markers.end, markers.start) == ("<|eot_id|>", "<|start_header_id|>")


def test_chat_markers_phi3_style_end():
    markers = chat_markers(PHI3, {"<|end|>": 32007, "<|user|>": 32010, "<|assistant|>": 32001})
    assert markers.end == "<|end|>"


def test_unrenderable_template_falls_back_to_known_markers_with_a_warning(caplog):
    broken = "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}{{ undefined_fn() }}"
    with caplog.at_level(logging.WARNING, logger="llmc.source.eos"):
        markers = chat_markers(broken, {"<|im_end|>": 2})
    assert markers.end == "<|im_end|>"
    (record,) = [r for r in caplog.records if r.name == "llmc.source.eos"]
    assert record.levelno == logging.WARNING and "could not be rendered" in record.message


def test_no_template_no_markers():
    assert chat_markers(None, {"<|im_end|>": 2}).end is None


def test_real_smollm2_tokenizer_reports_im_start_but_reconciles_to_im_end(smollm2_hf_dir, caplog):
    tokenizer = load_tokenizer(smollm2_hf_dir)
    assert tokenizer.eos_token == "<|im_start|>"  # the GGUF conversion's wrong eos, which reconciliation fixes
    template = (smollm2_hf_dir / "chat_template.jinja").read_text()
    with caplog.at_level(logging.WARNING, logger="llmc.source.eos"):
        res = reconcile_eos(tokenizer, config_eos=2, generation_eos=2, chat_template=template, bos_token_id=1)
    assert res.eos_token_ids == (2,)
    assert res.chat_end_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert {0, 1, 2} <= set(res.special_token_ids)
    assert any("dropped eos candidate 1" in r.message for r in caplog.records)
    assert res.warnings
