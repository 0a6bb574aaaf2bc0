"""How the model writes a tool call, for the built-in tool environments (`calculator`, `python`).

Two formats:
- `tags`, documented here and taught by the prompt or a warm start: the call's argument between the
  tool's own tags, `<calculator>12 * 7</calculator>`; the turn ends at the closing tag.
- `json`, the chat template's own where it declares one: Hermes-style JSON between `<tool_call>`
  tags, `<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>`, as the
  Qwen2.5, Qwen3 and Hermes templates describe it. The environment then declares its function
  (`tools`, JSON schemas as `apply_chat_template(tools=...)` takes them), and the episode renders
  every turn with them, so the template writes its own description of the tool into the prompt.

`auto` (the default of a run's built-in tool environment) picks `json` when the tokenizer's chat
template mentions `<tool_call>`, else `tags`: SmolLM2's and Gemma 3's templates have no tool format.
A call the model botched (unpaired tags, bad JSON, another function's name, a missing argument) is
answered with an error message the model can read; it is not an environment error.
"""

from __future__ import annotations

import dataclasses
import json

from grpo_jax.rewards.format import tag_blocks
from grpo_jax.env.protocol import EnvStep, opening_messages

TOOL_FORMATS = ("auto", "tags", "json")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def template_tool_format(tokenizer) -> str:
    """`json` when the tokenizer's chat template declares Hermes-style tool calls, else `tags`."""
    return "json" if CALL_OPEN in (getattr(tokenizer, "chat_template", None) or "") else "tags"


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot be run (the message is the tool's answer)."""


def _json(text: str, what: str):
    """`text` parsed as JSON, or ToolCallError saying why not: malformed JSON, brackets nested past
    the parser's recursion limit (RecursionError) or an integer of more than 4,300 digits (Python's
    limit on converting one: a ValueError that is not a JSONDecodeError). The model wrote it; any
    text it writes is the episode's tool error, never an exception that leaves the episode."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not JSON ({e.msg})") from None
    except RecursionError:
        raise ToolCallError(f"{what} nests brackets too deeply") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ToolCallError(f"{what} is not usable JSON ({str(e).split(';')[0]})") from None


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One tool: its `name` (the tag, or the function's name), the single string `argument` its
    function takes, what it does, and the call format (`tags` or `json`)."""

    name: str
    argument: str
    description: str
    tool_format: str = "tags"

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"a tool's name must be a plain name, got {self.name!r}")
        if self.tool_format not in TOOL_FORMATS[1:]:
            raise ValueError(f"tool_format must be one of {list(TOOL_FORMATS)} ('auto' is resolved by the run from "
                             f"the tokenizer's chat template), got {self.tool_format!r}")

    @property
    def tool_call_end(self) -> str:
        return CALL_CLOSE if self.tool_format == "json" else f"</{self.name}>"

    @property
    def schemas(self) -> list[dict] | None:
        """The function's JSON schema for the chat template (json format), else None."""
        if self.tool_format != "json":
            return None
        parameters = {"type": "object", "properties": {self.argument: {"type": "string"}},
                      "required": [self.argument]}
        return [{"type": "function",
                 "function": {"name": self.name, "description": self.description, "parameters": parameters}}]

    def argument_of(self, completion: str) -> str | None:
        """The argument of the turn's last tool call; None when the turn has no call (the final
        answer); ToolCallError for a call that cannot be run."""
        if self.tool_format == "tags":
            blocks = tag_blocks(completion, self.name)
            return blocks[-1][2] if blocks else None
        start = completion.rfind(CALL_OPEN)
        if start < 0:
            return None
        end = completion.find(CALL_CLOSE, start)
        body = completion[start + len(CALL_OPEN):end if end >= 0 else len(completion)]
        call = _json(body, "the tool call")
        if not isinstance(call, dict) or call.get("name") != self.name:
            name = call.get("name") if isinstance(call, dict) else None
            shown = repr(name)[:100] if name is None or isinstance(name, str) else f"a JSON {type(name).__name__}"
            raise ToolCallError(f"unknown tool {shown}; the tool is {self.name!r}")
        arguments = call.get("arguments")
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = _json(arguments, "the arguments")
            except ToolCallError:
                pass  # answered below: what the arguments must be
        if not isinstance(arguments, dict) or not isinstance(arguments.get(self.argument), str):
            raise ToolCallError(f"{self.name} takes {{\"{self.argument}\": <string>}} as its arguments")
        return arguments[self.argument]


class ToolEnvironment:
    """A built-in environment with one tool. A model turn with a call gets the tool's answer (role
    "tool": `run(argument)`, or the error of a botched call); a turn without one is the final
    answer, which the run's `rewards` score. Subclasses set the tool's `argument` name and
    `description`, and `run`. `tool_call_end` ends a model turn like a stop token; `tools` (json
    format) is the function's schema, which the chat template describes in the prompt."""

    argument = ""
    description = ""

    def __init__(self, tag: str, tool_format: str = "tags", *, who: str):
        if not tag.isidentifier():
            raise ValueError(f"{who}: tag must be a plain name, got {tag!r}")
        self.tag = tag
        self.tool = ToolSpec(tag, self.argument, self.description, tool_format)
        self.tool_call_end, self.tools = self.tool.tool_call_end, self.tool.schemas

    def reset(self, example: dict) -> list[dict]:
        return opening_messages(example)

    def step(self, completion: str) -> EnvStep:
        try:
            argument = self.tool.argument_of(completion)
        except ToolCallError as e:
            return EnvStep(messages=[{"role": "tool", "content": f"error: {e}"}])
        if argument is None:
            return EnvStep(messages=[], done=True)  # no tool call: the final answer
        return EnvStep(messages=[{"role": "tool", "content": self.run(argument)}])

    def run(self, argument: str) -> str:
        raise NotImplementedError
