"""User EBNF, parsed with lark and written out in xgrammar's dialect.

Accepted (README, "Structured outputs"): rules ``name ::= ...``, ``name = ...`` or ``name : ...``, each optionally
ended by ``;``; alternatives ``|``; grouping ``( )``; ``{ ... }`` for zero or more; the suffixes ``*``, ``+``, ``?``
and ``{m}``, ``{m,}``, ``{m,n}``; literals in double or single quotes (backslash escapes); character classes
``[a-z]``, ``[^"\\\\]``; comments ``# ...`` and ``(* ... *)``. The rule named ``root`` starts the grammar, or else
the first rule. A syntax error is reported with its line and column; so are references to undefined rules and
rules defined twice.
"""

from __future__ import annotations

import lark

_META = r"""
start: rule+
rule: RULE_HEAD _expansions ";"?
_expansions: alternative ("|" alternative)*
alternative: item+
item: atom QUANTIFIER?
?atom: NAME -> reference
     | STRING -> literal
     | CHAR_CLASS -> char_class
     | "(" _expansions ")" -> group
     | "{" _expansions "}" -> repeat

RULE_HEAD.2: /[A-Za-z_][A-Za-z0-9_-]*[ \t]*(::=|=|:)/
NAME: /[A-Za-z_][A-Za-z0-9_-]*/
STRING: /"(\\.|[^"\\\n])*"/ | /'(\\.|[^'\\\n])*'/
CHAR_CLASS: /\[(\\.|[^\]\\\n])+\]/
QUANTIFIER.2: /[*+?]/ | /\{[ \t]*\d+[ \t]*(,[ \t]*\d*[ \t]*)?\}/
COMMENT: /#[^\n]*/ | /\(\*(.|\n)*?\*\)/

%import common.WS
%ignore WS
%ignore COMMENT
"""

_PARSER = lark.Lark(_META, parser="lalr", propagate_positions=True)
# lark's terminal names, as a user writes them
_SYMBOLS = {"LPAR": "'('", "RPAR": "')'", "LBRACE": "'{'", "RBRACE": "'}'", "VBAR": "'|'", "SEMICOLON": "';'",
            "STRING": "a quoted literal", "NAME": "a rule name", "CHAR_CLASS": "a character class",
            "QUANTIFIER": "a quantifier (*, +, ?, {m,n})", "RULE_HEAD": "a new rule ('name ::=')"}


def _literal(token: str) -> str:
    """A quoted literal in xgrammar's form: double quotes; a single-quoted one is re-quoted."""
    if token[0] == '"':
        return token
    body, out, i = token[1:-1], [], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            out.append(body[i:i + 2] if body[i + 1] != "'" else "'")
            i += 2
            continue
        out.append('\\"' if body[i] == '"' else body[i])
        i += 1
    return '"' + "".join(out) + '"'


class _Writer:
    def __init__(self):
        self.defined: dict[str, int] = {}  # rule name -> line
        self.references: list[lark.Token] = []

    def rule(self, tree: lark.Tree) -> tuple[str, str]:
        head, *alternatives = tree.children
        name = head.rstrip(":=").strip()
        if name in self.defined:
            raise ValueError(f"EBNF: rule {name!r} is defined twice (lines {self.defined[name]} and {head.line})")
        self.defined[name] = head.line
        return name, self.alternatives(alternatives)

    def alternatives(self, alternatives: list[lark.Tree]) -> str:
        return " | ".join(" ".join(self.item(item) for item in alternative.children) for alternative in alternatives)

    def item(self, item: lark.Tree) -> str:
        atom, *quantifier = item.children
        return self.atom(atom) + "".join(quantifier)

    def atom(self, atom: lark.Tree) -> str:
        if atom.data == "reference":
            self.references.append(atom.children[0])
            return str(atom.children[0])
        if atom.data == "literal":
            return _literal(atom.children[0])
        if atom.data == "char_class":
            return str(atom.children[0])
        inner = self.alternatives(atom.children)
        return f"({inner})" + ("*" if atom.data == "repeat" else "")


def to_xgrammar(text: str) -> str:
    """``text`` in xgrammar's EBNF dialect; ``ValueError`` naming the line and column of what is wrong."""
    try:
        tree = _PARSER.parse(text)
    except lark.exceptions.UnexpectedInput as exc:
        expected = sorted({_SYMBOLS.get(name, name) for name in
                           getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ()})
        hint = f"; expected {' or '.join(expected)}" if expected else ""
        near = getattr(exc, "token", None) or getattr(exc, "char", None)
        if near is None or getattr(near, "type", "") == "$END":
            raise ValueError(f"EBNF syntax error: the grammar ends too early{hint}") from None
        raise ValueError(f"EBNF syntax error at line {exc.line}, column {exc.column}, at {str(near)!r}{hint}") from None
    writer = _Writer()
    rules = [writer.rule(rule) for rule in tree.children]
    for reference in writer.references:
        if reference not in writer.defined:
            raise ValueError(f"EBNF: rule {str(reference)!r} (line {reference.line}, column {reference.column}) "
                             "is not defined")
    lines = [f"{name} ::= {body}" for name, body in rules]
    if "root" not in writer.defined:
        lines.insert(0, f"root ::= {rules[0][0]}")
    return "\n".join(lines)
