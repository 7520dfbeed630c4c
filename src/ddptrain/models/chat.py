"""Chat records as token ids and labels, formatted with a chat template as transformers' `apply_chat_template`
formats them, the loss on what the assistant says (`--train_on assistant`) or on every token (`--train_on all`).

A record is a conversation (`messages`: a list of {"role", "content"} turns) or a conversational prompt and
completion (two such lists, TRL's shape), with an optional `tools` field (a list of JSON schemas, or that list
as JSON text) and `chat_template_kwargs` (more variables for the template), as TRL reads them.

The template is the jinja text of `--chat_template FILE`, else the tokenizer's (chat_template.jinja, else
tokenizer_config.json's `chat_template`), rendered in jinja's sandbox (a template is data: it runs no code of its
own) as transformers renders it: the loop controls `{% break %}` and `{% continue %}`, `{% generation %}`
markers, the globals `raise_exception`, `strftime_now` (today's date), `namespace` and `dict`, a `tojson` that
keeps keys in their order and text unescaped, and the variables `messages` (without the fields that are null,
the reasoning under each name templates read), `tools`, `documents`, `add_generation_prompt` and the
tokenizer's special tokens. The rendering is encoded without the special tokens a tokenizer adds to a text of
its own: the template writes those.

Which tokens the loss is on (`--train_on assistant`):
- a template with `{% generation %}...{% endgeneration %}` marks them: exactly the tokens that overlap a marked
  span, transformers' `return_assistant_tokens_mask` (TRL's `assistant_only_loss`);
- an unmarked one, as TRL's prompt/completion path finds them: the conversation is rendered up to each assistant
  turn, and that turn's tokens are what its rendering adds after the prompt that asks for it
  (`add_generation_prompt=True`): the reply, its end-of-turn token and whatever the template writes after that
  (ChatML's newline). A template whose renderings are not prefixes of each other cannot be split that way and
  is refused;
- a conversational prompt/completion: what the whole rendering adds after the prompt's generation prompt.

A template that does not compile, a role no template knows, a record the template refuses (its own
`raise_exception`) or fails on: each a UsageError naming the record.

May import: the contracts at the top (errors). Nothing else in ddptrain.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from ddptrain.errors import UsageError, first_line

IGNORE = -100  # the label of a token the loss skips
TEMPLATE_FILE = "chat_template.jinja"  # where transformers' save_pretrained puts the template now
# Who speaks in a conversation, by the names chat templates know (developer: gpt-oss; ipython: Llama 3.1's tool
# results; function: the older OpenAI name for them).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
REASONING = ("reasoning_content", "thinking", "reasoning")  # a turn's reasoning, under the names templates read
# What a record learns nothing from, as the first learnt token's place in its row (tokenize_record's third value).
NO_ASSISTANT_TURN, NOTHING_MARKED = -1, -2

Encode = Callable[[str], tuple[list[int], list[tuple[int, int]]]]  # text -> (ids, each id's character span)


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


def read_template_file(path: str) -> str:
    """The text of `--chat_template FILE`; a UsageError if it cannot be read or is empty."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--chat_template {path}: cannot read it ({type(exc).__name__}: {first_line(exc)}); pass "
                         "a jinja chat template file") from None
    if not text.strip():
        raise UsageError(f"--chat_template {path}: the file is empty; pass a jinja chat template file")
    return text


class TemplateRefused(Exception):
    """A template's own `raise_exception(message)`: the record is one the template's model does not take."""


class Template:
    """A chat template compiled as transformers compiles one; `source` names it in what goes wrong ("--chat_template
    FILE", "--tokenizer DIR's chat template"). `marked`: it has `{% generation %}` markers."""

    def __init__(self, text: str, special: dict[str, str], source: str):
        from jinja2 import TemplateSyntaxError

        self.special, self.source = special, source
        env = _environment()
        try:
            self.compiled = env.from_string(text)
        except TemplateSyntaxError as exc:
            raise UsageError(f"{source}: jinja cannot compile it (line {exc.lineno}: {exc.message}); "
                             "fix it, or pass another with --chat_template FILE") from None
        self._marks = env.extensions[_jinja_classes()[0].identifier]
        self.marked = self._marks.used

    def render(self, messages: list[dict[str, Any]], where: str, add_generation_prompt: bool = False,
               variables: dict[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(the text, the character spans its `{% generation %}` markers enclose) of `messages`; `variables`:
        `tools` and the record's own, which may override a special token (as in transformers)."""
        marks, pieces = self._marks, []
        marks.written, marks.spans = 0, []
        context = {**self.special, "tools": None, "documents": None, **(variables or {})}
        try:
            # Piece by piece, so that a marker knows how much was written before it.
            for piece in self.compiled.generate(context, messages=messages,
                                                add_generation_prompt=add_generation_prompt):
                pieces.append(piece)
                marks.written += len(piece)
        except TemplateRefused as exc:
            raise UsageError(f"{where}: the chat template refused it: {exc}") from None
        except Exception as exc:  # the template's code failing on this record: the template's or the record's fault
            raise UsageError(f"{where}: {self.source} cannot render it ({type(exc).__name__}: "
                             f"{first_line(exc)}); fix the record, or the template") from None
        return "".join(pieces), marks.spans


def _environment() -> Any:
    """A jinja sandbox set up as transformers sets one up for chat templates (a new one per template: its
    `{% generation %}` extension records what that template renders)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    generation, namespace = _jinja_classes()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=namespace)
    return env


@functools.cache
def _jinja_classes() -> tuple[type, type]:
    """(the `{% generation %}` extension, a namespace that holds no underscore names): made on first use, jinja2
    being an optional package."""
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension
    from jinja2.utils import Namespace

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body and records where it lies in the output."""

        tags = {"generation"}

        def __init__(self, environment: Any):
            super().__init__(environment)
            self.used = False  # the template has the tag: set while it compiles
            self.written = 0  # characters of the output before the marker being rendered
            self.spans: list[tuple[int, int]] = []

        def parse(self, parser: Any) -> Any:
            self.used = True
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_enclose"), [], [], body).set_lineno(lineno)

        def _enclose(self, caller: Callable[[], str]) -> str:
            text = caller()
            self.spans.append((self.written, self.written + len(text)))
            return text

    class SafeNamespace(Namespace):
        """jinja's `namespace`, refusing the underscore names through which a sandbox escape would go."""

        def __init__(*args: Any, **kwargs: Any):
            self, values = args[0], dict(*args[1:], **kwargs)
            for name in values:
                SafeNamespace.check(name)
            Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace.check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a chat template may not set {name!r} on a namespace (names with a leading "
                                    "underscore are refused)")

    return Generation, SafeNamespace


def _raise_exception(message: str) -> None:
    raise TemplateRefused(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: json.dumps as templates expect it (jinja's own sorts keys and escapes HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the dict type itself to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def check_messages(messages: Any, where: str, field: str = "messages") -> list[dict[str, Any]]:
    """`messages` as transformers hands a conversation to a template (the fields that are null dropped: a Parquet
    or JSON lines reader fills a field one turn has and another lacks with null; the reasoning under each of its
    names); a UsageError naming `where` if it is not a list of turns, each a known role and a content."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: {field} must be a non-empty list of {{\"role\", \"content\"}} (got "
                         f"{type(messages).__name__})")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UsageError(f"{where}: {field} turn {i} must be a {{\"role\", \"content\"}} object (got "
                             f"{json.dumps(message, default=str)[:80]})")
        message = {key: value for key, value in message.items() if value is not None}
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise UsageError(f"{where}: {field} turn {i} has no string role (got "
                             f"{json.dumps(message, default=str)[:80]})")
        if role not in ROLES:
            raise UsageError(f"{where}: {field} turn {i} has role {role!r}, which chat templates do not know; use one "
                             f"of {', '.join(ROLES)} (a reply is \"assistant\", a question \"user\")")
        if not (isinstance(content, (str, list)) or (content is None and "tool_calls" in message)):
            raise UsageError(f"{where}: {field} turn {i} must have a string content (or a list of content parts; "
                             f"none only with tool_calls) (got {json.dumps(message, default=str)[:80]})")
        reasoning = next((message[name] for name in REASONING if name in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        turns.append(message)
    return turns


def template_variables(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A record's `tools` (a list of JSON schemas, or that list as JSON text) and `chat_template_kwargs`, as TRL
    passes them to the template."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: tools is text but not JSON ({exc}); give a list of JSON schemas") from None
    if tools is not None and not isinstance(tools, list):
        raise UsageError(f"{where}: tools must be a list of JSON schemas (got {type(tools).__name__})")
    extra = record.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise UsageError(f"{where}: chat_template_kwargs must be an object of template variables (got "
                         f"{type(extra).__name__})")
    return {**extra, "tools": tools}


def tokenize_record(record: dict[str, Any], fields: list[str], template: Template, encode: Encode, train_on: str,
                    where: str) -> tuple[list[int], list[int], int]:
    """(input ids, labels, the place of the first learnt token) of a record's conversation: `fields` is
    [messages] or [prompt, completion]. The place is NO_ASSISTANT_TURN or NOTHING_MARKED where nothing is
    learnt, so that the row is not taken for one whose learnt tokens --seq_len cut off."""
    turns = [check_messages(record[field], where, field) for field in fields]
    messages, prompt_turns = [t for part in turns for t in part], (len(turns[0]) if len(fields) == 2 else 0)
    ids, labels = tokenize_chat(messages, template, encode, train_on, where, prompt_turns,
                                template_variables(record, where))
    first = next((j for j, label in enumerate(labels) if label != IGNORE), None)
    if first is not None:
        return ids, labels, first
    answered = prompt_turns or any(m["role"] == "assistant" for m in messages)
    return ids, labels, NOTHING_MARKED if answered else NO_ASSISTANT_TURN


def tokenize_chat(messages: list[dict[str, Any]], template: Template, encode: Encode, train_on: str, where: str,
                  prompt_turns: int = 0, variables: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation: labels are the ids of what the assistant says (`train_on`
    "assistant"; with `prompt_turns`, the first that many turns are a prompt and all that follows is learnt) or
    of every token ("all"), IGNORE elsewhere."""
    text, spans = template.render(messages, where, variables=variables)
    ids, offsets = encode(text)
    if train_on == "all":
        return ids, list(ids)
    labels = [IGNORE] * len(ids)
    if template.marked and not prompt_turns:
        for j, (start, end) in enumerate(offsets):
            if any(start < span_end and end > span_start for span_start, span_end in spans):
                labels[j] = ids[j]
        return ids, labels
    # (turns before the prompt for the reply, turns through the reply) of each reply
    replies = [(prompt_turns, len(messages))] if prompt_turns else \
        [(turn, turn + 1) for turn, message in enumerate(messages) if message["role"] == "assistant"]
    for before, through in replies:
        prompt = encode(template.render(messages[:before], where, True, variables)[0])[0]
        upto = ids if through == len(messages) else \
            encode(template.render(messages[:through], where, False, variables)[0])[0]
        start, end = len(prompt), len(upto)
        if ids[:start] != prompt or ids[:end] != upto or end < start:
            raise UsageError(f"{where}: {template.source} does not render a conversation as a prefix of its "
                             "continuation, so the assistant's tokens cannot be told apart; pass a template that marks "
                             "them ({% generation %}) with --chat_template FILE, or use --train_on all")
        labels[start:end] = ids[start:end]
    return ids, labels
