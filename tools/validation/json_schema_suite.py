"""Structured outputs against the JSON-Schema-Test-Suite's schemas.

The suite ships inside jsonschema's source distribution (not committed here)::

    pip download jsonschema --no-deps --no-binary :all: -d /tmp/js
    python tools/validation/json_schema_suite.py /tmp/js/jsonschema-*.tar.gz --drafts draft2020-12 draft7 --limit 300

Every distinct schema of the chosen drafts' test files (boolean schemas and schemas that reference remote
documents aside: they are counted apart) is submitted to the engine's structured-outputs plugin: a refusal is
recorded with its reason; an accepted schema is generated from by the embedded model, greedy and sampled, and
each finished output must parse and validate with jsonschema (with the draft's validator). Prints a JSON report.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tarfile

import jsonschema

VALIDATORS = {"draft2020-12": jsonschema.Draft202012Validator, "draft7": jsonschema.Draft7Validator}


def load_schemas(sdist: str, drafts: list[str]) -> list[tuple[str, str, object]]:
    """(draft, test file, schema) for every distinct schema, in file order."""
    seen, schemas = set(), []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            match = re.search(r"/json/tests/([^/]+)/([^/]+\.json)$", member.name)
            if not match or match.group(1) not in drafts:
                continue
            for group in json.load(tar.extractfile(member)):
                key = (match.group(1), json.dumps(group["schema"], sort_keys=True))
                if key not in seen:
                    seen.add(key)
                    schemas.append((match.group(1), match.group(2), group["schema"]))
    return schemas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", help="jsonschema-*.tar.gz (pip download jsonschema --no-binary :all:)")
    parser.add_argument("--drafts", nargs="+", default=["draft2020-12", "draft7"], choices=sorted(VALIDATORS))
    parser.add_argument("--limit", type=int, default=300, help="schemas to try, in file order")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default="deepinfer-tiny-v4.1")
    args = parser.parse_args()

    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", max_num_seqs=64)
    processor = llm.engine.structured_outputs()
    report = collections.Counter()
    reasons, accepted, violations = collections.Counter(), [], []
    for draft, source, schema in load_schemas(args.sdist, args.drafts)[:args.limit]:
        if isinstance(schema, bool):
            report["boolean schema (so_args takes an object)"] += 1
            continue
        if "localhost:1234" in json.dumps(schema) or "json-schema.org" in json.dumps(schema.get("$ref", "")):
            report["references a remote document"] += 1
            continue
        so_args = {"schema_type": "json", "schema": schema}
        try:
            processor.validate(so_args)
        except ValueError as exc:
            report["refused"] += 1
            reasons[re.sub(r"#[^:]*: ", "", str(exc).split(": ", 2)[-1])[:120]] += 1
            continue
        accepted.append((draft, source, schema, so_args))
    report["accepted"] = len(accepted)
    prompts = ["{", "Return a JSON value:\n", "def f(x):"]
    for name, sampling in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=0.9, seq_seed=5))):
        params = [SamplingParams(max_tokens=args.max_tokens, so_args=a, **sampling) for _, _, _, a in accepted]
        outputs = llm.generate([prompts[i % len(prompts)] for i in range(len(params))], params, use_tqdm=False)
        for (draft, source, schema, _), output in zip(accepted, outputs):
            completion = output.outputs[0]
            if completion.finish_reason != "stop":
                report[f"{name}: max_tokens ran out first"] += 1
                continue
            try:
                VALIDATORS[draft](schema).validate(json.loads(completion.text))
                report[f"{name}: finished and valid"] += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                report[f"{name}: finished but INVALID"] += 1
                violations.append({"draft": draft, "file": source, "schema": schema, "output": completion.text,
                                   "error": str(exc).splitlines()[0]})
    print(json.dumps({"counts": dict(report), "refusal_reasons": dict(reasons.most_common()),
                      "violations": violations}, indent=2))


if __name__ == "__main__":
    main()
