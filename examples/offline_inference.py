"""Offline inference with DeepInfer.

The model is DEEPINFER_HF_MODEL_DIR when set, otherwise deepseek-ai/DeepSeek-V4.1-Flash-1017
from the Hugging Face Hub (downloaded once into the HF cache):

    DEEPINFER_HF_MODEL_DIR=/path/to/model python examples/offline_inference.py
"""

from deepinfer import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Write a haiku about the sea:",
]
# Low temperature with a fixed per-request seed: near-greedy and reproducible.
sampling_params = SamplingParams(temperature=0.2, top_p=0.95, max_tokens=32, seq_seed=0)


def main() -> None:
    # model=None: the engine resolves DEEPINFER_HF_MODEL_DIR, then the hub default.
    llm = LLM(model=None)
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
