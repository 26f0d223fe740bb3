"""Per chat request: how its replies are read (ChatShape) and what its tools hold decoding to.

The tool-call parser is the server's `--tool-call-parser`, or the one the chat template's
own format needs (tool_parsers.detect_parser); under the generic format, and whenever
tool_choice is `required` or a named function, replies are kvforge's JSON envelope.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvforge.engine.chat_tools import output_constraint, template_supports_tools
from kvforge.engine.sampling_params import SamplingParams
from kvforge.server.chat_output import ChatShape
from kvforge.server.protocol import APIError, GenerationRequest
from kvforge.server.tool_parsers import detect_parser


def chat_shape(req: GenerationRequest, tokenizer: Any, tool_call_parser: str | None,
               reasoning_parser: str | None) -> ChatShape:
    tools = req.tools
    parser = None
    if tools is not None and tools.choice != "none":
        template = tokenizer.chat_template if tokenizer is not None else None
        if tools.constrained or not template_supports_tools(template):
            parser = "envelope"
        else:
            parser = tool_call_parser or detect_parser(template)
            if parser is None:
                raise APIError("tool_choice 'auto' needs a tool-call parser for this model's chat template: start "
                               "the server with --tool-call-parser (hermes, llama3_json, pythonic), or send "
                               "tool_choice 'required' or a named function", param="tool_choice")
    return ChatShape(parser, reasoning_parser, req.include_reasoning)


def with_tool_constraint(req: GenerationRequest, params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with the tools' envelope as its structured output, when the tools constrain decoding."""
    spec = output_constraint(tokenizer, req.tools) if tokenizer is not None else None
    if spec is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(f"'{params.structured_outputs.field}' cannot be combined with tools that constrain the reply "
                       "(tool_choice 'required', a named function, or the generic tool format)",
                       param=params.structured_outputs.field)
    return dataclasses.replace(params, structured_outputs=spec)
