"""Chat templates: the Jinja templates models ship in tokenizer_config.json, rendered as `transformers` does.

A template comes from a model or checkpoint directory (`tokenizer_config.json`'s `chat_template`, a string or a
list of named templates, or `chat_template.jinja`), or is one of the built-ins for models that have none:
`chatml` (Qwen, SmolLM: `<|im_start|>role ... <|im_end|>`), `llama3` (`<|start_header_id|>`) and `llama2`
(`[INST]`). Templates from the hub are untrusted code: they run in Jinja's immutable sandbox with the same
helpers transformers gives them (`raise_exception`, `tojson`, `strftime_now`, the loop-control extension and a
`{% generation %}` block that renders its body).

The sandbox stops escapes but not work, so every render also runs on a budget (`_BudgetedSandbox`): at most
MAX_STEPS loop iterations and calls, ranges of at most MAX_RANGE, no string, list or number past MAX_SIZE
(repetition, powers, format widths, huge arguments), at most MAX_SIZE characters of output and MAX_SECONDS of
time. Ordinary templates (SmolLM2's, Qwen's, Llama 3's) use a few hundred steps per conversation; a template that
runs past a limit is one line naming the template and the limit.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshformer.errors import UserError

MAX_STEPS = 100_000  # loop iterations + calls per render: Qwen2.5's template takes ~6 per message
MAX_RANGE = 10_000  # jinja's sandbox allows 100,000 per range, but nests them freely
MAX_SIZE = 1 << 24  # characters of output, items of a value, digits of a number, a width: 16 Mi
MAX_SECONDS = 5.0  # wall-clock per render, checked every CHECK_EVERY steps
CHECK_EVERY = 1024
# A width or precision of 8+ digits in %-formatting or str.format: 10 MB of padding from one expression.
_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\d{8,}|\*|\d*\.(\d{8,}|\*))|\{[^{}]*:[^{}]*\d{8,}")


class TemplateName(str):
    """A template's text that knows where it came from (errors name it): a built-in, a file, a directory's."""

    source = ""

    def __new__(cls, text: str, source: str):
        self = super().__new__(cls, text)
        self.source = source
        return self


class BudgetExceeded(jinja2.exceptions.TemplateError):
    pass


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


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox that also bounds the work of a render: every loop's iterable is wrapped (at parse
    time) in a filter that counts its iterations, every call and filter counts, and the operators and arguments that
    can build huge values in one step are checked before they run."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._state = threading.local()
        self.globals["range"] = self._range
        self.filters = {name: self._counted(f) for name, f in self.filters.items()}
        self.filters["_mf_steps"] = self._steps
        self.filters["_mf_size"] = _check_size

    def start(self, deadline: float) -> None:
        self._state.steps, self._state.deadline = 0, deadline

    def tick(self) -> None:
        st = self._state
        st.steps = getattr(st, "steps", 0) + 1
        if st.steps > MAX_STEPS:
            raise BudgetExceeded(f"more than {MAX_STEPS:,} loop steps and calls")
        if st.steps % CHECK_EVERY == 0 and time.monotonic() > getattr(st, "deadline", float("inf")):
            raise BudgetExceeded(f"more than {MAX_SECONDS:g} s")

    def _steps(self, iterable):
        for item in iterable:
            self.tick()
            yield item

    def _range(self, *args):
        self.tick()
        _check_args(args, {})  # before len(): a range past 2**63 cannot even be measured
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise BudgetExceeded(f"a range of {len(r):,} items, more than {MAX_RANGE:,}")
        return r

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_mf_steps", [], [], None, None, lineno=loop.lineno)
        for concat in list(tree.find_all(nodes.Concat)):  # `s ~ s` doubles a string in one step: bound it
            concat.nodes = [nodes.Filter(nodes.Concat(concat.nodes), "_mf_size", [], [], None, None)]
        return tree

    def _counted(self, f):
        def counted(*args, **kwargs):
            self.tick()
            _check_args(args, kwargs)
            if getattr(f, "__name__", "") == "do_format" and any(isinstance(a, str) for a in args[:2]):
                _check_format(next(a for a in args[:2] if isinstance(a, str)))
            return _check_size(f(*args, **kwargs))

        counted.__dict__.update(
            getattr(f, "__dict__", {})
        )  # jinja_pass_arg: context / eval-context / environment filters
        return counted

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self.tick()
        _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)  # the sandbox hands these out as its own wrapper: check the pattern here
        return super().getattr(obj, attribute)

    def call_binop(self, context, operator, left, right):
        self.tick()
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * abs(left).bit_length() > MAX_SIZE:
                raise BudgetExceeded(f"a power {_num(left)} ** {_num(right)} of more than {MAX_SIZE:,} bits")
        elif operator == "*":
            n, seq = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(n, int) and hasattr(seq, "__len__") and n * len(seq) > MAX_SIZE:
                raise BudgetExceeded(f"a repetition of {n:,} x {len(seq):,} items, more than {MAX_SIZE:,}")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            _check_args(right if isinstance(right, tuple) else (right,), {})
        return _check_size(super().call_binop(context, operator, left, right))


def _check_args(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_SIZE:
            raise BudgetExceeded(f"an argument of {_num(a)}, more than {MAX_SIZE:,}")


def _num(n: int) -> str:
    return f"{n:,}" if abs(n) < 10**18 else f"~2**{abs(n).bit_length()}"


def _check_format(pattern: str) -> None:
    if _WIDE_FORMAT.search(pattern):
        raise BudgetExceeded(f"a format width or precision of more than 7 digits in {pattern[:40]!r}")


def _check_size(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_SIZE:
        raise BudgetExceeded(f"a value of {len(value):,} items, more than {MAX_SIZE:,}")
    return value


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


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
            return TemplateName(BUILTIN[name], repr(name))
        if Path(name).is_file():
            return TemplateName(_read(Path(name)), str(name))
        raise UserError(f"--template {name!r}: not a file nor a built-in template ({', '.join(BUILTIN)})")
    d = Path(directory)
    cfg_file = d / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            found = template_from_config(json.loads(cfg_file.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UserError(f"{cfg_file}: not a readable JSON object") from None
        if found:
            return TemplateName(found, f"{cfg_file}'s chat_template")
    if (d / "chat_template.jinja").is_file():
        return TemplateName(_read(d / "chat_template.jinja"), str(d / "chat_template.jinja"))
    raise UserError(f"{d} has no chat template: pass --template with one of {', '.join(BUILTIN)} or a .jinja file")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"chat template {path}: not UTF-8 text (byte {e.start}): give a .jinja text file") from None


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
    expects them (transformers passes the tokenizer's special tokens the same way). Runs on the render budget
    (module docstring); a template past it, or failing in any other way, is a UserError naming it."""
    name = f"chat template {template.source}" if getattr(template, "source", "") else "chat template"
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{name}: Jinja syntax error on line {e.lineno}: {e.message}") from None
    compiled.environment.start(time.monotonic() + MAX_SECONDS)
    parts, size = [], 0
    try:
        for chunk in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **special):
            size += len(chunk)
            if size > MAX_SIZE:
                raise BudgetExceeded(f"more than {MAX_SIZE:,} characters of output")
            parts.append(chunk)
    except BudgetExceeded as e:
        raise UserError(
            f"{name}: stopped at its limit ({e}) while rendering one conversation, where ordinary templates "
            f"take a few hundred steps: fix the template's loops or pass another --template"
        ) from None
    except jinja2.TemplateError as e:
        raise UserError(f"{name}: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, MemoryError) as e:
        raise UserError(f"{name} failed: {type(e).__name__}: {e}: fix the template or the data") from None
    return "".join(parts)
