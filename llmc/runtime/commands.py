"""``llmc generate ENGINE_DIR PROMPT``: stream one answer from a build folder, then print its latency.

PROMPT ``-`` reads the prompt from standard input (a long prompt, or one in a file: ``llmc generate DIR - < f``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from llmc.request.params import SamplingParams
from llmc.runtime.scheduler.speculate import MAX_DRAFT_TOKENS


def _overrides(**given) -> dict:
    """Only the flags the user passed override the recipe's runtime.sampling (one source of defaults)."""
    return {k: v for k, v in given.items() if v is not None and v != ()}


@click.command("generate")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message through the model's chat template.")
@click.option("--system", default=None,
              help="With --chat: a system message before PROMPT (the template's own default system text otherwise).")
@click.option("--max-new-tokens", type=int, default=None, help="Tokens to generate at most [recipe default].")
@click.option("--temperature", type=float, default=None, help="0 = greedy [recipe default].")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1] [recipe default].")
@click.option("--top-k", type=int, default=None, help="Sample among the k most likely tokens; 0 = off.")
@click.option("--seed", type=int, default=None, help="Make sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); it is cut from the output.")
@click.option("--logprobs", type=int, default=None,
              help="After the answer, list each token's log-probability and the N most likely tokens' (0-20).")
@click.option("--prompt-logprobs", type=int, default=None,
              help="After the answer, list each prompt token's log-probability given the tokens before it, the N "
                   "most likely tokens' (0-20) and the prompt's perplexity.")
@click.option("--json-schema", "json_schema", default=None,
              help="Constrain the answer to a JSON schema: inline JSON or the path of a .json file.")
@click.option("--json-object", is_flag=True, help="Constrain the answer to a JSON object (any).")
@click.option("--regex", default=None, help="Constrain the whole answer to match a regular expression (Rust syntax).")
@click.option("--choice", multiple=True, help="Constrain the answer to one of these strings (repeatable).")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the answer to a context-free grammar (a file in llguidance's Lark syntax).")
@click.option("--speculative-tokens", type=click.IntRange(0, MAX_DRAFT_TOKENS), default=None,
              help="Draft tokens each step verifies (prompt lookup) instead of the recipe's "
                   "serving.speculative_tokens; 0 = off. The summary line counts the drafts and the accepted ones.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--metrics-log", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Append per-step and per-request metrics as JSON lines to FILE.")
def generate_cmd(engine_dir: Path, prompt: str, chat: bool, system: str | None, max_new_tokens: int | None,
                 temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
                 stop: tuple[str, ...], logprobs: int | None, prompt_logprobs: int | None, json_schema: str | None,
                 json_object: bool, regex: str | None, choice: tuple[str, ...], grammar: Path | None,
                 speculative_tokens: int | None, device: str, metrics_log: Path | None) -> None:
    """Stream the model's answer to PROMPT (``-``: read it from stdin, as is) from ENGINE_DIR (a build folder),
    then print TTFT, mean ITL and tokens/s to stderr (and, with --logprobs / --prompt-logprobs, each token's
    log-probability). Sampling defaults come from the recipe's runtime.sampling. --json-schema, --json-object,
    --regex, --choice and --grammar (one of them) constrain the answer to that format."""
    from llmc.runtime.api import Engine

    structured = output_format(json_schema, json_object, regex, choice, grammar)
    request = prompt_request(prompt, chat, system)
    engine = Engine.from_dir(engine_dir, device=device, metrics_log=metrics_log, speculative_tokens=speculative_tokens,
                             prepare_formats=structured is not None)  # one request: no index it would not use
    try:
        params: SamplingParams = engine.default_params.replace(**_overrides(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=tuple(stop), logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured))
        last, token_logprobs, scored = None, [], []
        for event in engine.stream(request, params):
            click.echo(event.text, nl=False)
            sys.stdout.flush()
            last = event
            token_logprobs += event.logprobs
            scored += event.prompt_logprobs
        click.echo()
    finally:
        engine.shutdown()
    if scored:
        for lp in scored:
            click.echo(_logprob_line(engine.tokenizer, lp), err=True)
        mean = sum(lp.logprob for lp in scored) / len(scored)
        click.echo(f"prompt: {len(scored)} tokens after the first, mean log-probability {mean:.4f}, perplexity "
                   f"{math.exp(-mean):.3f}", err=True)
    for lp in token_logprobs:
        click.echo(_logprob_line(engine.tokenizer, lp), err=True)
    if last is not None and last.metrics is not None:
        summary = _summary(last.metrics, last.finish_reason, last.stop_reason)
        if getattr(getattr(engine, "scheduler", None), "speculator", None) is not None:  # (torch builds)
            stats = engine.stats()
            summary += f" | drafts: {stats['accepted_draft_tokens']} of {stats['draft_tokens']} accepted"
        click.echo(summary, err=True)


def prompt_request(prompt: str, chat: bool, system: str | None) -> str | list[dict[str, str]]:
    """The prompt, or chat messages, generate sends; ``-`` reads the prompt from stdin. UsageError for an empty one
    and for --system without --chat."""
    if system is not None and not chat:
        raise click.UsageError("--system is a chat message; add --chat (or put the text in PROMPT)")
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.UsageError(f"standard input is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                                   f"{exc.start}); convert the prompt to UTF-8") from None
        if not prompt.strip():
            raise click.UsageError("PROMPT is '-' but standard input was empty; pipe the prompt in, e.g. "
                                   "`llmc generate DIR - < prompt.txt`")
    if not chat:
        return prompt
    user = [{"role": "user", "content": prompt}]
    return user if system is None else [{"role": "system", "content": system}, *user]


def output_format(json_schema: str | None, json_object: bool, regex: str | None, choice: tuple[str, ...],
                  grammar: Path | None) -> dict | None:
    """``SamplingParams.structured`` from generate's format flags (None when none is given); UsageError for two."""
    given = {"--json-schema": json_schema, "--json-object": json_object or None, "--regex": regex,
             "--choice": choice or None, "--grammar": grammar}
    named = [flag for flag, value in given.items() if value is not None]
    if len(named) > 1:
        raise click.UsageError(f"{' and '.join(named)} each set the answer's format; pass one of them")
    if json_schema is not None:
        text = json_schema
        if not json_schema.lstrip().startswith(("{", "true", "false")):
            path = Path(json_schema)
            if not path.is_file():
                raise click.BadParameter(f"{json_schema!r} is neither inline JSON nor a file",
                                         param_hint="--json-schema")
            text = path.read_text(encoding="utf-8")
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--json-schema") from None
        return {"type": "json_schema", "schema": schema}
    if json_object:
        return {"type": "json_object"}
    if regex is not None:
        return {"type": "regex", "pattern": regex}
    if choice:
        return {"type": "choice", "choices": list(choice)}
    if grammar is not None:
        return {"type": "grammar", "grammar": grammar.read_text(encoding="utf-8")}
    return None


def _logprob_line(tokenizer, lp) -> str:
    """``token  logprob  | alternative logprob ...`` (tokens decoded alone, shown with repr)."""
    text = lambda token_id: repr(tokenizer.decode([token_id]))  # noqa: E731
    top = "  ".join(f"{text(t)} {v:.3f}" for t, v in lp.top)
    return f"{text(lp.token_id):>16} {lp.logprob:8.3f}" + (f"  | {top}" if top else "")


def _summary(metrics, finish_reason: str | None, stop_reason) -> str:
    """One line: TTFT, mean ITL, tokens/s (generated tokens over end-to-end latency), finish reason."""
    itls = list(metrics.itls)
    mean_itl = sum(itls) / len(itls) * 1000 if itls else float("nan")
    e2e = metrics.e2e_latency or float("nan")
    n = metrics.generated_tokens
    reason = finish_reason if stop_reason is None else f"{finish_reason} ({stop_reason!r})"
    return (f"TTFT {metrics.ttft * 1000:.1f} ms | mean ITL {mean_itl:.1f} ms | {n} tokens in {e2e:.2f} s "
            f"= {n / e2e:.1f} tokens/s | finish: {reason}")
