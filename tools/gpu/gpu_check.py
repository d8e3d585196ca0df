"""One-shot GPU check of the reference path: parity with HF on CUDA and a throughput pair."""
import json, os, subprocess, sys
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
from transformers import DeepseekV4ForCausalLM
from deepinfer import LLM, SamplingParams
from deepinfer.testing.tiny_v4 import build_tiny_v4, SMALL_V4

out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
ckpt = build_tiny_v4("/tmp/tiny_gpu")
hf = DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
llm = LLM(str(ckpt), dtype="float32", device="cuda")
g = torch.Generator().manual_seed(7)
prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (300, 17, 123, 64, 5, 250, 31, 190)]
from deepinfer.testing.probes import prefill_logits
with torch.no_grad():
    ref = hf(torch.tensor([prompts[0]], device="cuda")).logits[0]
ours = prefill_logits(llm, prompts[0])
out["prefill_rel_err"] = float((ours - ref).abs().max() / ref.abs().max())

def _cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@torch.no_grad()
def hf_greedy(p, steps=64):
    o = hf(torch.tensor([p], device="cuda"), use_cache=True); cache, toks = _cache(o), []
    for _ in range(steps):
        t = int(o.logits[0, -1].argmax()); toks.append(t)
        o = hf(torch.tensor([[t]], device="cuda"), past_key_values=cache, use_cache=True); cache = _cache(o)
    return toks
G = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
expected = [hf_greedy(p) for p in prompts]
got = [o.outputs[0].token_ids for o in llm.generate(prompts, G, use_tqdm=False)]
out["greedy_batch8_equal"] = [a == b for a, b in zip(got, expected)]
bf = LLM(str(ckpt), dtype="bfloat16", device="cuda")
out["bf16_runs"] = len(bf.generate(prompts[:2], G, use_tqdm=False)[0].outputs[0].token_ids)

small = build_tiny_v4("/tmp/small_gpu", **SMALL_V4)
for n in (1, 16):  # the throughput pair through the command users run, HF timed in the same process
    result = f"/tmp/gpu_check_b{n}.json"
    subprocess.run([sys.executable, "-m", "deepinfer.cli", "bench", "latency", "--model", str(small), "--dtype", "float32",
                    "--batch-size", str(n), "--input-len", "128", "--output-len", "64", "--compare-hf",
                    "--output-json", result], check=True)
    out[f"bench_b{n}"] = json.load(open(result))
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_check.json"), "w"), indent=1)
