"""End-of-sequence reconciliation: one recorded stop-id list from the model's disagreeing sources.

A model states its end token in up to four places: the tokenizer's ``eos_token``, config.json's
``eos_token_id``, generation_config.json's ``eos_token_id`` (int or list) and, implicitly, the chat template
(the special token it emits after each message's content, e.g. ``<|im_end|>`` or ``<|eot_id|>``). They often
disagree; GGUF conversions in particular can report the turn-start marker as eos, and stopping on it ends
every answer after a couple of tokens. ``reconcile_eos_ids`` is the pure core; ``reconcile_eos`` reads the
candidates from a tokenizer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

_SENTINEL_USER = "\x00llmc-user\x00"
_SENTINEL_ASSISTANT = "\x00llmc-assistant\x00"
# Used only when the template cannot be rendered: end-of-turn markers of well-known chat formats.
_KNOWN_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


@dataclass(frozen=True)
class ChatMarkers:
    """Special tokens a chat template emits: ``end`` after a message's content, ``start`` before a role."""

    end: str | None
    start: str | None


@dataclass(frozen=True)
class EosResolution:
    """The reconciled stop ids, every special token id, and what disagreed (human-readable warnings)."""

    eos_token_ids: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    warnings: tuple[str, ...]
    chat_end_token_id: int | None = None


def as_id_list(value: Any) -> list[int]:
    """``None`` -> [], ``int`` -> [int], list/tuple -> list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _unique(ids: Iterable[int]) -> list[int]:
    seen: list[int] = []
    for i in ids:
        if i not in seen:
            seen.append(i)
    return seen


def reconcile_eos_ids(
    *,
    tokenizer_eos: int | None,
    config_eos: Any,
    generation_eos: Any,
    chat_end: int | None,
    turn_start_ids: Iterable[int] = (),
    bos_token_id: int | None = None,
    explicit: tuple[int, ...] | None = None,
    names: dict[int, str] | None = None,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Reconcile eos candidates into ``(ids, warnings)``; pure.

    Order: chat end token, tokenizer eos, generation_config, config (so the first id is the one a chat
    answer ends with). A candidate in ``turn_start_ids`` (the chat template's turn-start marker) is dropped
    with a warning; one equal to ``bos_token_id`` is dropped with a warning when another candidate remains
    (base models such as GPT-2-style vocabularies legitimately use one document-separator token for both).
    Any disagreement between the present sources is a warning. ``explicit`` (the recipe's list) wins, with a
    warning when it omits the chat end token.
    """
    label = _Labeler(names or {})
    starts = set(turn_start_ids)
    non_bos = [i for i in [chat_end, tokenizer_eos, *as_id_list(generation_eos), *as_id_list(config_eos)]
               if i is not None and i not in starts and i != bos_token_id]
    if non_bos and bos_token_id is not None:
        starts.add(bos_token_id)
    by_source = {
        "chat template end token": as_id_list(chat_end),
        "tokenizer eos_token": as_id_list(tokenizer_eos),
        "generation_config eos_token_id": as_id_list(generation_eos),
        "config eos_token_id": as_id_list(config_eos),
    }
    warnings: list[str] = []
    present = {k: v for k, v in by_source.items() if v}
    if len({tuple(sorted(v)) for v in present.values()}) > 1:
        detail = "; ".join(f"{k}: {[label(i) for i in v]}" for k, v in present.items())
        warnings.append(f"end-of-sequence sources disagree ({detail})")
    if explicit is not None:
        ids = _unique(explicit)
        warnings += _explicit_warnings(ids, chat_end, starts | {bos_token_id} - {None}, label)
        return tuple(ids), tuple(warnings)
    ids = []
    for source, values in by_source.items():
        for i in values:
            if i in starts:
                warnings.append(f"dropped eos candidate {label(i)} from {source}: it is the BOS / turn-start "
                                f"token, and stopping on it would end answers after a few tokens")
            elif i not in ids:
                ids.append(i)
    if not ids:
        warnings.append("no end-of-sequence id found; generation stops only at max_new_tokens. "
                        "Fix: set model.eos_token_ids in the recipe")
    return tuple(ids), tuple(dict.fromkeys(warnings))


@dataclass(frozen=True)
class _Labeler:
    """Formats a token id with its text when known: ``2 ('<|im_end|>')``."""

    names: dict[int, str]

    def __call__(self, token_id: int) -> str:
        return f"{token_id} ({self.names[token_id]!r})" if token_id in self.names else str(token_id)


def _explicit_warnings(ids: list[int], chat_end: int | None, starts: set[int], label: _Labeler) -> list[str]:
    """Warnings about a recipe's explicit eos list: it omits the chat end token or contains a turn start."""
    warnings = []
    if chat_end is not None and chat_end not in ids:
        warnings.append(f"model.eos_token_ids {ids} omits the chat template's end token {label(chat_end)}; "
                        f"chat answers will not stop at the end of a turn")
    for i in ids:
        if i in starts:
            warnings.append(f"model.eos_token_ids includes {label(i)}, the BOS / turn-start token; "
                            f"generation will stop as soon as it is emitted")
    return warnings


def special_tokens_of(tokenizer: Any) -> dict[str, int]:
    """Every special token of a tokenizer (named specials and added tokens marked special) -> id."""
    out: dict[str, int] = {}
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            out[str(added.content)] = int(tid)
    for tok in getattr(tokenizer, "all_special_tokens", []):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid >= 0:
            out.setdefault(tok, tid)
    return out


def _render(template: str, messages: list[dict[str, str]]) -> str:
    """Render a chat template in a sandbox with the variables HF templates commonly use."""
    def raise_exception(msg: str) -> None:
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=False, bos_token="", eos_token="", tools=None
    )


def _special_at(text: str, pos: int, specials: Iterable[str], backwards: bool) -> str | None:
    """The longest special token that starts (or, backwards, ends) at ``pos`` after skipping whitespace."""
    if backwards:
        stripped = text[:pos].rstrip()
        matches = [s for s in specials if s and stripped.endswith(s)]
    else:
        rest = text[pos:].lstrip()
        matches = [s for s in specials if s and rest.startswith(s)]
    return max(matches, key=len) if matches else None


def chat_markers(template: str | None, specials: dict[str, int]) -> ChatMarkers:
    """Find the end-of-turn token (after the assistant's content) and the turn-start token of a template.

    Renders the template with sentinel contents; falls back to scanning for well-known end markers when the
    template cannot be rendered.
    """
    if not template:
        return ChatMarkers(end=None, start=None)
    messages = [{"role": "user", "content": _SENTINEL_USER}, {"role": "assistant", "content": _SENTINEL_ASSISTANT}]
    try:
        text = _render(template, messages)
    except Exception as exc:  # any template error: fall back to the static scan below
        log.warning("the chat template could not be rendered (%s); its end-of-turn token is guessed from known "
                    "markers instead: check the build's eos ids (llmc inspect)", exc)
        found = [m for m in _KNOWN_END_MARKERS if m in template and m in specials]
        return ChatMarkers(end=found[0] if found else None, start=None)
    end = None
    if _SENTINEL_ASSISTANT in text:
        end = _special_at(text, text.index(_SENTINEL_ASSISTANT) + len(_SENTINEL_ASSISTANT), specials, False)
    start = None
    if _SENTINEL_USER in text:
        before = text[: text.index(_SENTINEL_USER)]
        role_at = before.rfind("user")
        if role_at >= 0:
            start = _special_at(before, role_at, specials, True)
    return ChatMarkers(end=end, start=start)


def read_generation_eos(hf_dir: Path) -> Any:
    """``eos_token_id`` from generation_config.json (int, list or None when absent)."""
    path = Path(hf_dir) / "generation_config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("eos_token_id")


def reconcile_eos(
    tokenizer: Any,
    *,
    config_eos: Any,
    generation_eos: Any,
    chat_template: str | None,
    bos_token_id: int | None,
    explicit: tuple[int, ...] | None = None,
) -> EosResolution:
    """Reconcile a tokenizer's, config's, generation_config's and chat template's eos into one list.

    Warnings are logged and returned. ``special_token_ids`` collects bos/eos/pad/unk, every added token
    marked special, the chat markers and the reconciled eos ids.
    """
    specials = special_tokens_of(tokenizer)
    markers = chat_markers(chat_template, specials)
    chat_end = specials.get(markers.end) if markers.end else None
    starts = {specials[markers.start]} if markers.start in specials else set()
    if bos_token_id is None:
        bos_token_id = tokenizer.bos_token_id
    names = {i: s for s, i in specials.items()}
    ids, warnings = reconcile_eos_ids(
        tokenizer_eos=tokenizer.eos_token_id,
        config_eos=config_eos,
        generation_eos=generation_eos,
        chat_end=chat_end,
        turn_start_ids=starts,
        bos_token_id=bos_token_id,
        explicit=explicit,
        names=names,
    )
    for w in warnings:
        log.warning("%s", w)
    named = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id]
    special_ids = {i for i in (*named, bos_token_id) if i is not None} | set(specials.values()) | set(ids) | starts
    if chat_end is not None:
        special_ids.add(chat_end)
    return EosResolution(
        eos_token_ids=ids,
        special_token_ids=tuple(sorted(special_ids)),
        warnings=warnings,
        chat_end_token_id=chat_end,
    )
