"""Structured outputs with regexes and EBNF grammars (the regex and EBNF suites).

Each regex and grammar below is generated from by the embedded model, greedy and sampled, from several prompts;
every finished output must match its regex in full (Python's ``re``) or parse with the same grammar written for
lark. Prints a JSON report::

    python tools/validation/grammar_suite.py
"""

from __future__ import annotations

import collections
import json
import re

import lark

REGEXES = [
    r"[a-z]+", r"[A-Z][a-z]{2,9}", r"\d+", r"-?\d{1,6}", r"-?\d+\.\d{1,4}", r"[0-9a-f]{8}", r"#[0-9A-Fa-f]{6}",
    r"(yes|no|maybe)", r"(true|false)", r"[a-z_][a-z0-9_]{0,15}", r"\d{4}-\d{2}-\d{2}", r"\d{2}:\d{2}(:\d{2})?",
    r"[a-z]{2,8}@[a-z]{2,8}\.(com|org|net)", r"(\d{1,3}\.){3}\d{1,3}", r"\+?\d{1,3} \d{3} \d{4}",
    r"[A-Z]{3}-\d{3}", r"v\d+\.\d+\.\d+", r"(foo|bar|baz)(, (foo|bar|baz))*", r"\[\d+(, \d+)*\]",
    r"[a-z]+( [a-z]+){1,4}\.", r"def [a-z_]+\([a-z, ]*\):", r"https?://[a-z]+\.[a-z]{2,3}(/[a-z]+)*",
    r"(ab|cd)+", r"a{3}b{2,4}c?", r"[^\s\"]{1,12}", r"\"[a-z ]{0,10}\"", r"(0|[1-9]\d*)", r"[01]{4,16}",
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)day?", r"\w+=\w+(&\w+=\w+)*",
]

# (EBNF as a user writes it, the same language for lark)
GRAMMARS = [
    ('root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9] [0-9]?',
     'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[1-9][0-9]?/'),
    ('root ::= "yes" | "no"', 'start: "yes" | "no"'),
    ('root ::= item ("," item)*\nitem ::= [a-z]+', 'start: ITEM ("," ITEM)*\nITEM: /[a-z]+/'),
    ('root ::= "[" (num ("," num)*)? "]"\nnum ::= "-"? [0-9]+', 'start: "[" (NUM ("," NUM)*)? "]"\nNUM: /-?[0-9]+/'),
    ('root ::= key "=" value (";" key "=" value)*\nkey ::= [a-z]+\nvalue ::= [0-9]+ | "\\"" [a-z]* "\\""',
     'start: KEY "=" value (";" KEY "=" value)*\nKEY: /[a-z]+/\nvalue: NUM | STR\nNUM: /[0-9]+/\nSTR: /"[a-z]*"/'),
    ('root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]*',
     'start: GREETING " " NAME "!"\nGREETING: "hello" | "hi"\nNAME: /[A-Z][a-z]*/'),
    ('root ::= "<" tag ">" [a-z ]* "</" tag ">"\ntag ::= "b" | "i" | "em"',
     'start: "<" TAG ">" TEXT? "</" TAG ">"\nTAG: "b" | "i" | "em"\nTEXT: /[a-z ]+/'),
    ('root ::= stmt+\nstmt ::= [a-z] "=" [0-9] "\\n"', 'start: STMT+\nSTMT: /[a-z]=[0-9]\\n/'),
    # the other accepted forms, converted (ISO-style rules and braces, lark-style colons, single quotes, comments)
    ("(* numbers *)\nlist = '[' num { ',' num } ']' ;\nnum = [1-9] [0-9]? ;",
     'start: "[" NUM ("," NUM)* "]"\nNUM: /[1-9][0-9]?/'),
    ("call: name '(' args? ')'  # no root rule: the first one\nargs: name {', ' name}\nname: [a-z]{1,6}",
     'start: NAME "(" args? ")"\nargs: NAME (", " NAME)*\nNAME: /[a-z]{1,6}/'),
    ("pair = key ':' ' '? value ;\nkey = [a-z]+ ;\nvalue = 'true' | 'false' | [0-9]{1,3} ;",
     'start: KEY ":" " "? VALUE\nKEY: /[a-z]+/\nVALUE: "true" | "false" | /[0-9]{1,3}/'),
]
PROMPTS = ["def fibonacci(n):", "import os\n", '"""Return the', "Answer: "]


def main() -> None:
    from deepinfer import LLM, SamplingParams

    llm = LLM("deepinfer-tiny-v4.1", dtype="float32", max_num_seqs=64)
    cases = [("regex", r, r) for r in REGEXES] + [("ebnf", g, lark.Lark(lk)) for g, lk in GRAMMARS]
    report, failures = collections.Counter(), []
    for name, sampling in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=0.9, seq_seed=5))):
        params, checks = [], []
        for kind, schema, check in cases:
            for prompt in PROMPTS:
                params.append((prompt, SamplingParams(max_tokens=48, so_args={"schema_type": kind, "schema": schema},
                                                      **sampling)))
                checks.append((kind, schema, check))
        outputs = llm.generate([p for p, _ in params], [s for _, s in params], use_tqdm=False)
        for (kind, schema, check), output in zip(checks, outputs):
            completion = output.outputs[0]
            if completion.finish_reason != "stop":
                report[f"{name} {kind}: max_tokens ran out first"] += 1
                continue
            try:
                ok = bool(re.fullmatch(check, completion.text)) if kind == "regex" else bool(check.parse(completion.text))
            except lark.exceptions.LarkError:
                ok = False
            report[f"{name} {kind}: finished and " + ("valid" if ok else "INVALID")] += 1
            if not ok:
                failures.append({"kind": kind, "schema": schema, "output": completion.text})
    print(json.dumps({"regexes": len(REGEXES), "grammars": len(GRAMMARS), "prompts": len(PROMPTS),
                      "counts": dict(sorted(report.items())), "failures": failures}, indent=2))


if __name__ == "__main__":
    main()
