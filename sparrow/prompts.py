"""From dataset rows to the token ids generators get: chat templates, length filtering, stop tokens.

A prompt is rendered with the tokenizer's chat template (`apply_chat_template(...,
add_generation_prompt=True)`, with `chat_template_kwargs` such as Qwen3's `enable_thinking`), an
optional system prompt and optionally a template file that overrides the tokenizer's; `"none"`
feeds the raw text (the chain task); `"auto"` is the tokenizer's template when it has one, else raw
text. A prompt over `max_prompt_tokens` after templating is filtered out with a count, or is an
error, never truncated. Stop tokens are the tokenizer's eos, `generation_config.json`'s eos ids
(Qwen3 lists two) and any the config adds. The tokenizer is duck-typed (transformers' API).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparrow.rows import BadRow, Sample

TEMPLATE_MODES = ("auto", "tokenizer", "none")
LONG_PROMPT_POLICIES = ("skip", "error")


class PromptError(ValueError):
    """Prompts that cannot be rendered for this model; one line."""


@dataclass(frozen=True)
class ChatSettings:
    """How prompts are rendered: template mode or file, its kwargs, an optional system prompt."""

    template: str = "auto"  # auto | tokenizer | none | a path to a Jinja template file
    kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str = ""


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: the sample it came from, its text and token ids."""

    sample: Sample
    text: str
    token_ids: tuple[int, ...]


@dataclass
class PreparedSource:
    """A source's prompts ready for the generators, and what was left out."""

    name: str
    prompts: list[Prompt]
    too_long: int = 0  # prompts over max_prompt_tokens, filtered out
    bad: list[BadRow] = field(default_factory=list)  # rows the template refused
    longest: int = 0  # the longest prompt kept, in tokens


class Renderer:
    """Renders samples for one tokenizer under one ChatSettings."""

    def __init__(self, tokenizer, chat: ChatSettings) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.template: str | None = None  # None: the tokenizer's own
        if chat.template in ("none", "auto", "tokenizer"):
            has_own = bool(getattr(tokenizer, "chat_template", None))
            if chat.template == "tokenizer" and not has_own:
                raise PromptError(
                    "the model's tokenizer has no chat template (tokenizer_config.json or chat_template.jinja) "
                    "while chat_template = 'tokenizer'; give a template file, or 'none' for raw text"
                )
            self.raw = chat.template == "none" or (chat.template == "auto" and not has_own)
        else:
            path = Path(chat.template)
            try:
                self.template = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise PromptError(f"chat_template {path}: cannot read the template file ({exc})") from None
            self.raw = False

    @property
    def mode(self) -> str:
        """What renders prompts: "raw text", "the tokenizer's template" or the template file."""
        if self.raw:
            return "raw text"
        return f"template file {self.chat.template}" if self.template is not None else "the tokenizer's chat template"

    def render(self, sample: Sample) -> tuple[str, list[int]]:
        """(prompt text, token ids); raises PromptError when the template refuses the messages."""
        messages = sample.messages
        if self.chat.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.chat.system_prompt}, *messages]
        if self.raw:
            text = "\n".join(m["content"] for m in messages)
            return text, list(self.tokenizer(text)["input_ids"])
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.template,
                add_generation_prompt=True,
                tokenize=False,
                **self.chat.kwargs,
            )
        except Exception as exc:  # jinja's TemplateError (raise_exception in the template), TypeError, ...
            raise PromptError(f"the chat template refused the messages: {str(exc).splitlines()[0]}") from None
        # The template already wrote every special token (BOS included, where the model has one).
        return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def prepare_source(
    name: str,
    samples: list[Sample],
    renderer: Renderer,
    max_prompt_tokens: int,
    on_long_prompt: str = "skip",
    on_bad_row: str = "stop",
) -> PreparedSource:
    """Render every sample; filter (or refuse) those over `max_prompt_tokens`; PromptError when none is left."""
    if on_long_prompt not in LONG_PROMPT_POLICIES:
        raise ValueError(f"on_long_prompt must be one of {LONG_PROMPT_POLICIES}, got {on_long_prompt!r}")
    out = PreparedSource(name=name, prompts=[])
    for s in samples:
        try:
            text, ids = renderer.render(s)
        except PromptError as exc:
            bad = BadRow(s.row, str(exc), "row", s.file)
            if on_bad_row == "stop":
                raise PromptError(f"{bad} (on_bad_row = 'skip' skips bad rows)") from None
            out.bad.append(bad)
            continue
        if not ids:
            out.bad.append(BadRow(s.row, "the prompt renders to no tokens", "row", s.file))
            continue
        if len(ids) > max_prompt_tokens:
            if on_long_prompt == "error":
                raise PromptError(
                    f"{s.file} row {s.row}: the prompt is {len(ids)} tokens after templating, over "
                    f"max_prompt_tokens = {max_prompt_tokens} (on_long_prompt = 'skip' filters such prompts)"
                )
            out.too_long += 1
            continue
        out.prompts.append(Prompt(sample=s, text=text, token_ids=tuple(ids)))
        out.longest = max(out.longest, len(ids))
    if not out.prompts:
        why = f"{out.too_long} over max_prompt_tokens = {max_prompt_tokens}" if out.too_long else "none rendered"
        raise PromptError(f"source {name}: no prompt left after templating ({why}, {len(out.bad)} refused)")
    return out


def stop_token_ids(tokenizer, model_dir: str | Path | None, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Every id generation must stop at: the tokenizer's eos, generation_config.json's eos ids, and `extra`."""
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    if model_dir is not None:
        for name in ("generation_config.json", "config.json"):
            path = Path(model_dir) / name
            try:
                add(json.loads(path.read_text()).get("eos_token_id"))
            except (OSError, ValueError, AttributeError):
                continue  # a folder without one; a broken one is the model loader's to report
    add(list(extra))
    return tuple(ids)
