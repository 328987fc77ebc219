"""A conversation shaped as gpt-oss's own chat template reads it.

The template renders an assistant's thought from ``thinking`` (pyserve's messages carry
``reasoning_content``), renders only the first of a message's ``tool_calls``, names each tool
result after the most recent call, refuses an assistant message with tool calls that has both
content and a thought, and writes every tool's ``description``. So, before rendering:

* ``reasoning_content`` becomes ``thinking``; beside tool calls, content (a preamble) joins the
  thought, the one place the template has for either;
* an assistant message with several calls becomes one message per call (the thought on the
  first), each followed by its result (matched by ``tool_call_id``, else by order), as harmony
  writes a call and its answer;
* a tool without a description gets an empty one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HarmonyPrompt:
    def messages(self, messages: list[dict]) -> list[dict]:
        """The template's messages (as ``ChatMessage.as_template_input`` writes them)."""
        out: list[dict] = []
        i = 0
        while i < len(messages):
            message = messages[i]
            i += 1
            if message.get("role") != "assistant":
                out.append(message)
                continue
            results = []
            while message.get("tool_calls") and i < len(messages):
                if messages[i].get("role") != "tool":
                    break
                results.append(messages[i])
                i += 1
            out += _assistant_turn(message, results)
        return out


def template_tools(tools: list[dict]) -> list[dict]:
    """OpenAI tool definitions with the description the template writes, "" when none."""
    out = []
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("description") is None:
            tool = {**tool, "function": {**function, "description": ""}}
        out.append(tool)
    return out


def _assistant_turn(message: dict, results: list[dict]) -> list[dict]:
    """An assistant message and the tool results after it, in the template's shape."""
    message = dict(message)
    thought = message.pop("reasoning_content", None) or ""
    calls = message.pop("tool_calls", None) or []
    if not calls:
        return [{**message, "thinking": thought} if thought else message]
    content = message.get("content") or ""
    thought = "\n\n".join(t for t in (thought, content) if t)
    pending = list(results)
    ids = {call.get("id") for call in calls}
    out: list[dict] = []
    for n, call in enumerate(calls):
        part = {**message, "content": "", "tool_calls": [call]}
        if n == 0 and thought:
            part["thinking"] = thought
        out.append(part)
        result = _result_of(call, pending, ids)
        if result is not None:
            out.append(result)
    return out + pending  # results that answer no call keep their place after the calls


def _result_of(call: dict, pending: list[dict], ids: set) -> dict | None:
    """The tool result that answers ``call``, taken out of ``pending``: the one with its id,
    else the first whose id is none of the calls' (clients that lose ids keep the order)."""
    for i, result in enumerate(pending):
        if result.get("tool_call_id") == call.get("id"):
            return pending.pop(i)
    for i, result in enumerate(pending):
        if result.get("tool_call_id") not in ids:
            return pending.pop(i)
    return None
