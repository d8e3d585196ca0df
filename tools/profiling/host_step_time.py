"""Host time to prepare one step's inputs (no device needed): a 16-request decode step and prefills.

    PYTHONPATH=. python tools/profiling/host_step_time.py

Uses flash4L's layer pattern (window 128, ratios 4 and 128, block size 64) at a size a CPU holds; the host work
depends on token counts and block tables, not on the model's width. Prints milliseconds per call of
``ForwardBatchBuilder.inputs`` (what the host does every step) and of ``derive`` on the CPU (what moves to the
device).
"""

from __future__ import annotations

import tempfile
import time

from deepinfer import LLM, SamplingParams
from deepinfer.runner.cuda_graphs import DecodeGraphs
from deepinfer.testing.flash_fixtures import write_fixture

SHRUNK = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_attention_heads=4, head_dim=64,
              qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2, index_n_heads=4, index_head_dim=32,
              index_topk=8)


def _ms(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    model_dir = write_fixture("flash4L", tempfile.mkdtemp(), **SHRUNK)
    for batch, prompt in ((16, 512), (1, 8192)):
        llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", device="cpu", max_num_seqs=batch,
                  max_num_batched_tokens=8192)
        for i in range(batch):
            llm.submit([3 + (7 * j + i) % 1000 for j in range(prompt)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine = llm.engine
        prefill = engine.scheduler.schedule()
        builder = engine.batch_builder
        print(f"{batch} x {prompt} prefill: inputs {_ms(lambda: builder.inputs(prefill), 5):.2f} ms, "
              f"derive on the CPU {_ms(lambda: builder.derive(builder.inputs(prefill)), 3):.1f} ms")
        engine.scheduler.update(prefill)
        for request in prefill.requests:  # as if the prefill had run and sampled: the next step decodes
            request.token_ids.append(3)
        decode = engine.scheduler.schedule()
        shape = DecodeGraphs(engine.model, engine.cache, builder, batch, engine.max_model_len, capture=False)._shape(decode)
        print(f"{batch} x {prompt} decode (padded for a graph): inputs {_ms(lambda: builder.inputs(decode, shape), 50):.2f} ms")


if __name__ == "__main__":
    main()
