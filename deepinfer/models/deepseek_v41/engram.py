"""Engram: n-gram memory looked up by hash and gated into the residual streams (layers ``engram_layer_ids``).

Token ids are first mapped onto a normalised vocabulary (NFKC, accents stripped, lower-cased, whitespace folded),
so that spelling variants share memory. For every n-gram length 2..N ending at a token, a rolling XOR of
``normalised id * odd multiplier`` is reduced modulo ``engram_n_heads`` distinct primes per length; each residue
picks one row of the layer's table. Multipliers come from NumPy's PCG64 seeded with ``10007 * layer``; primes are
the first unused ones above ``engram_vocab_size - 1``. Both are fixed by the release, so they are recomputed
exactly rather than stored.

Real tables hold ~384M rows of 256 FP8 values per layer (about 100 GB each), so they stay memory-mapped from the
checkpoint. The rows depend on token ids alone, so they are looked up on the host while the step's inputs are
prepared (``DeepseekV41ForCausalLM.host_inputs``) and travel to the device with them, still FP8, where they are
dequantized: the forward pass never waits on host memory and can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.runtime.linear import Linear


def normalised_vocabulary(tokenizer) -> tuple[list[int], int]:
    """(normalised id of every token id, number of normalised ids)."""
    from tokenizers import Regex, normalizers

    placeholder = "\ue000"  # keeps a lone space from being stripped away
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), placeholder),
        normalizers.Strip(), normalizers.Replace(placeholder, " "),
    ])
    backend = tokenizer.backend_tokenizer
    ids: dict[str, int] = {}
    mapping = []
    for token_id in range(len(tokenizer)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 sequence: keep the raw token, it has no text of its own
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        mapping.append(ids.setdefault(key, len(ids)))
    return mapping, len(ids)


def _is_prime(n: int) -> bool:
    return n == 2 or (n > 2 and n % 2 == 1 and all(n % d for d in range(3, math.isqrt(n) + 1, 2)))


class NgramHasher:
    """Table rows ``[T, (N-1) * heads]`` of one Engram layer for the tokens of a step, given each token's
    predecessors.

    Not a module: moving the model to its device leaves these tensors where the tables are (``to``)."""

    def __init__(self, config, tokenizer, blocked_id: int | None = None):
        """``blocked_id``: a token id no n-gram reaches across (a vision model's image token), None: none."""
        import numpy as np

        self.blocked_id = blocked_id

        mapping, size = normalised_vocabulary(tokenizer)
        if size != config.engram_compressed_vocab_size:
            raise ValueError(
                f"the tokenizer normalises to {size} Engram ids but the config says engram_compressed_vocab_size="
                f"{config.engram_compressed_vocab_size}; Engram hashes need the checkpoint's own tokenizer"
            )
        if len(mapping) < config.vocab_size:
            mapping += [mapping[config.engram_pad_token_id]] * (config.vocab_size - len(mapping))
        self.order = config.engram_max_ngram_size
        self.heads = config.engram_n_heads
        self.pad_id = mapping[config.engram_pad_token_id]
        bound = max(1, (np.iinfo(np.int64).max // size) // 2)
        used: set[int] = set()
        primes, offsets, multipliers = [], [], []
        for layer, rows in zip(config.engram_layer_ids, config.engram_num_embeddings):
            layer_primes = []
            for _ in range(self.order - 1):
                candidate = config.engram_vocab_size - 1
                for _ in range(self.heads):
                    candidate += 1
                    while not _is_prime(candidate) or candidate in used:
                        candidate += 1
                    used.add(candidate)
                    layer_primes.append(candidate)
            if sum(layer_primes) > rows:
                raise ValueError(f"Engram layer {layer} needs {sum(layer_primes)} table rows for its hash buckets; "
                                 f"engram_num_embeddings gives {rows}")
            primes.append(layer_primes)
            offsets.append([0] + list(np.cumsum(layer_primes[:-1])))
            rng = np.random.default_rng(10007 * layer)
            multipliers.append((rng.integers(0, bound, size=(self.order,), dtype=np.int64) * 2 + 1).tolist())
        self.token_map = torch.tensor(mapping, dtype=torch.int64, device="cpu")
        self.primes = torch.tensor(primes, dtype=torch.int64, device="cpu")
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device="cpu")
        self.multipliers = torch.tensor(multipliers, dtype=torch.int64, device="cpu")

    def to(self, device: torch.device) -> NgramHasher:
        for name in ("token_map", "primes", "offsets", "multipliers"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def ngrams(self, token_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The step's n-grams [T, N] in normalised ids (current token first, padded where one reaches past the
        sequence start or an image token), which every Engram layer hashes: made once a step. ``token_ids`` [T];
        ``history`` [T, N-1] the preceding ids, oldest first, -1 before the sequence start."""
        if self.blocked_id is not None:  # an n-gram is padded from the first blocked token back, as from the start
            history = history.masked_fill(history == self.blocked_id, -1)
        ids = torch.cat([token_ids.unsqueeze(1), history.flip(1)], dim=1)  # [T, N]: current, previous, ...
        started = (ids >= 0).cumprod(dim=1).bool()  # an n-gram reaching past position 0 is padded from there on
        return torch.where(started, self.token_map[ids.clamp(min=0)], self.pad_id)

    def __call__(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        """Table rows of ``ngrams``' output ``tokens`` for ``layer``, the Engram layer's index among the Engram
        layers."""
        products = tokens * self.multipliers[layer]  # [T, N], wrapping as int64 does on every device
        rolling, rows = products[:, 0], []
        for length in range(1, self.order):
            rolling = rolling ^ products[:, length]
            heads = slice((length - 1) * self.heads, length * self.heads)
            rows.append(rolling.unsqueeze(-1) % self.primes[layer, heads])
        return torch.cat(rows, dim=-1) + self.offsets[layer]


class Engram(nn.Module):
    def __init__(self, config, layer_id: int, mhc):
        super().__init__()
        c = config
        self.mhc = mhc  # the gate on the streams is the hyper-connection backend's
        self.index = c.engram_layer_ids.index(layer_id)
        self.hidden, self.hc_mult, self.eps = c.hidden_size, c.hc_mult, c.rms_norm_eps
        lookups = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        self.wkv = Linear(lookups * c.engram_head_dim, c.hidden_size * (c.hc_mult + 1))
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size), requires_grad=False)
        # FP8 rows and their per-32-channel scales: memory-mapped from the checkpoint, or copied to the device
        # (set by the model's ``attach``)
        self.table: torch.Tensor | None = None
        self.table_scale: torch.Tensor | None = None

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 rows [T, lookups, dim] and their scales' exponent bytes [T, lookups, dim/32], where the tables
        are (gathered as bytes: not every device indexes FP8 tensors)."""
        return self.table.view(torch.uint8)[rows].view(self.table.dtype), self.table_scale.view(torch.uint8)[rows]

    def forward(self, streams: torch.Tensor, values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """``streams`` [T, hc, D]; ``values``/``exponents`` this layer's rows as ``gather`` returns them."""
        scales = torch.exp2(exponents.float() - 127).repeat_interleave(values.shape[-1] // exponents.shape[-1], -1)
        memory = (values.float() * scales).to(streams.dtype).flatten(1)  # e8m0: the byte is the biased exponent
        key, value = self.wkv(memory).split((self.hc_mult * self.hidden, self.hidden), dim=-1)
        key = key.unflatten(-1, (self.hc_mult, self.hidden))
        return self.mhc.engram_gate(streams, key, value, self.q_weight, self.k_weight, self.eps)
