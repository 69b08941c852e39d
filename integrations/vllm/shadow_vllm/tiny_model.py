"""A tiny random-weight Llama for vLLM, made offline and the same every time.

Why: the tests and benchmarks of shadow-vllm need a model vLLM loads like
any Hugging Face checkpoint, without a hub (nothing outside the package
registries can be reached here) and small enough that two vLLM instances
start on two cores. Its answers are nonsense, but greedy decoding makes
them the same on every engine that loads it, which is what a failover
test compares.

``python -m shadow_vllm.tiny_model OUT_DIR`` writes config.json,
generation_config.json, model.safetensors (float32; numpy's seeded
generator, so the bytes are the same on every machine) and a byte-level
BPE tokenizer trained here on the text below, with a chat template.

``--hidden H --layers L`` make a larger model of the same shape (heads of
64, half as many key/value heads, an MLP twice as wide as the hidden
size), for figures that scale with the weights: ``--hidden 1024 --layers
8`` is 312 MiB (docs/vllm.md, the repack decision). The defaults are the
tests' model.
"""

import argparse

import json
import os
import sys

import numpy as np

SEED = 33
HIDDEN = 256
LAYERS = 2
HEAD_DIM = 64
MAX_POSITIONS = 1024
VOCAB_TARGET = 3072

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# The tokenizer's training text: written for this file. Its words and their
# combinations below give the merges a vocabulary of a few thousand.
_TEXT = """
A pair of engines shares one port. The active engine answers every request
while its shadow waits behind a lock, fully loaded and warmed up, ready to
take over the moment the first one dies. When the kernel releases the lock,
the shadow wakes, accepts the connections queued in the listening socket,
and answers them with the same weights and the same greedy tokens.
The runtime watches both engines, restarts the one that died, and lets it
park again as the new shadow. Nothing the engines send may stall it.
Weights live once in memory served by a daemon; each engine maps them.
The cache of keys and values belongs to the engine that serves, and grows
as memory comes back from the engine that died. A watchdog expects pings
from the loop that does the work; a loop that hangs stops the pings and the
engine is ended, so that its shadow can serve instead.
Tokens stream to the client one after another; a request that was answered
before the failover keeps its answer, and a new one goes to the new engine.
Model servers load tensors, compile kernels, capture graphs, allocate
blocks, schedule batches, sample tokens, detokenize text and stream it.
Numbers: zero one two three four five six seven eight nine ten hundred
thousand million. Days: Monday Tuesday Wednesday Thursday Friday Saturday
Sunday. Colours: red orange yellow green blue indigo violet black white.
Rivers, mountains, forests, oceans, deserts, islands, valleys and plains.
The quick brown fox jumps over the lazy dog near the quiet riverbank.
"""

_WORDS = sorted(set(w.strip(".,;:") for w in _TEXT.split() if w.strip(".,;:")))


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def training_text():
    """The built-in text, then its words and made-up words of two to four
    syllables in an order fixed by the seed: more distinct pairs of
    symbols, more merges, a vocabulary of a few thousand."""
    lines = [_TEXT]
    rng = np.random.RandomState(SEED)
    for _ in range(6000):
        words = []
        for _ in range(2 + int(rng.randint(0, 6))):
            if rng.randint(0, 2):
                words.append(_WORDS[int(rng.randint(0, len(_WORDS)))])
            else:
                n = 2 + int(rng.randint(0, 3))
                words.append("".join(_SYLLABLES[int(i)] for i in rng.randint(0, len(_SYLLABLES), size=n)))
        lines.append(" ".join(words))
    return lines


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


class Shape:
    """The model's dimensions from its hidden size and layer count."""

    def __init__(self, hidden=HIDDEN, layers=LAYERS):
        if hidden < 2 * HEAD_DIM or hidden % (2 * HEAD_DIM) or not 1 <= layers <= 64:
            raise ValueError(f"hidden must be a multiple of {2 * HEAD_DIM} (got {hidden}), layers 1-64 (got {layers})")
        self.hidden = hidden
        self.layers = layers
        self.intermediate = 2 * hidden
        self.heads = hidden // HEAD_DIM
        self.kv_heads = self.heads // 2


def _weights(vocab, shape):
    rng = np.random.RandomState(SEED)

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    h, m = shape.hidden, shape.intermediate
    w = {"model.embed_tokens.weight": normal(vocab, h, std=1.0)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(shape.heads * HEAD_DIM, h, std=0.08)
        w[p + "self_attn.k_proj.weight"] = normal(shape.kv_heads * HEAD_DIM, h, std=0.08)
        w[p + "self_attn.v_proj.weight"] = normal(shape.kv_heads * HEAD_DIM, h, std=0.08)
        w[p + "self_attn.o_proj.weight"] = normal(h, shape.heads * HEAD_DIM, std=0.08)
        w[p + "mlp.gate_proj.weight"] = normal(m, h, std=0.08)
        w[p + "mlp.up_proj.weight"] = normal(m, h, std=0.08)
        w[p + "mlp.down_proj.weight"] = normal(h, m, std=0.08)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = normal(vocab, h, std=0.5)
    return w


def write(out_dir, shape=None):
    """Writes the model into ``out_dir`` (created; files in it replaced)."""
    shape = shape or Shape()
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer()
    n = tok.get_vocab_size()
    vocab = (n + 63) // 64 * 64  # rows past the tokenizer's are never produced by it
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    for name, obj in (("tokenizer_config.json", tok_config), ("config.json", config),
                      ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(_weights(vocab, shape), weights, metadata={"format": "pt"})
    os.chmod(weights, 0o644)
    return config


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m shadow_vllm.tiny_model")
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        shape = Shape(args.hidden, args.layers)
    except ValueError as e:
        ap.error(str(e))
    config = write(args.out_dir, shape)
    size = os.path.getsize(os.path.join(args.out_dir, "model.safetensors"))
    print(f"tiny_model: {args.out_dir}: Llama, hidden {shape.hidden}, {shape.layers} layers, "
          f"vocab {config['vocab_size']}, {size / (1 << 20):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
