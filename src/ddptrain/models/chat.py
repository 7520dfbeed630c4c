"""Chat records (`messages`: a list of {"role", "content"}) as token ids and labels, formatted with the
tokenizer's own chat template, the loss on the assistant's turns only (`--train_on assistant`) or on every
token (`--train_on all`).

The template is the jinja text in the tokenizer's tokenizer_config.json (`chat_template`), rendered in jinja's
sandbox (a template is data: it runs no code of its own) with the variables transformers gives it (`messages`,
`bos_token`, `eos_token`, `add_generation_prompt`, `raise_exception`). Which tokens are the assistant's is
found as TRL and transformers find it for templates without generation markers: the conversation is rendered
up to each turn, and an assistant turn's tokens are those its rendering adds after the prompt that asks for
it (`add_generation_prompt=True`). A template whose renderings are not prefixes of each other cannot be split
that way and is refused.

May import: the contracts at the top (errors). Nothing else in ddptrain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ddptrain.errors import UsageError

IGNORE = -100  # the label of a token the loss skips


TEMPLATE_FILE = "chat_template.jinja"  # where transformers' save_pretrained puts the template now


def read_template(directory: Path) -> str | None:
    """The tokenizer's default chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`;
    a named list gives the one called "default"), or None."""
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text()
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    template = json.loads(config_path.read_text()).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def compile_template(template: str, special: dict[str, str]) -> Callable[..., str]:
    """A function (messages, add_generation_prompt) -> text, rendering `template` in jinja's sandbox with the
    tokenizer's special tokens (`special`: bos_token, eos_token, ...)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

    return render


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} with string values; a UsageError naming `where` if not."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} (got "
                         f"{type(messages).__name__})")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UsageError(f"{where}: message {i} must have a string role and a string content (got "
                             f"{json.dumps(message, default=str)[:80]})")
    return messages


def tokenize_chat(messages: list[dict[str, str]], render: Callable[..., str],
                  encode: Callable[[str], list[int]], train_on: str, where: str) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation: labels are the ids on the assistant's turns (`train_on`
    "assistant") or everywhere ("all"), IGNORE elsewhere."""
    ids = encode(render(messages))
    if train_on == "all":
        return ids, list(ids)
    labels = [IGNORE] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = encode(render(messages[:turn], add_generation_prompt=True))
        through = encode(render(messages[:turn + 1]))
        start, end = len(prompt), len(through)
        if ids[:start] != prompt or ids[:end] != through or end < start:
            raise UsageError(f"{where}: the tokenizer's chat template does not render a conversation as a prefix of "
                             "its continuation, so the assistant's tokens cannot be told apart; use --train_on all")
        labels[start:end] = ids[start:end]
    return ids, labels
