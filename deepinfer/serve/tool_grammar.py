"""The EBNF that forces a DSML tool-call block (``tool_choice: "required"`` or a named function): the block the
DeepSeek-V4 encoding writes (``chat_encoding._dsml``) and ``tool_calls.parse_tool_calls`` reads, with each allowed
tool's name and parameters, each value matching its property's JSON schema. The structured-outputs plugin enforces
it (``so_args`` of ``schema_type`` ebnf), so the answer is always a call the parser returns as ``tool_calls``.

A string property (``type: string``, or an ``enum`` or ``const`` of strings) is written as the model was trained
to (``string="true"``, the text as is, here without ``</`` inside it, which would close the tag); any other value
as JSON (``string="false"``). Parameters come in the order
the schema declares them, the required ones always. The JSON-schema keywords enforced are ``SCHEMA_KEYWORDS``; a
schema with any other (``minimum``, ``pattern``, ``$ref``, ...) is refused with a ``ToolSchemaError`` naming it
and where it is, rather than forcing calls that might break it.
"""

from __future__ import annotations

import json

from deepinfer.chat_encoding import (DSML, END_THINK, INVOKE_END_TAG, PARAMETER_END_TAG, TOOL_CALLS_CLOSE,
                                      TOOL_CALLS_OPEN)

# what a value's grammar follows; annotations (title, description, ...) only describe
_ENFORCED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "anyOf"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "deprecated", "readOnly",
                "writeOnly"}
SCHEMA_KEYWORDS = tuple(sorted(_ENFORCED | _ANNOTATIONS))
_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")

# JSON as the model writes it in a string="false" value: the encoder's json.dumps separators, no free whitespace
_JSON_RULES = r'''
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" (json_string ": " json_value (", " json_string ": " json_value)*)? "}"
json_array ::= "[" (json_value (", " json_value)*)? "]"
json_string ::= "\"" json_char* "\""
json_char ::= [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])
json_integer ::= "-"? ("0" | [1-9] [0-9]*)
json_number ::= json_integer ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
raw_text ::= ([^<] | "<" [^/])*
'''


class ToolSchemaError(ValueError):
    """A tool's parameters schema no grammar here can force; ``where`` is the field's path in the request."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where = where




def forced_call_grammar(tools: list[dict], name: str | None, thinking: bool) -> str:
    """EBNF for an answer that is one DSML block of calls to ``tools`` (one or more calls), or, with ``name``, of
    exactly one call to that tool. ``thinking``: the block follows the reasoning and its ``</think>``."""
    grammar = _Grammar()
    chosen = [(i, t) for i, t in enumerate(tools) if name is None or t["function"]["name"] == name]
    invokes = [grammar.invoke(tool["function"], f"tools[{i}].function.parameters") for i, tool in chosen]
    grammar.add("invoke", " | ".join(invokes))
    calls = "invoke" if name is not None else 'invoke ("\\n" invoke)*'
    block = f"{_literal(TOOL_CALLS_OPEN)} {calls} {_literal(TOOL_CALLS_CLOSE)}"
    # reasoning holds no "</": the first one it meets is </think>'s
    grammar.add("root", f"raw_text {_literal(END_THINK)} {block}" if thinking else block)
    return grammar.text()


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _Grammar:
    def __init__(self):
        self.rules: list[str] = []
        self.count = 0

    def add(self, name: str, body: str) -> str:
        self.rules.append(f"{name} ::= {body}")
        return name

    def fresh(self, kind: str) -> str:
        self.count += 1
        return f"{kind}_{self.count}"

    def text(self) -> str:
        return "\n".join(self.rules) + _JSON_RULES

    def invoke(self, function: dict, where: str) -> str:
        schema = function.get("parameters") or {"type": "object"}
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ToolSchemaError(where, 'must be a JSON schema of "type": "object"')
        _check_keywords(schema, where)
        lines = [(self._parameter(key, sub, f"{where}.properties.{key}"), required)
                 for key, sub, required in _members(schema, where)]
        # each parameter line ends with its own newline, so an absent optional one leaves nothing behind; a tool
        # without parameters gets the encoder's empty line
        parameters = " ".join(line if required else f"({line})?" for line, required in lines) or '"\\n"'
        head = _literal(f'<{DSML}invoke name="{function["name"]}">\n')
        return self.add(self.fresh("invoke"), f"{head} {parameters} {_literal(INVOKE_END_TAG)}")

    def _parameter(self, key: str, schema: object, where: str) -> str:
        """One ``<parameter>`` line: a plain string as is, anything else as JSON."""
        if '"' in key or "<" in key:
            raise ToolSchemaError(where, "this parameter name cannot be written in a DSML tag")
        strings = _string_choices(schema)
        if strings is not None:
            _check_keywords(schema, where)
            value = f"({' | '.join(_literal(s) for s in strings)})" if strings else "raw_text"
            opening = f'<{DSML}parameter name="{key}" string="true">'
        else:
            opening, value = f'<{DSML}parameter name="{key}" string="false">', self.value(schema, where)
        closing = _literal(PARAMETER_END_TAG + "\n")  # the encoder breaks the line after each parameter
        return f"{_literal(opening)} {value} {closing}"

    def value(self, schema: object, where: str) -> str:
        """A rule for the JSON values ``schema`` allows."""
        if schema is True or schema == {}:
            return "json_value"
        if not isinstance(schema, dict):
            raise ToolSchemaError(where, f"must be a JSON schema (an object), got {schema!r:.60}")
        _check_keywords(schema, where)
        rule = self.fresh("value")
        return self.add(rule, self._value_body(schema, where))

    def _value_body(self, schema: dict, where: str) -> str:
        if "const" in schema:
            return _literal(json.dumps(schema["const"], ensure_ascii=False))
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ToolSchemaError(f"{where}.enum", "must be a non-empty list")
            return " | ".join(_literal(json.dumps(v, ensure_ascii=False)) for v in schema["enum"])
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options or set(schema) - _ANNOTATIONS - {"anyOf"}:
                raise ToolSchemaError(f"{where}.anyOf", "must be a non-empty list of schemas, alone in its schema")
            return " | ".join(self.value(option, f"{where}.anyOf[{k}]") for k, option in enumerate(options))
        kinds = schema.get("type", list(_TYPES))
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds or not set(kinds) <= set(_TYPES):
            raise ToolSchemaError(f"{where}.type", f"must be one of {', '.join(_TYPES)} or a list of them")
        return " | ".join(self._typed(kind, schema, where) for kind in kinds)

    def _typed(self, kind: str, schema: dict, where: str) -> str:
        if kind == "object":
            if schema.get("properties"):  # only declared members are written: whatever additionalProperties says
                return self._object(schema, where)
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return '"{" "}"'
            if extra not in (True, {}):
                raise ToolSchemaError(f"{where}.additionalProperties", "a schema for the members of an object without "
                                      "properties cannot be enforced when tool_choice forces a call")
            return "json_object"
        if kind == "array":
            items = self.value(schema.get("items", True), f"{where}.items")
            return f'"[" ({items} (", " {items})*)? "]"'
        return {"string": "json_string", "integer": "json_integer", "number": "json_number",
                "boolean": '"true" | "false"', "null": '"null"'}[kind]

    def _object(self, schema: dict, where: str) -> str:
        """The declared members in order with ", " between those written: one rule per (member, whether one was
        written before it), so optional members need no lookahead."""
        members = [(_literal(json.dumps(key, ensure_ascii=False) + ": ") + " "
                    + self.value(sub, f"{where}.properties.{key}"), required)
                   for key, sub, required in _members(schema, where)]
        names = {}

        def rest(i: int, after_one: bool) -> str:  # the members from i on
            if i == len(members):
                return '""'
            if (i, after_one) not in names:
                member, required = members[i]
                comma = '", " ' if after_one else ""
                written = f"{comma}{member} {rest(i + 1, True)}"
                body = written if required else f"({written}) | {rest(i + 1, after_one)}"
                names[(i, after_one)] = self.add(self.fresh("members"), body)
            return names[(i, after_one)]

        return f'"{{" {rest(0, False)} "}}"'


def _string_choices(schema: object) -> list[str] | None:
    """The strings a parameter may be, written as is (``string="true"``): [] for any string (``type: string``), the
    values of an ``enum`` or ``const`` of strings only; None where the value is JSON (``string="false"``)."""
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is None:
        return [] if schema.get("type") == "string" else None
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return None if any("</" in v for v in values) or schema.get("type", "string") != "string" else values


def _members(schema: dict, where: str) -> list[tuple[str, object, bool]]:
    """(name, schema, required) of the declared properties, in their order."""
    properties = schema.get("properties") or {}
    if not isinstance(properties, dict):
        raise ToolSchemaError(f"{where}.properties", "must be an object of schemas")
    required = schema.get("required") or []
    undeclared = sorted(set(required) - set(properties))
    if undeclared:
        raise ToolSchemaError(f"{where}.required", f"{undeclared} are not declared in properties")
    return [(key, sub, key in required) for key, sub in properties.items()]


def _check_keywords(schema: dict, where: str) -> None:
    unknown = sorted(set(schema) - _ENFORCED - _ANNOTATIONS)
    if unknown:
        raise ToolSchemaError(where, f"{', '.join(unknown)} cannot be enforced when tool_choice forces a call (the "
                                     f"grammar follows only {', '.join(SCHEMA_KEYWORDS)})")
