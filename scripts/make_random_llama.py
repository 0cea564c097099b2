#!/usr/bin/env python3
"""Write a Hugging Face folder of a Llama-family (or Qwen2 / Qwen3) model with random weights, for GPU benchmarks.

GPU speed does not depend on weight values, so a Llama-3.1-8B-shaped model with random bf16 weights
measures what the real one would, without downloading 16 GB. The tokenizer is a word-level vocabulary
("t0" .. "t{V-1}") so every id decodes to text and prompts of exact token lengths are easy to write.
``--tokenizer-from`` takes a real model's tokenizer (and chat template) instead, for what needs one: structured
outputs (llguidance cannot read the word-level vocabulary), chat templates, tool calls.

    python scripts/make_random_llama.py --shape llama3.1-8b --out /tmp/llama8b-random --device cuda
    python scripts/make_random_llama.py --shape smollm2-135m --tokenizer-from SMOLLM2_HF_DIR --out /tmp/smol-random
"""

from __future__ import annotations

import argparse
import json
import shutil
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
    # SmolLM2-135M-Instruct's config.json (the embedded model's shape; its token ids 1 and 2 are <|im_start|> and
    # <|im_end|>).
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    # Qwen2.5-7B-Instruct's and Qwen3-8B's config.json (q, k, v biases; per-head q, k norms).
    "qwen2.5-7b": dict(
        family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3-8b": dict(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny": dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def word_level_tokenizer(vocab_size: int, eos_id: int):
    """A fast tokenizer whose token i is the word ``t{i}`` (whitespace separated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos_id}", unk_token="t0")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")


def tokenizer_files(source: Path, vocab_size: int) -> list[str]:
    """The tokenizer files of a Hugging Face folder, checked: there is a tokenizer and its ids fit the model's
    vocabulary."""
    from transformers import AutoTokenizer

    names = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in names and "tokenizer.model" not in names:
        raise SystemExit(f"--tokenizer-from {source}: no tokenizer.json or tokenizer.model there; pass a Hugging "
                         f"Face model folder")
    size = len(AutoTokenizer.from_pretrained(source))
    if size > vocab_size:
        raise SystemExit(f"--tokenizer-from {source}: its {size} tokens do not fit the shape's vocabulary of "
                         f"{vocab_size}; pick a shape whose vocab_size is at least {size}")
    return names


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
    parser.add_argument("--tokenizer-from", type=Path, default=None, metavar="HF_DIR",
                        help="copy this Hugging Face folder's tokenizer and chat template instead of writing the "
                             "word-level one (its ids must fit the shape's vocabulary)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default=None,
                        help="the architecture (default: the shape's, llama unless named): e.g. qwen2 with the "
                             "llama3.1-8b shape measures what Qwen2's q, k, v biases cost at the same sizes")
    parser.add_argument("--lm-head-scale", type=float, default=5.0,
                        help="multiply lm_head's random init so greedy decoding has clear winners (fewer bf16 ties)")
    args = parser.parse_args()

    import transformers

    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    shape = dict(SHAPES[args.shape])
    family = args.family or shape.pop("family", "llama")
    shape.pop("family", None)
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"--layers must be >= 1, got {args.layers}")
        shape["num_hidden_layers"] = args.layers
    config = config_class(architectures=[FAMILIES[family][1]], hidden_act="silu", **shape)
    if args.tokenizer_from is not None:  # checked before minutes of writing weights
        copied = tokenizer_files(args.tokenizer_from, config.vocab_size)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = model_class(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.lm_head_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    if args.tokenizer_from is not None:
        for name in copied:
            shutil.copyfile(args.tokenizer_from / name, args.out / name)
    else:
        eos = config.eos_token_id[-1] if isinstance(config.eos_token_id, list) else config.eos_token_id
        word_level_tokenizer(config.vocab_size, eos).save_pretrained(args.out)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (args.out / "generation_config.json").write_text(json.dumps(gen))
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e9:.2f} B params, {args.dtype}, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
