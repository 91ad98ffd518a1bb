"""`meshformer generate --chat`: a conversation, streamed as it is generated.

A conversation is a list of {role, content} messages. Before every reply the whole history is rendered with the
checkpoint's chat template (as transformers' `apply_chat_template(..., add_generation_prompt=True)` renders it)
and encoded; the reply is appended as an assistant message, so the next turn sees the conversation as it was
shown. Turns come from `--prompt` (one turn), `--messages FILE` (a scripted conversation: every user message not
followed by an assistant message gets a reply) or, on a terminal, from the user (`/exit` or EOF ends).

Text is printed as tokens arrive: the growing reply is decoded whole and only the part not yet printed is
written, so tokens that merge when decoded together (byte-level pieces of one character, spaces a decoder
adds) print what a decode at the end gives.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from meshformer.errors import UserError

MAX_MESSAGES_BYTES = 64 << 20  # a scripted conversation, not a dataset: `preprocess` reads those
EXIT = "/exit"


class StreamText:
    """Decode a growing list of token ids; `push` returns only the text not printed yet.

    `prefix_ids` (a plain prompt) are decoded with the new tokens, as the non-streamed output does, because
    tokenizers merge spaces across the boundary. `strip` gives what `.strip()` of the final text gives: leading
    whitespace is never printed, trailing whitespace waits for the text that follows it.
    """

    def __init__(self, tokenizer, prefix_ids: list[int] | None = None, strip: bool = False):
        self.tokenizer = tokenizer
        self.prefix_ids = list(prefix_ids or [])
        self.prefix = tokenizer.decode(self.prefix_ids) if self.prefix_ids else ""
        self.strip = strip
        self.ids: list[int] = []
        self.printed = ""

    def text(self) -> str:
        if self.prefix_ids:
            full = self.tokenizer.decode(self.prefix_ids + self.ids)
            t = full[len(self.prefix) :] if full.startswith(self.prefix) else self.tokenizer.decode(self.ids)
        else:
            t = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return t.strip() if self.strip else t

    def push(self, token: int) -> str:
        self.ids.append(token)
        # Part of a multi-byte character decodes as U+FFFD until its last byte arrives: hold it back.
        return self._emit(self.text().rstrip("\ufffd"))

    def finish(self) -> str:
        return self._emit(self.text())

    def _emit(self, text: str) -> str:
        if not text.startswith(self.printed):  # the decoder changed text already shown: wait until it agrees
            return ""
        out, self.printed = text[len(self.printed) :], text
        return out


@dataclass
class ChatSpec:
    """The checkpoint's template, the special tokens it is rendered with and the ids that end a reply."""

    template: str
    specials: dict
    stop: set[int] = field(default_factory=set)

    def render(self, messages: list[dict]) -> str:
        from meshformer.data.chat import render_chat

        return render_chat(self.template, messages, add_generation_prompt=True, **self.specials)


def chat_spec(checkpoint: str, template_name: str | None, tokenizer) -> ChatSpec:
    from meshformer.checkpoint.store import resolve_checkpoint
    from meshformer.data.chat import load_chat_template, template_tokens

    ckpt = resolve_checkpoint(checkpoint)
    tok_cfg_file = ckpt / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text(encoding="utf-8")) if tok_cfg_file.is_file() else {}
    specials = template_tokens(tok_cfg)
    ends = (specials["eos_token"], "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>")
    stop = {i for t in ends if t and (i := tokenizer.token_to_id(t)) is not None}
    return ChatSpec(load_chat_template(ckpt, template_name), specials, stop)


def read_messages(path: str) -> list[dict]:
    """A JSON list of {role, content} (or {"messages": [...]}), or JSONL with one message a line."""
    f = Path(path)
    if not f.is_file():
        raise UserError(f"--messages {path!r} is not a file: give a JSON list of {{role, content}} or JSONL")
    if f.stat().st_size > MAX_MESSAGES_BYTES:
        raise UserError(f"--messages {path}: larger than {MAX_MESSAGES_BYTES >> 20} MiB: give one conversation")
    try:
        text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--messages {path}: not UTF-8 (byte {e.start})") from None
    if text.lstrip().startswith(("[", "{")) and not _is_jsonl(text):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--messages {path}: line {e.lineno}: not JSON ({e.msg})") from None
        if isinstance(data, dict):  # one conversation record, or a single message
            data = data["messages"] if "messages" in data else [data]
        if not isinstance(data, list):
            raise UserError(f"--messages {path}: give a JSON list of {{role, content}} objects")
        records = [(f"message {k + 1}", m) for k, m in enumerate(data)]
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(f"--messages {path}: line {n}: not JSON ({e.msg})") from None
    messages = []
    for where, m in records:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"--messages {path}: {where}: give an object with string 'role' and 'content'")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in messages):
        raise UserError(f"--messages {path}: no 'user' message to answer")
    return messages


def _is_jsonl(text: str) -> bool:
    """Several JSON objects, one a line (a JSON list or one pretty-printed object parses whole)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) < 2 or not lines[0].lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(lines[0]), dict)
    except json.JSONDecodeError:
        return False


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    if not system:
        return messages
    if messages and messages[0]["role"] == "system":
        raise UserError("--system: the conversation already starts with a system message; give one of them")
    return [{"role": "system", "content": system}, *messages]


class Chat:
    """Runs replies against one history; `reply` streams to `out` unless `quiet` (--json)."""

    def __init__(self, model, tokenizer, spec: ChatSpec, encode, sampling: dict, out=None, quiet: bool = False):
        self.model, self.tokenizer, self.spec, self.encode = model, tokenizer, spec, encode
        self.sampling = sampling  # max_new_tokens, temperature, ..., eos_id (a set), generator
        self.out = out or sys.stdout
        self.quiet = quiet
        self.last_tokens = 0
        self.tokens = 0  # generated in all replies (the stop tokens included)

    def reply(self, history: list[dict]) -> str:
        """Generate the assistant's answer to `history`, append it, return its text."""
        from meshformer.models import generate as gen  # looked up at call time so tests can watch the ids fed

        ids = self.encode(self.spec.render(history))
        stop = self.sampling["eos_id"]
        stream = StreamText(self.tokenizer, strip=True)
        tokens = gen.generate_stream(self.model, ids, **self.sampling)
        start = self.tokens
        try:
            for tok in tokens:
                self.tokens += 1
                if tok not in stop:
                    self._write(stream.push(tok))
        except KeyboardInterrupt:  # Ctrl-C stops this reply; the conversation goes on with what was said
            tokens.close()
        self._write(stream.finish())
        history.append({"role": "assistant", "content": stream.printed})
        self.last_tokens = self.tokens - start
        return stream.printed

    def _write(self, text: str) -> None:
        if text and not self.quiet:
            self.out.write(text)
            self.out.flush()

    def scripted(self, messages: list[dict]) -> list[tuple[str, str, int]]:
        """Answer every user message not already followed by an assistant's; (user text, reply, tokens) each."""
        history: list[dict] = []
        answered = []
        for k, m in enumerate(messages):
            history.append(m)
            followed = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
            if m["role"] == "user" and not followed:
                if answered and not self.quiet:
                    self._write("\n")
                answered.append((m["content"], self.reply(history), self.last_tokens))
                self._write("\n")
        return answered

    def interactive(self, system: str | None, ask=input) -> int:
        """Read user turns until /exit or EOF; returns the number of replies."""
        history = with_system([], system)
        n = 0
        while True:
            try:
                line = ask("> ")
            except (EOFError, KeyboardInterrupt):
                self._write("\n")
                return n
            if line.strip() == EXIT:
                return n
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            self.reply(history)
            self._write("\n\n")
            n += 1
