"""reference/requests.md: each endpoint's request fields, implemented or refused, from the pydantic
request models the routes take and the handlers' refusal tables."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo, PydanticUndefined

from pagedllm.entrypoints.openai import request_fields, responses_input
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestModel
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.router import router
from pagedllm.reference_pages.markdown import cell, code, page, table

# name -> (values accepted besides null, why the rest are refused). The tables are private to the
# handlers' modules; reading them here is what keeps this page from being a second copy.
RefusalTable = dict[str, tuple[tuple[Any, ...], str]]

# Which handler checks which table (request_fields.refuse_unsupported_chat_fields and _completion_fields,
# request_fields.structured_outputs for both, responses_input.refuse_unsupported_fields).
REFUSAL_TABLES: dict[type[BaseModel], RefusalTable] = {
    ChatCompletionRequest: {**request_fields._REFUSED_CHAT_FIELDS, **request_fields._REFUSED_SAMPLING_FIELDS},
    CompletionRequest: {**request_fields._REFUSED_COMPLETION_FIELDS, **request_fields._REFUSED_SAMPLING_FIELDS},
    ResponsesRequest: responses_input._REFUSED_FIELDS,
}
_HEADER = ("field", "type", "default", "status", "notes")
# The protocol's strict aliases, as JSON names the types.
_JSON_TYPES = {"Int": "integer", "StrictInt": "integer", "Number": "number", "Bool": "boolean", "StrictBool": "boolean",
               "str": "string", "int": "integer", "float": "number", "bool": "boolean", "None": "null",
               "dict": "object", "list": "array", "Any": "any"}


def endpoints() -> list[tuple[str, type[BaseModel]]]:
    """(method and path, request model) of every route whose body is a request model, in route order."""
    found = []
    for route in router.routes:
        for param in getattr(getattr(route, "dependant", None), "body_params", ()):
            model = param.field_info.annotation
            if isinstance(model, type) and issubclass(model, RequestModel):
                found.append((f"{'/'.join(sorted(route.methods))} {route.path}", model))
    # The OpenAI endpoints first, then the server's own (/tokenize, /detokenize); route order within each.
    return sorted(found, key=lambda item: " /v1/" not in item[0])


def render(refusal_tables: dict[type[BaseModel], RefusalTable] | None = None) -> str:
    tables = REFUSAL_TABLES if refusal_tables is None else refusal_tables
    body = [
        "Each endpoint's request body. An *implemented* field is served (the handler still answers 400, naming "
        "the field, for a value it cannot serve); a *refused* field is a 400 naming it unless it is null or one "
        "of the values listed as accepted.",
        "",
    ]
    for endpoint, model in endpoints():
        refused = tables.get(model, {})
        body += [f"## `{endpoint}`", "", f"Request model `{model.__name__}` ({model.__module__}).", ""]
        rows = [_row(name, info, model, refused) for name, info in model.model_fields.items()]
        body += [*table(_HEADER, rows), ""]
        unknown = sorted(set(refused) - set(model.model_fields))
        if unknown:  # a table naming a field the model lacks would refuse nothing; say so loudly
            raise ValueError(f"{model.__name__}: refusal table names fields the model lacks: {unknown}")
    return page(
        "Request fields",
        "Generated from the request models in `pagedllm/entrypoints/openai/protocol.py` and "
        "`responses_protocol.py`, as the routes of `router.py` take them, and from the refusal tables of "
        "`request_fields.py` and `responses_input.py`.",
        body,
    )


def _row(name: str, info: FieldInfo, model: type[BaseModel], refused: RefusalTable) -> list[str]:
    notes = [cell(info.description)] if info.description else []
    notes += [cell(text) for text in _constraints(info)]
    if name in refused:
        accepted, reason = refused[name]
        values = ", ".join(code(_json(value)) for value in (None, *accepted))
        status = "refused"
        notes.insert(0, f"Refused: {cell(reason)}. Accepted: {values}.")
    else:
        status = "implemented"
    return [code(info.alias or name), code(_type(name, model)), _default(info), status, " ".join(notes)]


def _type(name: str, model: type[BaseModel]) -> str:
    """The annotation as the source spells it (a string under ``from __future__ import annotations``),
    in JSON's type names."""
    for klass in model.__mro__:
        annotation = getattr(klass, "__annotations__", {}).get(name)
        if annotation is not None:
            text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
            return re.sub(r"\b[A-Za-z_]+\b", lambda m: _JSON_TYPES.get(m.group(0), m.group(0)), text)
    return "any"


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default is PydanticUndefined:
        return code(f"{getattr(info.default_factory, '__name__', 'factory')}()")
    return code(_json(info.default))


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def _constraints(info: FieldInfo) -> list[str]:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = []
    for item in info.metadata:
        for attr, symbol in words.items():
            if getattr(item, attr, None) is not None:
                found.append(f"{symbol} {getattr(item, attr)}")
    return [f"Range: {', '.join(found)}."] if found else []
