"""SamplingParams: validation names the field, from_dict / to_dict / replace round-trip."""

from __future__ import annotations

import dataclasses

import pytest

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.request.structured import OutputFormat


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 11, "max_new_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"stop": (3,)}, "stop"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": 2.0}, "top_k"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"temperature": "hot"}, "temperature"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": "big"}}, "logit_bias"),
        ({"logit_bias": {"3": float("nan")}}, "logit_bias"),
        ({"logit_bias": "3"}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"structured": OutputFormat("xml")}, "structured"),
    ],
)
def test_validate_names_the_field(changes, field):
    params = dataclasses.replace(SamplingParams(), **changes)
    with pytest.raises(RequestError) as exc:
        params.validate()
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}: ")


def test_stop_token_ids_are_bounded_by_the_vocabulary():
    params = SamplingParams(stop_token_ids=(5, 100))
    params.validate()  # no vocab size: only the sign is checked
    assert params.validate(vocab_size=101) is params
    with pytest.raises(RequestError) as exc:
        params.validate(vocab_size=100)
    assert exc.value.field == "stop_token_ids" and "100" in str(exc.value)


def test_valid_edge_values_pass():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, min_tokens=5, max_new_tokens=5, seed=2**64 - 1,
                   repetition_penalty=1e-3, top_k=0).validate()
    SamplingParams(seed=0, stop=("a", "bc"), stop_token_ids=(0,)).validate(vocab_size=1)


def test_from_dict_normalizes_and_validates():
    p = SamplingParams.from_dict({"stop": "###", "stop_token_ids": [2, 7], "temperature": 1, "seed": None})
    assert p.stop == ("###",)
    assert p.stop_token_ids == (2, 7)
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert p.seed is None
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(RequestError) as exc:
        SamplingParams.from_dict({"max_new_tokens": 0})
    assert exc.value.field == "max_new_tokens"
    with pytest.raises(RequestError) as exc:
        SamplingParams.from_dict({"stop_token_ids": [50000]}, vocab_size=49152)
    assert exc.value.field == "stop_token_ids"


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(RequestError) as exc:
        SamplingParams.from_dict({"temprature": 0.5})
    assert exc.value.field == "temprature"
    assert "temperature" in str(exc.value)  # the valid names are listed
    with pytest.raises(RequestError):
        SamplingParams.from_dict(["temperature", 0.5])


def test_to_dict_round_trips_and_is_json_able():
    import json

    p = SamplingParams(temperature=0.3, top_k=7, stop=("x", "yz"), stop_token_ids=(1, 2), seed=9, ignore_eos=True)
    d = p.to_dict()
    assert d["stop"] == ["x", "yz"] and d["stop_token_ids"] == [1, 2]
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == p
    assert set(d) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_replace_copies_validates_and_keeps_frozen():
    p = SamplingParams(top_k=5)
    q = p.replace(temperature=0.0, stop="END")
    assert q.temperature == 0.0 and q.top_k == 5 and q.stop == ("END",)
    assert p.temperature == 1.0
    with pytest.raises(RequestError) as exc:
        p.replace(top_p=2.0)
    assert exc.value.field == "top_p"
    with pytest.raises(RequestError):
        p.replace(bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3  # type: ignore[misc]


def test_derived_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert SamplingParams(frequency_penalty=0.2).uses_penalties


def test_logit_bias_takes_json_keys_or_pairs_and_is_bounded_by_the_vocabulary():
    p = SamplingParams(logit_bias={"7": -100, 3: 2})
    assert p.logit_bias == ((3, 2.0), (7, -100.0)) and p.shapes_logits
    assert SamplingParams.from_dict({"logit_bias": [[7, -100], [3, 2.0]]}) == p
    assert SamplingParams.from_dict(p.to_dict()) == p and p.to_dict()["logit_bias"] == {"3": 2.0, "7": -100.0}
    p.validate(vocab_size=8)
    with pytest.raises(RequestError, match=r"token id 7: ids must be distinct integers in \[0, 7\)"):
        p.validate(vocab_size=7)
    with pytest.raises(RequestError, match="distinct"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)]).validate()
    assert not SamplingParams().shapes_logits and SamplingParams(structured={"type": "json_object"}).shapes_logits
