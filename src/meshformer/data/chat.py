"""Chat templates: the Jinja templates models ship in tokenizer_config.json, rendered as `transformers` does.

A template comes from a model or checkpoint directory (`tokenizer_config.json`'s `chat_template`, a string or a
list of named templates, or `chat_template.jinja`), or is one of the built-ins for models that have none:
`chatml` (Qwen, SmolLM: `<|im_start|>role ... <|im_end|>`), `llama3` (`<|start_header_id|>`) and `llama2`
(`[INST]`). Templates from the hub are untrusted code: they run in Jinja's immutable sandbox with the same
helpers transformers gives them (`raise_exception`, `tojson`, `strftime_now`, the loop-control extension and a
`{% generation %}` block that renders its body).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshformer.errors import UserError

BUILTIN = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\\n' + messages[0]['content'] + "
        "'\\n<</SYS>>\\n\\n' %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
        "(system if loop.first else '') + message['content'] | trim + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
}


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"chat template: Jinja syntax error on line {e.lineno}: {e.message}") from None


def template_from_config(tokenizer_config: dict) -> str | None:
    tpl = tokenizer_config.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def load_chat_template(directory: str | Path, name: str | None = None) -> str:
    """The template a model or checkpoint directory ships, or the built-in `name`; a one-line error if neither."""
    if name:
        if name in BUILTIN:
            return BUILTIN[name]
        if Path(name).is_file():
            return Path(name).read_text(encoding="utf-8")
        raise UserError(f"--template {name!r}: not a file nor a built-in template ({', '.join(BUILTIN)})")
    d = Path(directory)
    cfg_file = d / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            found = template_from_config(json.loads(cfg_file.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UserError(f"{cfg_file}: not a readable JSON object") from None
        if found:
            return found
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    raise UserError(f"{d} has no chat template: pass --template with one of {', '.join(BUILTIN)} or a .jinja file")


def template_tokens(tokenizer_config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config.json as strings, the names templates use."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = tokenizer_config.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        out[key] = v if isinstance(v, str) else ""
    return out


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = False, **special) -> str:
    """The text of `messages` ([{"role", "content"}]); `special`: bos_token, eos_token, ... as the template
    expects them (transformers passes the tokenizer's special tokens the same way)."""
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    except jinja2.TemplateError as e:
        raise UserError(f"chat template: {e}") from None
