"""`llmc generate`: streams the same text as the Python API, prints latency to stderr, maps errors."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from llmc.cli import cli, main
from llmc.request.params import SamplingParams
from tests.runtime.engine_helpers import make_engine


def test_generate_streams_the_api_text_and_prints_metrics(tiny_build_dir, tmp_path):
    log = tmp_path / "m.jsonl"
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Hello there", "--max-new-tokens", "7",
                                      "--temperature", "0", "--device", "cpu", "--metrics-log", str(log)])
    assert result.exit_code == 0, result.output
    (expected,) = make_engine(tiny_build_dir).generate(
        ["Hello there"], SamplingParams(max_new_tokens=7, temperature=0.0))
    assert result.stdout == expected.text + "\n"
    assert "TTFT" in result.stderr and "mean ITL" in result.stderr and "tokens/s" in result.stderr
    assert log.exists() and all(json.loads(line) for line in log.read_text().splitlines())


def test_generate_lists_each_tokens_log_probability_with_logprobs(tiny_build_dir):
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Hello there", "--max-new-tokens", "5",
                                      "--temperature", "0", "--logprobs", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (expected,) = make_engine(tiny_build_dir).generate(
        ["Hello there"], SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=2))
    assert result.stdout == expected.text + "\n"
    lines = [line for line in result.stderr.splitlines() if " | " in line and not line.startswith("TTFT")]
    assert len(lines) == 5 and "TTFT" in result.stderr.splitlines()[-1]
    for line, lp in zip(lines, expected.logprobs):
        assert f"{lp.logprob:8.3f}" in line and line.count(f"{lp.top[1][1]:.3f}") == 1
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Hi", "--logprobs", "21", "--device", "cpu"])
    assert result.exit_code != 0 and "logprobs" in str(result.exception)


def test_generate_scores_the_prompt_with_prompt_logprobs(tiny_build_dir):
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "The river runs to the sea",
                                      "--max-new-tokens", "2", "--prompt-logprobs", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (expected,) = make_engine(tiny_build_dir).generate(
        ["The river runs to the sea"], SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=1))
    lines = result.stderr.splitlines()
    scored = len(expected.prompt_logprobs)
    assert scored >= 5 and all(f"{lp.logprob:8.3f}" in line for line, lp in zip(lines, expected.prompt_logprobs))
    mean = sum(lp.logprob for lp in expected.prompt_logprobs) / scored
    assert lines[scored] == (f"prompt: {scored} tokens after the first, mean log-probability {mean:.4f}, "
                             f"perplexity {math.exp(-mean):.3f}")


def test_generate_uses_recipe_defaults_for_flags_not_given(tiny_build_dir):
    # The tiny build's recipe sets runtime.sampling max_new_tokens=16, temperature=0 (greedy).
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Defaults", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (expected,) = make_engine(tiny_build_dir).generate(["Defaults"])
    assert result.stdout == expected.text + "\n"


def test_generate_chat_and_stop_flags(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    messages = [{"role": "user", "content": "Hi"}]
    (free,) = engine.generate([messages], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    stop = free.text[5:8]
    assert len(stop) == 3
    (expected,) = engine.generate([messages], SamplingParams(max_new_tokens=20, temperature=0.0, stop=(stop,)))
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Hi", "--chat", "--max-new-tokens", "20",
                                      "--temperature", "0", "--stop", stop, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.text + "\n"


def test_generate_bad_input_is_one_error_line(tiny_build_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_build_dir), "Hi", "--top-p", "1.5", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: top_p") and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tmp_path), "Hi", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "manifest.json" in err


@pytest.mark.parametrize("flags, fmt", [
    (["--choice", "red", "--choice", "blue"], {"type": "choice", "choices": ["red", "blue"]}),
    (["--regex", "[0-9]{3}"], {"type": "regex", "pattern": "[0-9]{3}"}),
    (["--json-schema", '{"enum": ["on", "off"]}'], {"type": "json_schema", "schema": {"enum": ["on", "off"]}}),
    (["--json-schema", "SCHEMA_FILE"], {"type": "json_schema", "schema": {"enum": ["on", "off"]}}),
    (["--grammar", "GRAMMAR_FILE"], {"type": "grammar", "grammar": 'start: "x" "y"?\n'}),
])
def test_generate_format_flags_constrain_the_answer_as_the_api_does(tiny_build_dir, tmp_path, flags, fmt):
    (tmp_path / "s.json").write_text('{"enum": ["on", "off"]}')
    (tmp_path / "g.lark").write_text('start: "x" "y"?\n')
    flags = [{"SCHEMA_FILE": str(tmp_path / "s.json"), "GRAMMAR_FILE": str(tmp_path / "g.lark")}.get(f, f)
             for f in flags]
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Pick:", "--max-new-tokens", "12",
                                      "--temperature", "0", "--device", "cpu", *flags])
    assert result.exit_code == 0, result.output
    (expected,) = make_engine(tiny_build_dir).generate(
        ["Pick:"], SamplingParams(max_new_tokens=12, temperature=0.0, structured=fmt))
    assert result.stdout == expected.text + "\n" and expected.finish_reason == "stop"
    assert "finish: stop" in result.stderr


def test_generate_format_flags_refuse_two_formats_and_bad_schemas(tiny_build_dir, tmp_path, capsys):
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "x", "--regex", "a", "--json-object"])
    assert result.exit_code == 2 and "--json-object and --regex each set the answer's format" in result.output
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "x", "--json-schema", "{bad"])
    assert result.exit_code == 2 and "--json-schema" in result.output and "not valid JSON" in result.output
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "x", "--json-schema", str(tmp_path / "no")])
    assert result.exit_code == 2 and "neither inline JSON nor a file" in result.output
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_build_dir), "Hi", "--regex", "(", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: structured: is not a valid regex format")


def test_generate_speculative_tokens_keeps_the_text_and_counts_the_drafts(tiny_build_dir):
    """``--speculative-tokens`` overrides the recipe's serving.speculative_tokens (0 in the tiny build): the same
    greedy text, a summary that says how many drafts were accepted; out of range is click's one usage error."""
    args = ["generate", str(tiny_build_dir), "Hello there", "--max-new-tokens", "24", "--temperature", "0",
            "--device", "cpu"]
    plain = CliRunner().invoke(cli, args)
    drafted = CliRunner().invoke(cli, args + ["--speculative-tokens", "4"])
    assert plain.exit_code == drafted.exit_code == 0, drafted.output
    assert drafted.stdout == plain.stdout and "drafts:" not in plain.stderr
    summary = drafted.stderr.splitlines()[-1]
    accepted, drafts = (int(n) for n in summary.split("drafts: ")[1].split(" accepted")[0].split(" of "))
    assert drafts >= accepted > 0  # the tiny model's greedy outputs loop
    bad = CliRunner().invoke(cli, args + ["--speculative-tokens", "17"])
    assert bad.exit_code == 2 and "--speculative-tokens" in bad.output and "0<=x<=16" in bad.output


def test_generate_reads_a_dash_prompt_from_stdin_as_is(tiny_build_dir):
    args = ["generate", str(tiny_build_dir), "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]
    piped = CliRunner().invoke(cli, args[:2] + ["-"] + args[2:], input="Hello there\n")
    assert piped.exit_code == 0, piped.output
    (expected,) = make_engine(tiny_build_dir).generate(
        ["Hello there\n"], SamplingParams(max_new_tokens=6, temperature=0.0))  # the newline is part of the prompt
    assert piped.stdout == expected.text + "\n"
    empty = CliRunner().invoke(cli, args[:2] + ["-"] + args[2:], input=" \n")
    assert empty.exit_code == 2 and "standard input was empty" in empty.output
    latin1 = CliRunner().invoke(cli, args[:2] + ["-"] + args[2:], input="caf\xe9".encode("latin-1"))
    assert latin1.exit_code == 2 and "not UTF-8 text (byte 0xe9 at offset 3)" in latin1.output


def test_generate_system_adds_a_system_message_before_the_chat_prompt(tiny_build_dir):
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, prompt_logprobs=0)
    engine = make_engine(tiny_build_dir)
    (expected,) = engine.generate([messages], params)
    rendered = engine.tokenizer.decode([lp.token_id for lp in expected.prompt_logprobs])
    assert "Answer in one word." in rendered  # the system text reaches the template
    result = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Hi", "--chat", "--system",
                                      "Answer in one word.", "--max-new-tokens", "5", "--temperature", "0",
                                      "--prompt-logprobs", "0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.text + "\n"
    assert f"prompt: {len(expected.prompt_logprobs)} tokens after the first" in result.stderr
    alone = CliRunner().invoke(cli, ["generate", str(tiny_build_dir), "Hi", "--system", "x", "--device", "cpu"])
    assert alone.exit_code == 2 and "--system is a chat message; add --chat" in alone.output


def test_generate_builds_the_format_index_only_for_a_format_flag(tiny_build_dir, monkeypatch):
    """One request: the tokenizer index (llguidance, 0.7-1.1 s, holding the GIL) is built only when a format flag
    will use it."""
    from llmc.runtime.api import Engine

    loaded = []
    real = Engine.from_dir.__func__

    def spy(cls, *args, **kwargs):
        loaded.append(real(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(Engine, "from_dir", classmethod(spy))
    base = ["generate", str(tiny_build_dir), "Pick:", "--max-new-tokens", "3", "--temperature", "0", "--device", "cpu"]
    for flags, built in (([], False), (["--choice", "yes", "--choice", "no"], True)):
        result = CliRunner().invoke(cli, base + flags)
        assert result.exit_code == 0, result.output
        assert (loaded[-1].grammars._index is not None) is built
