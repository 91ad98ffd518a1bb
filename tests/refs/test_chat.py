"""Chat templates render exactly as `transformers` renders them (the same Jinja template, the same sandbox helpers),
for the built-ins and for a template with the features hub templates use (system prompts, loop controls,
`raise_exception`, `{% generation %}` blocks); bad templates are one-line errors."""

from __future__ import annotations

import json

import pytest

from conftest import transformers_render as reference
from meshformer.data.chat import BUILTIN, load_chat_template, render_chat, template_tokens
from meshformer.errors import UserError

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
    [
        {"role": "user", "content": "  spaced  "},
        {"role": "assistant", "content": "ok"},
    ],
]
HUB_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set offset = 1 %}{{ '<|sys|>' + messages[0]['content'] | trim }}"
    "{%- else %}{%- set offset = 0 %}{%- endif %}"
    "{%- for message in messages[offset:] %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ '<|a|>' + message['content'] + eos_token }}"
    "{% endgeneration %}{%- else %}{{ '<|u|>' + message['content'] | tojson }}{%- endif %}"
    "{%- if loop.index > 10 %}{% break %}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|a|>' }}{%- endif %}"
)


@pytest.mark.parametrize("name", [*BUILTIN, "hub_style"])
@pytest.mark.parametrize("gen", [False, True], ids=["closed", "generation_prompt"])
def test_templates_render_exactly_as_transformers_does(name, gen):
    template = HUB_STYLE if name == "hub_style" else BUILTIN[name]
    for messages in CONVERSATIONS:
        want = reference(template, messages, gen)
        got = render_chat(template, messages, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>")
        assert got == want and got, (name, messages)


def test_templates_come_from_the_model_directory(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "chat_template": [{"name": "default", "template": "D"}]})
    )
    assert load_chat_template(tmp_path) == "D"
    assert template_tokens(json.loads((tmp_path / "tokenizer_config.json").read_text()))["eos_token"] == "</s>"
    assert load_chat_template(tmp_path, "chatml") == BUILTIN["chatml"]
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"


def test_bad_templates_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="has no chat template: pass --template"):
        load_chat_template(tmp_path)
    with pytest.raises(UserError, match="not a file nor a built-in template"):
        load_chat_template(tmp_path, "vicuna")
    with pytest.raises(UserError, match="Jinja syntax error on line 1"):
        render_chat("{% for m in messages %}", CONVERSATIONS[0])
    with pytest.raises(UserError, match="bad role"):
        render_chat(HUB_STYLE, [{"role": "tool", "content": "x"}], eos_token="</s>")
    with pytest.raises(UserError, match="chat template: .*unsafe"):  # the sandbox stops attribute escapes
        render_chat("{{ messages.__class__.__mro__ }}", CONVERSATIONS[0])
