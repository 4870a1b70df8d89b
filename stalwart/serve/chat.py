"""Chat messages into a prompt: the model's own chat template when its directory ships one, else plain lines.

A Hugging Face directory (``stalwart serve --hf DIR``) may carry a Jinja chat template, in
``chat_template.jinja`` or as ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
named templates of which ``default`` is taken); the first found, in that order, renders the messages
the way ``transformers``' ``apply_chat_template`` does (a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, the special tokens of
``tokenizer_config.json`` as variables, ``add_generation_prompt`` true). Without a template (Stalwart's
own runs are base models) each message is a ``"<role>: <content>\\n"`` line and ``"assistant:"`` ends
the prompt.

Message content is a string or OpenAI's list of content parts (``[{"type": "text", "text": ...}]``);
text parts are joined with newlines. Other part types (images, audio) are refused, naming ``messages``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from stalwart.errors import UserError
from stalwart.infer.sampling import SamplingError

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def message_text(content: str | list | None, index: int) -> str:
    """The text of message ``index``'s content: a string, a list of text parts, or none."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise SamplingError(f"messages[{index}].content: only text parts are supported (got a part of type "
                                f"{part.type!r})", "messages")
        texts.append(part.text)
    return "\n".join(texts)


class ChatFormat:
    """Renders a conversation as the prompt text; ``template`` None: the plain ``role: content`` lines."""

    def __init__(self, template: str | None = None, special: dict[str, str] | None = None,
                 source: str | None = None) -> None:
        self.template = template
        self.special = dict(special or {})
        self.source = source  # where the template came from, for messages
        self._compiled = None
        if template is not None:
            from jinja2.exceptions import TemplateError

            try:
                self._compiled = _environment().from_string(template)
            except TemplateError as e:
                raise UserError(f"{source}: the chat template does not parse ({e})") from None

    @classmethod
    def of_dir(cls, directory: Path | None) -> "ChatFormat":
        """The chat format a model directory ships (its template), or the plain one."""
        if directory is None:
            return cls()
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS if config.get(k) is not None}
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(), special, str(jinja))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            return cls(template, special, str(config_path))
        return cls(None, special)

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages`` (``[{"role", "content"}]``, contents already text), ending where the
        assistant's reply begins."""
        if not messages:
            raise SamplingError("messages must not be empty", "messages")
        if self._compiled is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=True, tools=None,
                                         documents=None, **self.special)
        except TemplateError as e:
            raise SamplingError(f"messages: the model's chat template ({self.source}) refused them: {e}",
                                "messages") from None


def _token_text(token: Any) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken-like dict with ``content``."""
    return token["content"] if isinstance(token, dict) else str(token)


def _environment():
    """The sandboxed Jinja environment transformers renders chat templates in."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
