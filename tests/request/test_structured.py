"""Output formats (``SamplingParams.structured``): parsing and errors, and the constraints compiled against the
embedded SmolLM2 tokenizer: which ids a mask allows, end ids, completion, padded vocabularies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.request import structured
from llmc.request.structured import KINDS, Constraint, Grammars, OutputFormat
from llmc.tokenizer import byte_level_decoder
from llmc.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
          "required": ["zeta", "alpha"]}
EXAMPLES = [{"type": "json_object"}, {"type": "json_schema", "schema": SCHEMA}, {"type": "regex", "pattern": "a+"},
            {"type": "choice", "choices": ["red", "green"]}, {"type": "grammar", "grammar": 'start: "x"'},
            {"type": "ebnf", "grammar": 'root ::= "x"'}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_dir):
    return load_tokenizer(smollm2_hf_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), [2])


def allowed(constraint) -> set[int]:
    bits = np.unpackbits(constraint.mask().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_every_kind_round_trips_and_a_schema_keeps_its_key_order():
    assert {e["type"] for e in EXAMPLES} == set(KINDS)
    for example in EXAMPLES:
        fmt = OutputFormat.from_dict(example)
        assert fmt.to_dict() == example and OutputFormat.from_dict(fmt.to_dict()) == fmt
        params = SamplingParams(structured=example)
        assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    assert list(json.loads(OutputFormat.from_dict(EXAMPLES[1]).spec)["properties"]) == ["zeta", "alpha"]


@pytest.mark.parametrize("value, field, words", [
    ({"type": "xml"}, "structured", "must be an object with a type in json_object, json_schema"),
    ("json", "structured", "must be an object"),
    ({"type": "regex"}, "structured.pattern", "must be a non-empty string"),
    ({"type": "choice", "choices": []}, "structured.choices", "non-empty list of non-empty strings"),
    ({"type": "choice", "choices": ["a", 3]}, "structured.choices", "non-empty list"),
    ({"type": "json_schema", "schema": "{}"}, "structured.schema", "must be a JSON schema (an object)"),
    ({"type": "json_object", "schema": {}}, "structured.schema", "takes nothing but type"),
    ({"type": "regex", "pattern": "a", "flags": "i"}, "structured.flags", "takes 'pattern'"),
])
def test_malformed_formats_name_their_field(value, field, words):
    with pytest.raises(RequestError) as info:
        SamplingParams.from_dict({"structured": value})
    assert info.value.field == field and words in info.value.message


def test_a_choice_allows_exactly_the_tokens_that_start_a_choice_then_ends_complete(tokenizer, grammars):
    constraint = grammars.compile(OutputFormat.from_dict({"type": "choice", "choices": ["red", "green"]}))
    first = allowed(constraint)
    want = {i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and ("red".startswith(text)
                                                                                    or "green".startswith(text))}
    assert first == want and 2 not in first
    for token in tokenizer.encode("green", add_special_tokens=False):
        assert not constraint.complete and constraint.accept(token)
    assert constraint.complete
    assert not constraint.accept(tokenizer.encode("x", add_special_tokens=False)[0])  # nothing may follow


def test_end_ids_are_allowed_once_the_output_could_end(tokenizer, grammars):
    constraint = grammars.compile(OutputFormat.from_dict({"type": "regex", "pattern": "[0-9]+"}))
    assert 2 not in allowed(constraint)  # at least one digit first
    assert constraint.accept(tokenizer.encode("7", add_special_tokens=False)[0])
    after = allowed(constraint)
    assert 2 in after and not constraint.complete  # more digits or the end
    assert tokenizer.encode("a", add_special_tokens=False)[0] not in after
    assert constraint.accept(2) and constraint.complete


def test_ids_past_the_tokenizers_vocabulary_are_never_allowed(tokenizer):
    padded = Grammars(tokenizer, len(tokenizer) + 64, [2])
    constraint = padded.compile(OutputFormat.from_dict({"type": "json_object"}))
    assert constraint.mask().shape == (-(-(len(tokenizer) + 64) // 32),)
    assert max(allowed(constraint)) < len(tokenizer)


@pytest.mark.parametrize("value, words", [
    ({"type": "regex", "pattern": "("}, "not a valid regex format"),
    ({"type": "ebnf", "grammar": "root ::= missing"}, "not a valid ebnf format"),
    ({"type": "grammar", "grammar": "start: ("}, "not a valid grammar format"),
])
def test_formats_that_do_not_compile_name_the_field_without_a_source_dump(grammars, value, words):
    with pytest.raises(RequestError) as info:
        grammars.compile(OutputFormat.from_dict(value))
    assert info.value.field == "structured" and words in info.value.message and "\n" not in info.value.message


@pytest.mark.parametrize("threads", [1, 2])
def test_a_steps_masks_computed_together_equal_each_constraints_own(tokenizer, threads):
    """In turn (1 thread) and on llguidance's pool (2)."""
    grammars = Grammars(tokenizer, len(tokenizer), [2], mask_threads=threads)
    assert (grammars._executor() is None) == (threads == 1)
    formats = [{"type": "regex", "pattern": "[0-9]+"}, {"type": "json_object"}, {"type": "choice", "choices": ["no"]}]
    constraints = [grammars.compile(OutputFormat.from_dict(f)) for f in formats]
    assert constraints[0].accept(tokenizer.encode("4", add_special_tokens=False)[0])
    together = Constraint.masks(constraints)
    assert together.shape == (3, -(-len(tokenizer) // 32)) and together.dtype == np.int32
    for row, constraint in zip(together, constraints):
        assert np.array_equal(row, constraint.mask())
    assert np.array_equal(Constraint.masks(constraints[1:2])[0], constraints[1].mask())


def test_a_tokenizer_llguidance_cannot_read_is_one_request_error():
    """A word-level vocabulary joined by a WordPiece decoder (the random benchmark models' tokenizer): the request
    is refused naming ``structured``; nothing else is affected."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(64)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t63", unk_token="t0")
    with pytest.raises(RequestError) as info:
        Grammars(tokenizer, 64, [63]).compile(OutputFormat("regex", "t1"))
    assert info.value.field == "structured" and "is not available for this engine's tokenizer" in info.value.message


def test_a_token_the_format_refuses_ends_its_request_with_an_error_event(tokenizer, grammars):
    """The sampler's mask rules it out; should one arrive all the same, the request fails loudly, not silently
    off-format."""
    from llmc.request.metrics import RequestMetrics
    from llmc.request.outputs import RequestOutput

    params = SamplingParams(structured={"type": "choice", "choices": ["red"]})
    output = RequestOutput("r", (1, 2), params, tokenizer, [2], 64, RequestMetrics(),
                           constraint=grammars.compile(params.structured))
    event = output.on_token(tokenizer.encode("blue", add_special_tokens=False)[0], 1.0)
    assert event.finished and event.finish_reason == "error" and "not allowed by the request's output format" in \
        event.error
    done = RequestOutput("s", (1, 2), params, tokenizer, [2], 64, RequestMetrics(),
                         constraint=grammars.compile(params.structured))
    events = [done.on_token(t, 1.0) for t in tokenizer.encode("red", add_special_tokens=False)]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason is None
    assert "".join(e.text for e in events) == "red"


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_drafts_are_the_forced_tokens_else_the_proposals_prefix_the_format_allows(tokenizer, grammars):
    """Speculation (``Constraint.drafts``): the proposal cut at the first token the format refuses, where that is
    longer than the tokens the format forces and begins with them (a schema's first key: '{"name'); else the forced
    tokens; never past the limit. Drafting leaves the constraint's state as it was."""
    constraint = grammars.compile(OutputFormat.from_dict({"type": "json_schema", "schema": PERSON}))
    answer = tokenizer.encode('{"name":"Bob","age":3}', add_special_tokens=False)
    junk = tokenizer.encode("x", add_special_tokens=False)
    before = constraint.mask()
    forced = constraint.drafts(junk, 64)  # nothing allowed proposed: the forced tokens
    assert tokenizer.decode(list(forced)) == '{"name' and forced == tuple(answer[:2])
    assert constraint.drafts(answer + answer[:1], 64) == tuple(answer)  # after "}" only an end id may follow
    assert constraint.drafts(answer, 3) == tuple(answer[:3]) and constraint.drafts(answer, 1) == forced[:1]
    assert constraint.drafts(answer, 0) == () and constraint.drafts(answer[:2] + junk, 64) == forced  # no other key
    assert constraint.drafts(tokenizer.encode('{"', add_special_tokens=False) + junk, 64) == forced  # shorter
    assert np.array_equal(constraint.mask(), before)
    for token in answer[:2]:
        assert constraint.accept(token)
    assert constraint.drafts(junk, 64) == () and constraint.drafts(answer[2:], 64) == tuple(answer[2:])


class _OldPool:
    """llguidance 0.7's thread pool (TensorRT-LLM 1.2's pin): no call for drafts."""

    def __init__(self, pool):
        self.unsafe_compute_mask_ptr = pool.unsafe_compute_mask_ptr


@pytest.mark.parametrize("threads", [1, 2, "0.7"])
def test_masks_after_each_draft_equal_masks_taken_token_by_token_and_leave_the_state(tokenizer, threads):
    """A drafted row samples under the mask its position would have: ``Constraint.masks(.., drafts)`` gives each
    constraint its mask now and after each of its drafts (in turn, on llguidance's pool, and on a pool without the
    drafts call), then rolls back."""
    grammars = Grammars(tokenizer, len(tokenizer), [2], mask_threads=2 if threads == "0.7" else threads)
    if threads == "0.7":
        grammars._pool = _OldPool(grammars._executor())
    formats = [{"type": "json_schema", "schema": PERSON}, {"type": "regex", "pattern": "[0-9]+"},
               {"type": "choice", "choices": ["green tea", "green"]}]
    constraints = [grammars.compile(OutputFormat.from_dict(f)) for f in formats]
    drafts = [tokenizer.encode('{"name":"Al', add_special_tokens=False), [],
              tokenizer.encode("green tea", add_special_tokens=False)]
    before = [c.mask() for c in constraints]
    rows = Constraint.masks(constraints, drafts)
    assert rows.shape == (3 + sum(map(len, drafts)), before[0].shape[0])
    at = 0
    for c, d, mask in zip(constraints, drafts, before):
        assert np.array_equal(rows[at], mask)
        for i, token in enumerate(d):
            assert c.accept(token)
            assert np.array_equal(rows[at + 1 + i], c.mask())
        at += 1 + len(d)
    assert not np.array_equal(rows[1], rows[0])  # the masks do move with the drafts
    fresh = [grammars.compile(OutputFormat.from_dict(f)) for f in formats]
    Constraint.masks(fresh, drafts)
    assert all(np.array_equal(c.mask(), m) for c, m in zip(fresh, before))  # each state is where it was


def test_a_gguf_byte_level_vocabulary_reads_a_space_as_a_space(tokenizer, grammars, monkeypatch):
    """The embedded SmolLM2's tokenizer, converted from its GGUF, decodes through a chain of byte-fallback and
    ByteLevel steps; read as is, llguidance took " tea" for the bytes of "Ġtea" and refused every space a format
    spells out. The index is built from the ByteLevel decoder alone, and an index that misreads its tokens is
    refused with one clear error instead of masks that are wrong."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert [d["type"] for d in spec["decoder"]["decoders"]][-1] == "ByteLevel"  # the chain this is about
    assert json.loads(byte_level_decoder(json.dumps(spec)))["decoder"]["type"] == "ByteLevel"
    plain = dict(spec, decoder={"type": "ByteLevel"})
    assert byte_level_decoder(json.dumps(plain)) == json.dumps(plain)
    for fmt in ({"type": "choice", "choices": ["green tea", "red"]}, {"type": "regex", "pattern": "[a-z]+ [a-z]+"}):
        constraint = grammars.compile(OutputFormat.from_dict(fmt))
        ids = tokenizer.encode("green tea", add_special_tokens=False)
        assert len(ids) == 2 and all(constraint.accept(t) for t in ids), constraint.error
        assert fmt["type"] == "regex" or constraint.complete
    monkeypatch.setattr(structured, "byte_level_decoder", lambda text: text)  # the index as it was read before
    with pytest.raises(RequestError) as info:
        Grammars(tokenizer, len(tokenizer), [2]).compile(OutputFormat.from_dict(EXAMPLES[2]))
    assert info.value.field == "structured" and "reads its tokens as other bytes" in info.value.message


def test_json_comes_compact_unless_the_schema_asks_for_whitespace(tokenizer, grammars):
    """JSON formats allow no whitespace between tokens (no ``{"a": 1}`` spaces, no indentation: a model cannot pad
    its answer with spaces up to its length limit, and answers are short); a schema's own ``x-guidance``
    ``whitespace_flexible`` lets the model indent."""
    compact, pretty = (tokenizer.encode(t, add_special_tokens=False)
                       for t in ('{"a":[1,2],"b":{"c":"d e"}}', '{\n    "a": [1, 2],\n    "b": {"c": "d e"}\n}'))
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "schema": {"type": "object"}}):
        constraint = grammars.compile(OutputFormat.from_dict(fmt))
        assert constraint.drafts(compact, 64) == tuple(compact)  # every token allowed ("d e": a string's space)
        assert tokenizer.decode(list(constraint.drafts(pretty, 64))) == "{"
    flexible = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    constraint = grammars.compile(OutputFormat.from_dict({"type": "json_schema", "schema": flexible}))
    assert constraint.drafts(pretty, 64) == tuple(pretty)


@pytest.mark.parametrize("pattern, spelled", [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"[\d,]+\s\w", r"[[0-9],]+[\t\n\v\f\r ][0-9A-Za-z_]"),
    (r"\D\W\S", r"[^0-9][^0-9A-Za-z_][^\t\n\v\f\r ]"),
    (r"\\d\.\p{Nd}\x{41}\n", r"\\d\.\p{Nd}\x{41}\n"),  # an escaped backslash, other escapes: as written
    ("trailing\\", "trailing\\"),
])
def test_regex_classes_are_spelled_in_ascii(pattern, spelled):
    assert structured.ascii_classes(pattern) == spelled


def test_a_regex_digit_is_an_ascii_digit_unless_asked_otherwise(tokenizer, grammars):
    """Rust's Unicode ``\\d`` let SmolLM2 answer a phone-number regex with U+1FBF1 digits; ``\\d``, ``\\w`` and ``\\s``
    are ASCII now, as in JSON Schema patterns and XGrammar, and ``\\p{Nd}`` still asks for any Unicode digit."""
    def prefix(fmt: dict, text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.decode(list(grammars.compile(OutputFormat.from_dict(fmt)).drafts(ids, 64)))

    for pattern in (r"\d{3}", r"[\d]{3}"):
        assert prefix({"type": "regex", "pattern": pattern}, "123") == "123"
        assert prefix({"type": "regex", "pattern": pattern}, "\U0001fbf1\U0001fbf1\U0001fbf1") == ""
        assert prefix({"type": "regex", "pattern": pattern}, "\u0661\u0662\u0663") == ""  # Arabic-Indic digits
    assert prefix({"type": "regex", "pattern": r"\p{Nd}{3}"}, "\u0661\u0662\u0663") == "\u0661\u0662\u0663"
    assert prefix({"type": "regex", "pattern": r"\w+\s\w+"}, "ab_9 c\u00e9") == "ab_9 c"


def test_an_object_that_lists_properties_allows_no_others_unless_it_says_so(tokenizer, grammars):
    """XGrammar's strict mode (vLLM's and TensorRT-LLM's default): SmolLM2 answered a tool whose parameters name
    ``city`` with ``{"city": "Paris", "weather": {...`` up to its length limit before."""
    def allows(schema: dict, text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        compiled = grammars.compile(OutputFormat.from_dict({"type": "json_schema", "schema": schema}))
        return compiled.drafts(ids, 64) == tuple(ids)

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    extra, nested_extra = '{"city":"Paris","weather":"sunny"}', '{"where":{"city":"Paris","x":1}}'
    assert allows(city, '{"city":"Paris"}') and not allows(city, extra)
    assert allows({**city, "additionalProperties": True}, extra)
    assert allows({**city, "additionalProperties": {"type": "string"}}, extra)
    assert allows({"type": "object"}, extra)  # no properties named: any object, as XGrammar reads it
    nested = {"type": "object", "properties": {"where": {"$ref": "#/$defs/place"}}, "$defs": {"place": city}}
    assert allows(nested, '{"where":{"city":"Paris"}}') and not allows(nested, nested_extra)
    both = {"allOf": [city, {"type": "object", "properties": {"weather": {"type": "string"}}}]}
    assert allows(both, extra)  # an intersection stays as written: closing each part would forbid the other's


def test_closing_objects_copies_and_leaves_data_alone():
    from llmc.request.json_strict import close_objects

    data = {"properties": {"x": {}}}
    schema = {"type": "object", "properties": {"a": {"const": data, "default": data}},
              "anyOf": [{"properties": {"b": {}}}, {"type": "string"}], "items": [{"properties": {}}],
              "patternProperties": {"^p": {"properties": {"c": {}}}}}
    before = json.dumps(schema)
    closed = close_objects(schema)
    assert json.dumps(schema) == before  # not changed in place
    assert "additionalProperties" not in closed  # patternProperties says what else may come
    assert closed["properties"]["a"] == {"const": data, "default": data}  # values, not schemas
    assert closed["anyOf"][0]["additionalProperties"] is False and closed["anyOf"][1] == {"type": "string"}
    assert closed["items"][0]["additionalProperties"] is False
    assert closed["patternProperties"]["^p"]["additionalProperties"] is False
    assert close_objects(True) is True and close_objects({"type": "object"}) == {"type": "object"}
