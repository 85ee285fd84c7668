#!/usr/bin/env python3
"""Build a tiny random Llama (model + BPE tokenizer) for serving tests, with no downloads.

    python tests/harness/serve/build_tiny_model.py OUT_DIR [--seed 0] [--dtype float32]

Shape (docs/cpu-testing.md): hidden 256, 2 layers, 4 attention heads / 2 KV heads, head_dim 64,
intermediate 512. The tokenizer is a byte-level BPE trained with ``tokenizers`` on ~20 KB of
pseudo-English text this script generates from a fixed seed, so any prompt can be encoded. The
same seed gives the same files (weights via ``torch.manual_seed``, text via ``random.Random``).

The weights are drawn with a larger initializer range than a real model's (0.2 instead of
0.02): with 0.02 a random two-layer model produces almost flat logits, so greedy decoding sits on
near-ties and the slightest rounding difference flips a token. Peaked logits make "greedy
outputs are token-identical" a meaningful check of the attention path rather than of luck.

Needs ``torch``, ``transformers`` and ``tokenizers`` (all present in any vLLM environment).
Prints one JSON line describing what it wrote.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
VOCAB_TARGET = 1024
MAX_POSITIONS = 4096
INIT_RANGE = 0.2
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

_WORDS = (
    "the a an of to in on at by for with from over under after before while when where "
    "model token cache block layer head query key value attention kernel server request "
    "prompt answer river mountain city garden window morning evening winter summer light "
    "stone paper engine signal number table letter music story forest ocean bridge market "
    "runs reads writes holds moves turns opens closes finds keeps brings sends grows falls "
    "quick slow bright dark quiet loud small large early late green blue red old new warm "
    "cold every some many few one two three four five six seven eight nine ten hundred"
).split()


def corpus(seed: int, sentences: int = 400) -> list:
    """Deterministic pseudo-English lines (about 20 KB)."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        n = rng.randint(6, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if i % 7 == 0:
            words.insert(rng.randint(0, n), str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", ".", ".", "?", "!", ","]))
    return lines


def build_tokenizer(lines: list, vocab_size: int = VOCAB_TARGET):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def build(out_dir: str, seed: int = 0, dtype: str = "float32") -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    lines = corpus(seed)
    raw = build_tokenizer(lines)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>", pad_token="<pad>",
                                     model_max_length=MAX_POSITIONS)
    hf_tok.save_pretrained(out_dir)
    # The model's vocabulary is exactly the tokenizer's: a padded one would let a random model
    # emit ids the tokenizer cannot decode.
    vocab = len(hf_tok)

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
        initializer_range=INIT_RANGE, tie_word_embeddings=False, rope_theta=10000.0,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Make sure every weight comes from this seed whatever the transformers version's init does.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_RANGE)
    model = model.to(getattr(torch, dtype))
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "corpus.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    info = {"out_dir": os.path.abspath(out_dir), "vocab": vocab,
            "params": sum(p.numel() for p in model.parameters()), "dtype": dtype,
            "seed": seed, "corpus_bytes": sum(len(line) + 1 for line in lines),
            "seconds": round(time.perf_counter() - t0, 2)}
    with open(os.path.join(out_dir, "tiny_model.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    print(json.dumps(build(args.out_dir, args.seed, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
