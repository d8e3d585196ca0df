"""``deepinfer generate``, ``deepinfer chat``, ``deepinfer plugins``, ``deepinfer env`` and ``deepinfer draft-vocab``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from deepinfer import envs
from deepinfer.chat_encoding import IMAGE_PLACEHOLDER
from deepinfer.engine_flags import add_engine_arguments, engine_arguments


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete (or --prompts-file)")
    parser.add_argument("--prompts-file", help="a file of prompts, one per line ('-': standard input)")
    add_engine_arguments(parser)
    sampling = parser.add_argument_group("sampling (vLLM's SamplingParams)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default here)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--max-tokens", type=int, default=64)
    sampling.add_argument("--min-tokens", type=int, default=0)
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--seq-seed", type=int, help="deterministic sampling: noise keyed by (seed, position, token)")
    sampling.add_argument("--stop", action="append", help="a stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--logprobs", type=int, help="top log-probabilities per token (with --json)")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image every prompt reads (repeatable; DeepSeek-V4.1): at the prompt's "
                             f"{IMAGE_PLACEHOLDER} placeholders, one per image, or before its text if it has none")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt instead of the text")
    parser.set_defaults(run=run_generate)


def _prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
        with stream:
            prompts += [line.rstrip("\n").replace("\\n", "\n") for line in stream if line.strip()]
    if not prompts:
        raise ValueError("deepinfer generate: give prompts as arguments or with --prompts-file")
    return prompts


def run_generate(args) -> None:
    from deepinfer import LLM, SamplingParams

    prompts = _prompts(args)
    if args.image:
        prompts = [{"prompt": p if IMAGE_PLACEHOLDER in p else IMAGE_PLACEHOLDER * len(args.image) + p,
                    "multi_modal_data": {"image": list(args.image)}} for p in prompts]
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                            seq_seed=args.seq_seed, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    llm = LLM(args.model, **engine_arguments(args))
    for output in llm.generate(prompts, params, use_tqdm=sys.stderr.isatty()):
        if args.json:
            print(json.dumps({"prompt": output.prompt, "outputs": [
                {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                 "cumulative_logprob": c.cumulative_logprob,
                 "logprobs": None if c.logprobs is None else
                 [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]}
                for c in output.outputs]}))
            continue
        for completion in output.outputs:
            print(output.prompt + completion.text)
            print(f"--- {completion.finish_reason}, {len(completion.token_ids)} tokens")


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="as for generate")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--system", help="a system message opening the conversation")
    parser.add_argument("--thinking", action="store_true", help="the model reasons (<think>) before answering")
    parser.add_argument("--reasoning-effort", choices=["high", "max"],
                        help="with --thinking, max opens the prompt with DeepSeek's reasoning instruction")
    parser.add_argument("--temperature", type=float, default=1.0, help="DeepSeek's recommendation: 1.0")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=512, help="per answer")
    parser.add_argument("--seq-seed", type=int)
    parser.set_defaults(run=run_chat)


def run_chat(args) -> None:
    """Reads a user message per line from standard input (a '> ' prompt on a terminal) and streams each answer;
    '/reset' forgets the conversation, '/exit' or the end of input leaves."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seq_seed=args.seq_seed)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        answer = ""
        prompt = llm.chat_prompt(messages, args.thinking, reasoning_effort=args.reasoning_effort)
        for piece in llm.stream(prompt, params):
            answer += piece
            print(piece, end="", flush=True)
        print()
        # with --thinking the answer is "reasoning</think>answer" (all reasoning if cut short); the encoding replays
        # the answer without its reasoning
        reasoning, _, content = answer.partition("</think>") if args.thinking else ("", "", answer)
        messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})


def add_env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=run_env)


def run_env(args) -> None:
    """Every DEEPINFER_* variable: its value here (set or default), its default and meaning."""
    parsed = envs.get()
    for variable in envs.VARIABLES:
        value = getattr(parsed, variable.name)
        where = "set" if variable.name in os.environ else "default"
        shown = "unset" if value is None else (int(value) if isinstance(value, bool) else value)
        kind, meaning = (_plain(text) for text in (variable.type_label(), variable.meaning))
        print(f"{variable.name}={shown} ({where}; {kind}) {meaning}")


def _plain(markdown: str) -> str:
    return markdown.replace("`", "").replace("\\|", "|")


def add_plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=run_plugins)


def run_plugins(args) -> None:
    """The registered plugins (built-ins and installed entry points), their versions and the hooks they serve."""
    from deepinfer.plugins.manager import list_plugins, load_plugins

    load_plugins()
    for plugin in list_plugins():
        print(f"{plugin['name']} {plugin['version']}: {', '.join(plugin['hooks']) or 'no hooks'}")


def add_draft_vocab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="deepinfer-tiny-v4.1",
                        help="the checkpoint whose tokenizer counts the tokens (a directory, hub id or the embedded "
                             "model)")
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE",
                        help="text files like the ones the model will continue, each read as one text")
    parser.add_argument("--size", type=int, default=32768, help="token ids to keep, the most frequent")
    parser.add_argument("--output", required=True, help="the file to write (DEEPINFER_DRAFT_VOCAB reads it)")
    parser.set_defaults(run=run_draft_vocab)


def run_draft_vocab(args) -> None:
    """The ``--size`` most frequent tokens of the corpus (the end-of-sequence token always among them), one a line:
    a draft vocabulary for ``DEEPINFER_DRAFT_VOCAB`` (``loading/draft_vocab.py``)."""
    from deepinfer.loading.draft_vocab import most_frequent_tokens, write_draft_vocab
    from deepinfer.loading.model_source import resolve_model_dir
    from deepinfer.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    texts = []
    for path in args.corpus:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    always = [t for t in (tokenizer.eos_token_id,) if t is not None]

    def encode(text: str) -> list[int]:
        # a whole file is longer than the model's context, which the tokenizer would otherwise warn of
        return tokenizer.encode(text, add_special_tokens=False, verbose=False)

    ids = most_frequent_tokens(texts, encode, args.size, always)
    write_draft_vocab(args.output, ids, f"{len(texts)} corpus files with {args.model}'s tokenizer")
    print(f"wrote {len(ids)} token ids to {args.output}"
          + (f" (the corpus has {len(ids)} distinct tokens, fewer than --size {args.size})" if len(ids) < args.size
             else ""))
