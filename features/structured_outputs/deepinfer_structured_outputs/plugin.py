"""The ``deepinfer_logits_processor`` hook: ``so_args`` matched by xgrammar (JSON schema, regex, EBNF).

The tokenizer's vocabulary is read once per model (``TokenizerInfo``); compiled grammars are cached by their
``so_args``; each request gets its own matcher. JSON-schema keywords xgrammar would silently not enforce are
refused when the request is submitted, naming the keyword and where it is.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch
import xgrammar as xgr

from deepinfer.plugins.hookspecs import hookimpl
from deepinfer_structured_outputs.ebnf import to_xgrammar

# Keywords xgrammar 0.2 compiles but does not enforce, with why: found by probing each with a violating instance
# the matcher accepts (tests/test_structured_outputs.py) and by tools/validation/json_schema_suite.py (the
# JSON-Schema-Test-Suite's schemas, outputs validated with jsonschema)
UNENFORCED = {
    "not": "a negated schema is not matched",
    "if": "conditional schemas (if/then/else) are not matched",
    "then": "conditional schemas (if/then/else) are not matched",
    "else": "conditional schemas (if/then/else) are not matched",
    "oneOf": "oneOf is matched as anyOf: a value matching several options is not refused",
    "allOf": "allOf is not merged with its siblings (additionalProperties, items, ...)",
    "dependentSchemas": "dependent schemas are not matched",
    "dependencies": "draft-7 dependencies are not matched",
    "uniqueItems": "uniqueItems is not always matched (e.g. beside prefixItems)",
    "contains": "contains (and minContains/maxContains) is matched only beside type: array",
    "propertyNames": "property-name schemas other than a pattern are not matched",
    "unevaluatedItems": "unevaluatedItems is not matched",
    "$dynamicRef": "dynamic references are not resolved",
    "$anchor": "anchors are not resolved",
    "$dynamicAnchor": "dynamic anchors are not resolved",
}
# keywords that only annotate: anyOf may sit beside these and nothing else (xgrammar drops its siblings)
_ANNOTATIONS = {"$schema", "$id", "$comment", "$defs", "definitions", "title", "description", "default",
                "examples", "deprecated", "readOnly", "writeOnly", "anyOf"}
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
           "unevaluatedItems", "additionalItems", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


# Deeper schemas are refused rather than walked: the walk (and the grammar compiler after it) recurses per level.
MAX_SCHEMA_DEPTH = 64


def _check_shape(schema: dict, path: str) -> None:
    """A ValueError naming the keyword whose value has the wrong JSON type for the walk below (and for JSON Schema)."""
    for keys, kind, expected in ((_SCHEMA_LISTS, list, "a list of schemas"),
                                 (_SCHEMA_MAPS, dict, "an object of schemas")):
        for key in keys:
            if key in schema and not isinstance(schema[key], kind):
                raise ValueError(f"so_args: {path}/{key} must be {expected}, got {type(schema[key]).__name__}")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ValueError(f"so_args: {path}/required must be a list of property names, got {required!r:.80}")


def unenforced_keywords(schema, path: str = "#", depth: int = 0) -> list[str]:
    """``"path: keyword (why)"`` for every keyword the matcher would not enforce, nested schemas included; a
    ValueError for a schema nested past ``MAX_SCHEMA_DEPTH`` or a keyword of the wrong JSON type."""
    if not isinstance(schema, dict):
        return []
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"so_args: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {path[:80]}...)")
    _check_shape(schema, path)
    found = [f"{path}: {key} ({why})" for key, why in UNENFORCED.items() if key in schema]
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append(f"{path}: $ref {ref!r} (only local JSON pointers, '#/...', are resolved)")
    if "anyOf" in schema and set(schema) - _ANNOTATIONS:
        beside = ", ".join(sorted(set(schema) - _ANNOTATIONS))
        found.append(f"{path}: anyOf beside {beside} (the matcher drops anyOf's siblings)")
    undeclared = set(schema.get("required") or ()) - set(schema.get("properties") or {})
    if undeclared:
        found.append(f"{path}: required {sorted(undeclared)} (required properties must be declared in properties)")
    found += [f"{path}: {key} {schema[key]!r} (write an integer)" for key in _COUNTS
              if isinstance(schema.get(key), float)]
    if schema.get("type") != "object":
        found += [f"{path}: {key} without type: object (not matched then)" for key in ("minProperties",
                  "maxProperties") if key in schema]
    unanchored = [p for p in schema.get("patternProperties") or {} if not (p.startswith("^") and p.endswith("$"))]
    if unanchored:  # JSON Schema searches a key for the pattern; the matcher matches the whole key
        found.append(f"{path}: patternProperties {unanchored} (anchor each pattern with ^...$)")
    if "multipleOf" in schema and not isinstance(schema["multipleOf"], int):
        found.append(f"{path}: multipleOf {schema['multipleOf']!r} (only integer steps are matched)")
    for key in _SCHEMA:
        found += unenforced_keywords(schema.get(key), f"{path}/{key}", depth + 1)
    for key in _SCHEMA_LISTS:
        for i, item in enumerate(schema.get(key) or ()):
            found += unenforced_keywords(item, f"{path}/{key}/{i}", depth + 1)
    for key in _SCHEMA_MAPS:
        for name, item in (schema.get(key) or {}).items():
            found += unenforced_keywords(item, f"{path}/{key}/{name}", depth + 1)
    return found


class XGrammarMatcher:
    """One request's grammar state (the ``GrammarMatcher`` protocol)."""

    def __init__(self, grammar: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(grammar)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XGrammarOutputs:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._compile = lru_cache(maxsize=256)(self._compile_text)

    def validate(self, so_args: dict) -> None:
        self._grammar(so_args)

    def matcher(self, so_args: dict) -> XGrammarMatcher:
        return XGrammarMatcher(self._grammar(so_args))

    def _grammar(self, so_args: dict) -> xgr.CompiledGrammar:
        kind, schema = so_args["schema_type"], so_args["schema"]
        if kind == "json":
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"so_args: the JSON schema is not valid JSON: {exc}") from None
            unenforced = unenforced_keywords(schema)
            if unenforced:
                raise ValueError("so_args: this JSON schema uses keywords the matcher cannot enforce, so outputs "
                                 "could break it: " + "; ".join(unenforced))
            text = json.dumps(schema, sort_keys=True)
        elif kind == "ebnf":
            try:
                text = to_xgrammar(schema)
            except ValueError as exc:
                raise ValueError(f"so_args: {exc}") from None
        else:
            text = schema
        return self._compile(kind, text)

    def _compile_text(self, kind: str, text: str) -> xgr.CompiledGrammar:
        # JSON with the standard separators and no free whitespace ({"a": 1}): a small model otherwise loops on
        # newlines until max_tokens
        compile_ = {"json": lambda text: self._compiler.compile_json_schema(text, any_whitespace=False),
                    "regex": self._compiler.compile_regex,
                    "ebnf": self._compiler.compile_grammar}[kind]
        try:
            return compile_(text)
        except RuntimeError as exc:  # xgrammar reports every parse error so; keep its line/column, drop its prefix
            message = str(exc).strip().split("] ", 1)[-1].split(": ", 1)[-1]
            raise ValueError(f"so_args: the {kind} schema cannot be compiled: {message}") from None


@hookimpl
def deepinfer_logits_processor(config, tokenizer, vocab_size):
    return XGrammarOutputs(tokenizer, vocab_size)
