"""Chat templates: the GGUF's own `tokenizer.chat_template`, rendered by Jinja in a sandbox."""
from __future__ import annotations

from functools import lru_cache

from .errors import UsageError

# Used only when a GGUF carries no template: ChatML, which most small instruct models follow.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UsageError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
    return [dict(m) for m in messages]


def render(template: str | None, messages, *, bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for `messages`, ending where the assistant's answer starts."""
    from jinja2.exceptions import TemplateError
    messages = validate_messages(messages)
    try:
        return _compile(template or CHATML).render(messages=messages, add_generation_prompt=True,
                                                   bos_token=bos_token, eos_token=eos_token)
    except TemplateError as exc:
        raise UsageError(f"the model's chat template failed: {exc}; use --raw to send the prompt as is") from None
