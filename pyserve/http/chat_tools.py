"""What a chat request's tools, tool_choice, response_format and reasoning ask of generation.

``ChatPlan.of`` reads the request (before its prompt is rendered): the tools the template is
given (or, in the generic format, the messages that describe them), the grammar that enforces
``tool_choice`` or ``response_format``, and how the output is parsed back.
``ChatPlan.for_prompt`` then fits the grammar to a reasoning model's thought once the rendered
prompt shows whether the template opened it. A harmony model (gpt-oss) has a plan of its own:
its channels carry thought and calls, its grammars write its headers, its turn ends stop it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import msgspec

from pyserve.chat import generic_tools, harmony_grammar
from pyserve.chat.generic_tools import GenericPrompt
from pyserve.chat.harmony import HarmonyFormat
from pyserve.chat.harmony_prompt import HarmonyPrompt, template_tools
from pyserve.chat.output import ChatOutput
from pyserve.chat.policy import ChatPolicy
from pyserve.chat.reasoning import ReasoningParser
from pyserve.chat.tool_calls import GenericToolParser, ToolCallParser
from pyserve.chat.tool_grammar import tool_calls_lark, tool_calls_or_json_lark
from pyserve.grammars import after_thought
from pyserve.http import params
from pyserve.http.errors import bad_request
from pyserve.http.generation import ChatSpec
from pyserve.http.protocol import NamedToolChoice, TextFormat
from pyserve.wire.main_to_worker import Grammar

HARMONY_EFFORTS = ("low", "medium", "high")  # the reasoning efforts gpt-oss was trained on


class MessageRewrite(Protocol):
    def messages(self, messages: list[dict]) -> list[dict]: ...


@dataclass(frozen=True)
class ChatPlan:
    template_tools: list[dict] | None  # what the chat template renders; None: no tools
    grammar: Grammar | None
    grammar_param: str  # the request field the grammar comes from, for errors
    output: ChatOutput | None  # how the output is parsed; None: all of it is the content
    keep_special_tokens: bool  # a marker is a special token: the parser must see it
    # How the messages are rewritten for the template: the generic format's (a template that
    # renders no tools), harmony's (gpt-oss's template and its fields).
    rewrite: MessageRewrite | None = None
    stop_token_ids: tuple[int, ...] = ()  # beside the model's EOS: what ends the turn

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """The messages the chat template renders (``ChatMessage.as_template_input`` dicts)."""
        if self.rewrite is None:
            return messages
        return self.rewrite.messages(messages)

    @classmethod
    def of(
        cls,
        req: ChatSpec,
        grammar: Grammar | None,
        param: str,
        policy: ChatPolicy,
        loose: Collection[str] = (),
    ) -> ChatPlan:
        """The plan of a conversation whose answer ``grammar`` (from the request field
        ``param``) constrains, under the served model's chat policy. ``loose``: the tools whose
        parameters schema the grammar engine cannot enforce; a forced call of one is held to a
        JSON object of arguments."""
        tools = req.tools or []
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if choice != "none" and not tools:
            if req.tool_choice is not None:
                raise bad_request("tool_choice needs tools", param="tool_choice")
            choice = "none"
        if policy.harmony:
            return _harmony_plan(req, choice, grammar, param, policy, loose)
        parser: ToolCallParser | None = None
        if choice != "none":
            parser = policy.tool_call_parser
            if parser is None:
                raise params.unsupported(
                    "tools", "this server reads no tool calls (--tool-call-parser none)"
                )
            if isinstance(parser, GenericToolParser) and grammar is not None:
                parser = GenericToolParser(replies=False)  # the answer is the format's JSON
            grammar, param = _tool_grammar(
                req, parser, choice, grammar, param, policy.added_tokens, loose
            )
        keep_special = parser is not None and any(
            special in marker
            for special in policy.special_tokens
            for marker in dataclasses.astuple(parser.call_format)
            if special
        )
        reasoning = policy.reasoning_parser
        output = None
        if parser is not None or reasoning is not None:
            output = ChatOutput(tools=parser, reasoning=reasoning)
        template_tools = None
        if choice != "none":
            template_tools = [msgspec.to_builtins(tool) for tool in tools]
        generic = None
        if isinstance(policy.tool_call_parser, GenericToolParser):
            # The template renders no tools: they go into the system message, and earlier calls
            # and results are rewritten whether or not tools are offered this time.
            generic = GenericPrompt(_generic_instructions(req, choice, template_tools))
            template_tools = None
        return cls(template_tools, grammar, param, output, keep_special, rewrite=generic)

    def for_prompt(self, prompt_ids: list[int], policy: ChatPolicy) -> ChatPlan:
        """The plan for this rendered prompt: a reasoning model thinks before the grammar."""
        parser = policy.reasoning_parser
        if parser is None:
            return self
        opened = policy.prompt_opens_thought(prompt_ids, parser)
        reasoning = ReasoningParser(
            parser.start, parser.end, opened, strip_newlines=parser.strip_newlines
        )
        assert self.output is not None
        output = ChatOutput(tools=self.output.tools, reasoning=reasoning)
        grammar = self.grammar
        if grammar is not None:
            try:
                grammar = after_thought(
                    grammar,
                    parser.start,
                    parser.end,
                    opened=opened,
                    added_tokens=policy.added_tokens,
                )
            except ValueError as exc:
                raise params.unsupported(self.grammar_param, str(exc)) from None
        return dataclasses.replace(self, grammar=grammar, output=output)


def _tool_grammar(
    req: ChatSpec,
    parser: ToolCallParser,
    choice: str | NamedToolChoice,
    grammar: Grammar | None,
    param: str,
    added_tokens: dict[str, int],
    loose: Collection[str] = (),
) -> tuple[Grammar | None, str]:
    """The grammar that enforces ``tool_choice`` (with ``response_format``'s, if any);
    ``grammar`` came from the request field ``param``."""
    _check_beside_tools(req, grammar, param)
    if isinstance(choice, NamedToolChoice):
        lark = tool_calls_lark(
            parser.call_format,
            _schemas(req, loose, choice),
            parallel=False,
            added_tokens=added_tokens,
        )
        return Grammar("lark", lark), "tool_choice"
    parallel = req.parallel_tool_calls is not False
    lark = tool_calls_lark(
        parser.call_format,
        _schemas(req, loose),
        parallel=parallel,
        added_tokens=added_tokens,
    )
    if choice == "required":  # the answer is calls: a response_format has no text to apply to
        return Grammar("lark", lark), "tool_choice"
    # auto: free text, unless the answer must follow a response format or the format has
    # an object of its own for a reply
    if grammar is None:
        if isinstance(parser, GenericToolParser):
            reply = tool_calls_or_json_lark(lark, generic_tools.REPLY_SCHEMA)
            return Grammar("lark", reply), "tool_choice"
        return None, "grammar"
    schema = msgspec.json.decode(grammar.text) if grammar.kind == "json_schema" else None
    return Grammar("lark", tool_calls_or_json_lark(lark, schema)), param


def _check_beside_tools(req: ChatSpec, grammar: Grammar | None, param: str) -> None:
    """Tools allow a response format's grammar, and no other."""
    answer_format = req.response_format is not None and not isinstance(
        req.response_format, TextFormat
    )
    if grammar is not None and not answer_format:
        raise bad_request(
            "json_schema, regex and ebnf constrain a text answer and cannot be combined with "
            "tools: use response_format",
            param=param,
        )


def _schemas(
    req: ChatSpec, loose: Collection[str], named: NamedToolChoice | None = None
) -> list[tuple[str, dict | None]]:
    """(name, parameters schema) of the tools a grammar may call: all, or the ``named`` one
    (a 400 if it is not among them); None for a tool held to any object (``loose``)."""
    functions = [tool.function for tool in req.tools or []]
    if named is not None:
        functions = [f for f in functions if f.name == named.function.name]
        if not functions:
            raise bad_request(
                f"tool_choice names {named.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
    return [(f.name, None if f.name in loose else f.parameters) for f in functions]


def _harmony_plan(
    req: ChatSpec,
    choice: str | NamedToolChoice,
    grammar: Grammar | None,
    param: str,
    policy: ChatPolicy,
    loose: Collection[str],
) -> ChatPlan:
    """The plan of a harmony model (gpt-oss): the reader sees the special tokens, the turn's
    ends stop generation, and a forced call or an answer format is held by harmony's grammars
    (a call after an optional thought; the format's text in the final message)."""
    effort = req.template_kwargs.get("reasoning_effort")
    if effort is not None and effort not in HARMONY_EFFORTS:
        raise params.unsupported(
            "reasoning_effort", f"this model takes {', '.join(HARMONY_EFFORTS)}; got {effort!r}"
        )
    calls = choice != "none"
    tokens = policy.added_tokens
    tools = None
    if calls:
        if not policy.harmony_calls:
            raise params.unsupported(
                "tools", "this server reads no tool calls (--tool-call-parser none)"
            )
        _check_beside_tools(req, grammar, param)
        named = choice if isinstance(choice, NamedToolChoice) else None
        schemas = _schemas(req, loose, named)
        if named is not None or choice == "required":
            lark = harmony_grammar.calls_lark(schemas, tokens)
            grammar, param = Grammar("lark", lark), "tool_choice"
        elif grammar is not None:
            schema = msgspec.json.decode(grammar.text) if grammar.kind == "json_schema" else None
            lark = harmony_grammar.calls_lark(schemas, tokens, answer=True, answer_schema=schema)
            grammar = Grammar("lark", lark)
        tools = template_tools([msgspec.to_builtins(tool) for tool in req.tools or []])
    elif grammar is not None:
        try:
            grammar = harmony_grammar.answer_after_thought(grammar, tokens)
        except ValueError as exc:
            raise params.unsupported(param, str(exc)) from None
    return ChatPlan(
        tools,
        grammar,
        param,
        ChatOutput(harmony=HarmonyFormat(calls=calls)),
        keep_special_tokens=True,
        rewrite=HarmonyPrompt(),
        stop_token_ids=tuple(policy.turn_end_ids),
    )


def _generic_instructions(
    req: ChatSpec, choice: str | NamedToolChoice, tools: list[dict] | None
) -> str | None:
    """The generic format's system text for this request; None when it offers no tools."""
    if choice == "none" or not tools:
        return None
    return generic_tools.instructions(
        tools,
        named=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        required=choice == "required",
        parallel=req.parallel_tool_calls is not False,
        json_answer=req.response_format is not None
        and not isinstance(req.response_format, TextFormat),
    )
