"""The request fields that constrain output to a format, mapped to one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` object and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras. At most one may be given.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputFields(BaseModel):
    """Mixed into both endpoints' request bodies."""

    model_config = ConfigDict(extra="allow", strict=True)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint asked for, and the field that asked (for error messages); 400 for two at once or a bad
        value."""
        given: list[tuple[str, dict]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise OpenAIError(400, 'response_format of type "json_schema" needs a json_schema object',
                                  param="response_format")
            schema = fmt.json_schema.json_schema
            given.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        for name, kind in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                given.append((name, {kind: value}))
        if not given:
            return None, None
        if len(given) > 1:
            raise OpenAIError(400, f"give one output constraint, not several: {', '.join(n for n, _ in given)}",
                              param=given[1][0])
        field, spec = given[0]
        try:
            return StructuredOutputsParams.from_dict(spec), field
        except InvalidRequestError as exc:
            raise OpenAIError(400, f"{field}: {exc}", param=field) from None
