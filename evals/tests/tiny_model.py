"""A tiny Qwen2-MoE model directory for the eval tests (offline, deterministic).

Used until ``fixtures.build.fixture_path`` lands; :func:`tiny_model_dir` prefers the shared fixture
when that module is importable.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SEED = 1234
VOCAB = 600


def _corpus(data_dir: Path) -> list[str]:
    texts: list[str] = []
    with open(data_dir / "mmlu" / "dev.jsonl", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            texts.append(row["question"] + "\n" + "\n".join(row["choices"]) + "\nAnswer: A B C D")
    with open(data_dir / "gsm8k" / "train.jsonl", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if i >= 300:
                break
            row = json.loads(line)
            texts.append("Question: " + row["question"] + "\nAnswer: " + row["answer"])
    return texts


def build_tiny_model(out: Path, data_dir: Path, seed: int = SEED) -> Path:
    """Train a small byte-level BPE tokenizer and save a randomly initialised tiny Qwen2-MoE."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2MoeConfig, Qwen2MoeForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(Path(data_dir)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    vocab = tok.get_vocab_size()
    cfg = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id, pad_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(cfg)
    # random init gives near-uniform logits; a wider output layer makes answers less tie-prone
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def tiny_model_dir(tmp_root: Path, data_dir: Path) -> Path:
    """The shared fixture ``qwen2-moe-shared`` when importable, else a tiny model built here."""
    if os.environ.get("DPEP_EVAL_TEST_OWN_MODEL") != "1":
        try:
            from dpep_parity.fixtures.build import fixture_path
        except ImportError:
            pass
        else:
            return Path(fixture_path("qwen2-moe-shared"))
    return build_tiny_model(Path(tmp_root) / "tiny-qwen2-moe", data_dir)
