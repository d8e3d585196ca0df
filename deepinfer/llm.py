"""The offline Python API: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import gc
import hashlib
import pickle
import time
import weakref
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from deepinfer.chat_encoding import IMAGE_PLACEHOLDER, encode_chat, split_content_images
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.runtime.request import Request
from deepinfer.engine.speculation import log_summary
from deepinfer.logger import init_logger
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.parallel import ranks as parallel
from deepinfer.sampling_params import SamplingParams

# text, token ids, or vLLM's prompt dict (``prompt`` or ``prompt_token_ids``, optional ``multi_modal_data``)
Prompt = str | Sequence[int] | dict
logger = init_logger(__name__)


class LLM:
    """Loads a DeepSeek-V4-family checkpoint and generates text from it.

    ``model`` is a local directory or a Hugging Face repo id (``DEEPINFER_HF_MODEL_DIR``
    overrides both). Other keyword arguments are engine arguments, see ``EngineConfig``.

    With ``data_parallel_size=N`` the job has N ranks (``deepinfer.parallel.ranks``): spawned from this process, or
    the processes ``torchrun`` started. Prompts are dealt to the ranks round-robin and every call returns all
    outputs in input order (on every rank under torchrun). ``close()`` (or ``with LLM(...)``) ends the ranks and
    frees the engine's memory.
    """

    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig.from_kwargs(model, engine_args)
        ranks = None
        if config.world_size > 1:
            ranks = parallel.start(config.world_size, config.torch_device(), config, _serve_rank)
            weakref.finalize(self, ranks.close)  # spawned ranks wait for calls: they must be told when it ends
        self._init(config, ranks)

    @classmethod
    def _as_rank(cls, config: EngineConfig, ranks: parallel.Ranks) -> "LLM":
        """A spawned rank's LLM (its process group already joined)."""
        llm = cls.__new__(cls)
        llm._init(config, ranks)
        return llm

    def _init(self, config: EngineConfig, ranks: parallel.Ranks | None) -> None:
        self.ranks = ranks
        if ranks is None:
            self._engine = LLMEngine(config)
        else:  # every rank built its engine before the first call (a rank that failed to ends the job here)
            self._engine = ranks.guarded(lambda: LLMEngine(config, ranks))
            ranks.guarded(lambda: ranks.any(False))
        self.tokenizer = self._engine.tokenizer
        self._next_id = 0

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM is closed (close() or the end of its with block): build a new LLM")
        return self._engine

    def close(self) -> None:
        """Ends a parallel job's ranks and frees the engine's memory, the device's included, now: while the LLM
        itself lives on (a notebook's variable), and without waiting for a garbage collection to find any reference
        cycle in the engine. Calls after it are errors."""
        if self.ranks is not None:
            self.ranks.close()
        if self._engine is None:
            return
        self._engine = None
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        for p in params:
            p.check_vocabulary(self.engine.model_config.vocab_size)
        if any(p.so_args is not None for p in params):
            self._check_structured_outputs(params)
        if self.ranks is not None:
            return self.ranks.guarded(lambda: self._generate_on_ranks(prompt_list, params, use_tqdm))
        encoded = [self._encode(i, prompt) for i, prompt in enumerate(prompt_list)]  # all checked before any starts
        groups = [self.submit(prompt, p, e) for prompt, p, e in zip(prompt_list, params, encoded)]
        self._run(groups, use_tqdm)
        return [self._request_output(group) for group in groups]

    def _generate_on_ranks(self, prompt_list: list[Prompt], params: list[SamplingParams], use_tqdm: bool):
        """Data parallelism: prompt i runs on rank i % N (context parallelism: on every rank, each computing a share
        of every step's tokens); rank 0 (every rank under torchrun) returns them all."""
        ranks = self.ranks
        shares = self.engine.config.context_parallel_size
        data_rank, data_ranks = ranks.rank // shares, ranks.world_size // shares
        ranks.mirror("generate", prompt_list, params, False)
        ranks.check_same("generate's prompts and sampling params",
                         hashlib.sha256(pickle.dumps((prompt_list, params))).hexdigest()[:16])
        mine = {}
        encoded = [self._encode(i, prompt) for i, prompt in enumerate(prompt_list)]
        for index, (prompt, p) in enumerate(zip(prompt_list, params)):
            if index % data_ranks == data_rank:
                mine[index] = self.submit(prompt, p, encoded[index])
            else:
                self._next_id += 1  # request ids stay the same on every rank
        self._run(list(mine.values()), use_tqdm and ranks.leader)
        gathered = ranks.gather({index: self._request_output(group) for index, group in mine.items()})
        if gathered is None:
            return None
        merged = {index: output for part in gathered for index, output in part.items()}
        return [merged[index] for index in range(len(prompt_list))]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        thinking: bool = False,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """Answers one conversation (a list of OpenAI-style message dicts: system, user, assistant with
        ``reasoning_content`` and ``tool_calls``, tool) or a list of them, encoded as DeepSeek's release encodes
        V4 chats (``deepinfer.chat_encoding``). ``thinking`` opens the answer with ``<think>``; ``tools``:
        OpenAI-shaped function definitions, rendered in the system prompt; ``reasoning_effort``: None, "high" or
        "max" (in thinking mode "max" adds the release's reasoning instruction)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, thinking, tools, reasoning_effort) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, messages: list[dict], thinking: bool = False, tools: list[dict] | None = None,
                    reasoning_effort: str | None = None) -> list[int] | dict:
        """A conversation's prompt token ids (the encoding carries its own BOS: none is added); with image content
        parts, a prompt dict of those ids (one placeholder per image) and its ``multi_modal_data``."""
        messages, images = split_content_images(messages)
        text = encode_chat(messages, thinking, tools=tools, reasoning_effort=reasoning_effort)
        token_ids = self.tokenize(text, add_special_tokens=False)
        return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}} if images else token_ids

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; for a model that reads images, each image placeholder is the image token
        whatever the tokenizer makes of its text (the tiny test tokenizer has no such token)."""
        image_token = getattr(self.engine.model_config, "image_token_id", None)
        if image_token is None or IMAGE_PLACEHOLDER not in text:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        token_ids = []
        for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if i:
                token_ids.append(image_token)
            if piece or (i == 0 and add_special_tokens):
                token_ids += self.tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0)
        return token_ids

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generates one completion of ``prompt``, yielding its text as it grows (pieces held back while they
        could still become a stop string come once they cannot)."""
        params = _as_params_list(sampling_params, 1)[0]
        if self.ranks is not None:
            raise ValueError("stream runs in one process; with data_parallel_size > 1 use generate")
        if params.n != 1:
            raise ValueError(f"stream generates one completion; got n={params.n}")
        params.check_vocabulary(self.engine.model_config.vocab_size)
        if params.so_args is not None:
            self._check_structured_outputs([params])
        (request,) = self.submit(_as_prompt_list(prompt)[0], params)
        shown = 0
        while self.engine.has_unfinished():
            self.engine.step()
            text = request.detokenizer.text
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)

    def _check_structured_outputs(self, params: list[SamplingParams]) -> None:
        """Every ``so_args`` checked (and compiled) before any request starts."""
        processor = self.engine.structured_outputs()
        for p in params:
            if p.so_args is None:
                continue
            if p.min_tokens:
                raise ValueError("so_args cannot be combined with min_tokens: the grammar may allow only the end of "
                                 "text before min_tokens tokens, which min_tokens forbids")
            processor.validate(p.so_args)

    def _encode(self, index: int, prompt: Prompt) -> tuple[str | None, list[int], tuple]:
        """``(text, token ids, images)`` of ``prompts[index]``, refused (naming it and any bad image) where the engine
        could not take it: checked for every prompt before any is added, so a bad prompt leaves no earlier one
        queued in the engine."""
        name, sources = f"prompts[{index}]", ()
        if isinstance(prompt, dict):
            sources = _image_sources(prompt.get("multi_modal_data"), name)
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        images = ()
        if sources:
            token_ids, images = self.engine.prepare_images(token_ids, sources, name)
        self.engine.check_prompt(token_ids, name, images)
        return text, token_ids, images

    def submit(self, prompt: Prompt, params: SamplingParams, encoded: tuple | None = None) -> list[Request]:
        """Adds ``params.n`` requests for ``prompt`` to the engine (``encoded``: its text, token ids and images,
        already checked) and returns them; the caller steps the engine (``generate``, ``stream``, ``deepinfer
        serve``)."""
        text, token_ids, images = encoded or self._encode(0, prompt)
        request_id = str(self._next_id)
        self._next_id += 1
        group = []
        for sample in range(params.n):
            request = Request(
                request_id=request_id,
                sample_index=sample,
                prompt=text,
                prompt_token_ids=token_ids,
                params=params,
                eos_token_ids=tuple(self.engine.model_config.eos_token_id),
                images=images,
            )
            request.metrics.num_prompt_tokens = len(token_ids)
            self.engine.add_request(request)
            group.append(request)
        return group

    def _run(self, groups: list[list[Request]], use_tqdm: bool) -> None:
        bar = tqdm(total=len(groups), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        prompt_tokens = sum(len(g[0].prompt_token_ids) for g in groups)
        by_id = {g[0].request_id: g for g in groups}
        while self._busy():
            finished = self.engine.step()
            if not use_tqdm or not finished:
                continue
            touched = {r.request_id for r in finished}
            completed = sum(all(r.finished for r in by_id[request_id]) for request_id in touched)
            if completed:
                elapsed = max(time.perf_counter() - start, 1e-9)
                output_tokens = sum(r.num_output_tokens for g in groups for r in g)
                bar.set_postfix_str(f"est. speed input: {prompt_tokens / elapsed:.1f} toks/s, output: {output_tokens / elapsed:.1f} toks/s")
                bar.update(completed)
        bar.close()
        elapsed = max(time.perf_counter() - start, 1e-9)
        output_tokens = sum(r.num_output_tokens for g in groups for r in g)
        counters = self.engine.counters()
        logger.info("generate: %d prompts, %d prompt tokens, %d generated in %.2f s (%.1f tok/s in, %.1f out); "
                    "since the engine started: %d preemptions, %d of %d prompt tokens from the prefix cache",
                    len(groups), prompt_tokens, output_tokens, elapsed, prompt_tokens / elapsed,
                    output_tokens / elapsed, counters["preemptions"], counters["cached_prompt_tokens"],
                    counters["prompt_tokens"])
        log_summary(self.engine.speculator)

    def _busy(self) -> bool:
        busy = self.engine.has_unfinished()
        if self.engine.expert_parallel is not None or self.engine.context is not None:  # ranks step together
            return self.ranks.any(busy)
        return busy

    @staticmethod
    def _request_output(group: list[Request]) -> RequestOutput:
        first = group[0]
        completions = [
            CompletionOutput(
                index=r.sample_index,
                text=r.detokenizer.text,
                token_ids=r.output_token_ids,
                logprobs=r.logprobs,
                cumulative_logprob=r.cumulative_logprob,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
            )
            for r in group
        ]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(r.finished for r in group),
            metrics=first.metrics,
        )


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        _check_prompt_dict(0, prompts)
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of those, got "
                         f"{type(prompts).__name__} (decode it first)")
    if isinstance(prompts, Sequence) and prompts and _is_token_ids(prompts):
        return [list(prompts)]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, dict):
            _check_prompt_dict(i, prompt)
        elif isinstance(prompt, str):
            _check_text(i, prompt)
        elif not _is_token_ids(prompt):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(prompt).__name__}"
                             + _first_non_int(prompt))
    return list(prompts)


def _check_prompt_dict(index: int, prompt: dict) -> None:
    """vLLM's prompt dicts: ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, with optional
    ``"multi_modal_data": {"image": image or [image, ...]}``."""
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"prompts[{index}] must be a dict with one of 'prompt' (str) and 'prompt_token_ids' (list "
                         f"of ints), and optionally 'multi_modal_data'; got the keys {sorted(prompt)}")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompts[{index}]['prompt'] must be a str, got {type(prompt['prompt']).__name__}")
        _check_text(index, prompt["prompt"])
    elif not _is_token_ids(prompt["prompt_token_ids"]):
        raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of token ids"
                         + _first_non_int(prompt["prompt_token_ids"]))


def _image_sources(data, name: str) -> list:
    """The images of a prompt's ``multi_modal_data`` (one, or a list), in placeholder order."""
    if data is None:
        return []
    if not isinstance(data, dict) or set(data) != {"image"}:
        raise ValueError(f"{name}: multi_modal_data must be {{'image': image or [image, ...]}} (images only); got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data["image"]
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for j, image in enumerate(images):
        if image is None:
            raise ValueError(f"{name} image {j} is None: give a PIL.Image, a path, bytes or a data: URL")
    return images


def _is_token_ids(prompt) -> bool:
    # bytes and bytearray are sequences of ints, but almost surely text the caller forgot to decode; a bool is
    # an int subclass, but True as a token id is a mistake, not token 1
    return (isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray))
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def _first_non_int(prompt) -> str:
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        return ""
    index, value = next((i, t) for i, t in enumerate(prompt) if not isinstance(t, int) or isinstance(t, bool))
    return f" (element {index} is {value!r})"


def _check_text(index: int, text: str) -> None:
    """The tokenizer takes only text that UTF-8 can encode: a lone surrogate would fail inside it, unnamed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompts[{index}] is not valid Unicode: {text[exc.start:exc.end]!r} at character "
                         f"{exc.start} (a lone surrogate?)") from None


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def _serve_rank(config: EngineConfig, ranks: parallel.Ranks) -> None:
    """A spawned rank of a parallel job (``parallel.ranks.start``): its own LLM makes each call rank 0 mirrors."""
    llm = LLM._as_rank(config, ranks)
    ranks.serve({"generate": llm._generate_on_ranks})
