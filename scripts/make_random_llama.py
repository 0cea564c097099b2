#!/usr/bin/env python3
"""Write a Hugging Face folder of a Llama-family model with random weights, for GPU benchmarks.

GPU speed does not depend on weight values, so a Llama-3.1-8B-shaped model with random bf16 weights
measures what the real one would, without downloading 16 GB. The tokenizer is a word-level vocabulary
("t0" .. "t{V-1}") so every id decodes to text and prompts of exact token lengths are easy to write.

    python scripts/make_random_llama.py --shape llama3.1-8b --out /tmp/llama8b-random --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHAPES = {
    # Meta-Llama-3.1-8B's config.json (architecture facts only).
    "llama3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128009],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "tiny": dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def word_level_tokenizer(vocab_size: int, eos_id: int):
    """A fast tokenizer whose token i is the word ``t{i}`` (whitespace separated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos_id}", unk_token="t0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None,
                        help="number of decoder layers (default: the shape's; fewer make quick experiments of the "
                             "same width)")
    parser.add_argument("--lm-head-scale", type=float, default=5.0,
                        help="multiply lm_head's random init so greedy decoding has clear winners (fewer bf16 ties)")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"--layers must be >= 1, got {args.layers}")
        shape["num_hidden_layers"] = args.layers
    config = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_act="silu", **shape)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.lm_head_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    eos = config.eos_token_id[-1] if isinstance(config.eos_token_id, list) else config.eos_token_id
    word_level_tokenizer(config.vocab_size, eos).save_pretrained(args.out)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (args.out / "generation_config.json").write_text(json.dumps(gen))
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e9:.2f} B params, {args.dtype}, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
