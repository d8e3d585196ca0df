"""Offline inference with DeepInfer.

The model is DEEPINFER_HF_MODEL_DIR when set, otherwise deepseek-ai/DeepSeek-V4.1-Flash-1017 from the Hugging Face
Hub (downloaded once into the HF cache). When the Hub cannot be reached (or HF_HUB_OFFLINE=1), DeepInfer says so in
one warning line and runs the small model shipped inside the package (``deepinfer-tiny-v4.1``, trained on Python's
standard library), so this script works on any machine:

    python examples/offline_inference.py
    DEEPINFER_HF_MODEL_DIR=/path/to/model python examples/offline_inference.py
"""

from deepinfer import LLM, SamplingParams

# Code prompts: the embedded model only knows Python's standard library.
prompts = [
    "def fibonacci(n):",
    '"""Return the',
    "import os\n",
    "class Stack:",
]
# Low temperature with a fixed per-request seed: near-greedy and reproducible.
sampling_params = SamplingParams(temperature=0.2, top_p=0.95, max_tokens=48, seq_seed=0)


def main() -> None:
    # model=None: DEEPINFER_HF_MODEL_DIR, then the hub default, then the embedded model.
    llm = LLM(model=None)
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
