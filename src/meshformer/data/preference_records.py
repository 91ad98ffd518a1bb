"""Preference records, whatever tool wrote them, as one shape: a pair {prompt, chosen, rejected} or an unpaired
(KTO) example {prompt, completion, label}, each text either a string (TRL's "standard" records: plain text) or a
list of {"role", "content"} messages (TRL's "conversational" records: rendered with the chat template).

Recognised from the fields (data/preference.py tokenizes what this returns):
  TRL standard        {"prompt": str, "chosen": str, "rejected": str}  (no "prompt": the shared prefix of chosen and
                      rejected is the prompt, trl.data_utils.extract_prompt)
  TRL conversational  {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}  (or full
                      conversations in chosen/rejected with no "prompt": the shared leading turns are the prompt)
  TRL unpaired (KTO)  {"prompt", "completion", "label": bool}, standard or conversational
  LLaMA-Factory alpaca ranking    {"instruction", "input"?, "chosen": str, "rejected": str, "system"?, "history"?}
  LLaMA-Factory sharegpt ranking  {"conversations": [{"from", "value"}, ...], "chosen": {"from": "gpt", "value"},
                                   "rejected": {...}, "system"?}  (the conversation ends on a human turn)
  LLaMA-Factory KTO   alpaca {"instruction", "input"?, "output", "kto_tag": bool} or sharegpt {"conversations"
                      ending on the assistant's turn, "kto_tag": bool}
LLaMA-Factory's records become conversations (its templates are chat templates), so their completions are the
rendered assistant turns.
"""

from __future__ import annotations

from meshformer.data.documents import json_type
from meshformer.data.sft import SHAREGPT_ROLES, _text, to_messages
from meshformer.errors import UserError

KINDS = ("preference", "kto")  # --format values that force the kind (the shape still comes from the fields)
PAIR_FIELDS = ("chosen", "rejected")


def detect_kind(record: dict) -> str | None:
    """ "preference" (pairs), "kto" (unpaired) or None (not preference data: SFT or text decide)."""
    if any(k in record for k in PAIR_FIELDS):
        return "preference"
    if "kto_tag" in record or ("completion" in record and "label" in record):
        return "kto"
    return None


def to_pair(record: dict, where: str) -> dict:
    """{prompt, chosen, rejected}: three strings, or three message lists."""
    missing = [key for key in PAIR_FIELDS if key not in record]
    if missing:
        what = " and ".join(map(repr, missing))
        raise UserError(
            f"{where}: a preference record needs 'chosen' and 'rejected'; {what} missing: give both completions of "
            f"the pair (fields: {sorted(record)[:6]})"
        )
    if "conversations" in record:
        prompt = _sharegpt_prompt(record, where)
        chosen = [_sharegpt_turn(record["chosen"], where, "chosen")]
        rejected = [_sharegpt_turn(record["rejected"], where, "rejected")]
        return _checked({"prompt": prompt, "chosen": chosen, "rejected": rejected}, where)
    if "instruction" in record:
        prompt = to_messages({**record, "output": ""}, "alpaca", where)[:-1]
        chosen = [{"role": "assistant", "content": _text(record["chosen"], where, "'chosen'")}]
        rejected = [{"role": "assistant", "content": _text(record["rejected"], where, "'rejected'")}]
        return _checked({"prompt": prompt, "chosen": chosen, "rejected": rejected}, where)
    chosen, rejected = _trl_value(record["chosen"], where, "chosen"), _trl_value(record["rejected"], where, "rejected")
    if "prompt" not in record:
        return _checked(extract_prompt(chosen, rejected, where), where)
    prompt = _trl_value(record["prompt"], where, "prompt")
    return _checked({"prompt": prompt, "chosen": chosen, "rejected": rejected}, where)


def to_unpaired(record: dict, where: str) -> dict:
    """{prompt, completion, label}: TRL's unpaired records or LLaMA-Factory's kto_tag ones."""
    if "kto_tag" in record:
        label = _label(record["kto_tag"], where, "kto_tag")
        fmt = "sharegpt" if "conversations" in record else "messages" if "messages" in record else "alpaca"
        messages = to_messages(record, fmt, where)
        if not messages or messages[-1]["role"] != "assistant":
            raise UserError(f"{where}: a kto_tag record must end on the assistant's turn, the completion it rates")
        return _checked({"prompt": messages[:-1], "completion": messages[-1:], "label": label}, where)
    for key in ("prompt", "completion", "label"):
        if key not in record:
            raise UserError(
                f"{where}: an unpaired (KTO) record needs 'prompt', 'completion' and 'label' (or LLaMA-Factory's "
                f"'kto_tag'): {key!r} is missing (fields: {sorted(record)[:6]})"
            )
    prompt = _trl_value(record["prompt"], where, "prompt")
    completion = _trl_value(record["completion"], where, "completion")
    return _checked({"prompt": prompt, "completion": completion, "label": _label(record["label"], where)}, where)


def extract_prompt(chosen, rejected, where: str) -> dict:
    """trl.data_utils.extract_prompt: the longest common prefix (characters, or whole turns) of chosen and rejected
    is the prompt; for text a space just before the split goes with the completions."""
    if type(chosen) is not type(rejected):
        raise UserError(f"{where}: 'chosen' and 'rejected' must both be text or both be message lists")
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _label(value, where: str, key: str = "label") -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1) and not isinstance(value, float):
        return bool(value)
    raise UserError(
        f"{where}: {key!r} is a JSON {json_type(value)} {value!r}: give true (desirable) or false (undesirable)"
    )


def _trl_value(value, where: str, key: str):
    """A TRL field: a string, or a list of {"role", "content"} messages (content as data/sft.py reads it)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        out = []
        for k, m in enumerate(value):
            role = m.get("role")
            if role not in ("system", "user", "assistant", "tool"):
                raise UserError(f"{where}: {key}[{k}] has role {role!r}: system, user, assistant or tool")
            out.append({**m, "role": role, "content": _text(m.get("content"), where, f"{key}[{k}].content")})
        return out
    raise UserError(
        f"{where}: {key!r} is a JSON {json_type(value)}: give a string (standard record) or a list of "
        f'{{"role", "content"}} messages (conversational record)'
    )


def _sharegpt_prompt(record: dict, where: str) -> list[dict]:
    messages = to_messages({**record, "chosen": None, "rejected": None}, "sharegpt", where)
    if not messages or messages[-1]["role"] != "user":
        raise UserError(
            f"{where}: a sharegpt ranking record's 'conversations' must end on the human's turn; the answers "
            f"are 'chosen' and 'rejected'"
        )
    return messages


def _sharegpt_turn(value, where: str, key: str) -> dict:
    if not isinstance(value, dict) or "value" not in value:
        raise UserError(f'{where}: {key!r} must be a message object {{"from": "gpt", "value": ...}}')
    role = SHAREGPT_ROLES.get(str(value.get("from", "gpt")), None)
    if role != "assistant":
        raise UserError(f"{where}: {key!r} is from {value.get('from')!r}: the ranked answers are the assistant's")
    return {"role": "assistant", "content": _text(value["value"], where, f"{key}.value")}


def _checked(example: dict, where: str) -> dict:
    """Refuse empty completions and mixed text/messages: one line naming the field and the fix."""
    kinds = {isinstance(v, str) for k, v in example.items() if k != "label"}
    if len(kinds) > 1:
        raise UserError(
            f"{where}: mixes text and message lists across prompt and completions: give all strings (standard) "
            f"or all message lists (conversational)"
        )
    for key in ("chosen", "rejected", "completion"):
        if key in example:
            v = example[key]
            empty = (not v.strip()) if isinstance(v, str) else (not v or not any(m["content"].strip() for m in v))
            if empty:
                raise UserError(f"{where}: {key!r} is empty: every completion needs text to learn from")
    return example
