"""Times NeMo AutoModel's V4.1 reference on the tiny fixture (greedy, whole sequence recomputed per token: it has no
KV cache). Runs in the NeMo venv of tools/goldens/v41_golden.py:  PYTHONPATH=. python tools/goldens/v41_reference_timing.py
"""
import os, time; os.environ["TORCHDYNAMO_DISABLE"]="1"
import torch, json
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
torch.set_flush_denormal(True)
F="tests/fixtures/v41_tiny"
tok = PreTrainedTokenizerFast(tokenizer_file=F+"/tokenizer.json")
d = json.load(open(F+"/config.json"))
cfg = DeepseekV41Config(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})
backend = BackendConfig(attn="eager", experts="torch", dispatcher="torch", linear="torch", rms_norm="torch_fp32", rope_fusion=False, enable_hf_state_dict_adapter=True)
model = DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=tok).float().eval()
t = {k: v for k, v in load_file(F+"/model.safetensors").items() if not k.startswith("mtp.")}
model.load_state_dict({k: v.float() for k, v in model.state_dict_adapter.from_hf(t).items()}, strict=False)
for batch in (1, 16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (batch, 128), generator=g)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(64):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    el = time.perf_counter() - start
    print(json.dumps({"batch": batch, "elapsed": el, "output_tokens_per_second": batch * 64 / el}))
