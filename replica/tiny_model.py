"""A tiny local model for tests and the CPU demo, built offline and deterministically.

The *tokenizer*: a Qwen2-style byte-level BPE (NFC normalizer, the
cl100k-style split regex, byte-level alphabet) trained with the ``tokenizers`` library on a corpus
generated here from a fixed word list and a seeded RNG, with the ChatML special tokens and a
ChatML chat template.  It writes ``tokenizer.json`` and ``tokenizer_config.json`` in the Hugging Face
format, so transformers' ``AutoTokenizer`` and vLLM load the same files the router loads: the
router's token ids, hence its block hashes, then agree with the engine's.

The *model* (``--model``): a 2-layer Llama-style checkpoint with seeded random weights
(``config.json``, ``generation_config.json``, ``model.safetensors``: about 3 MB) written beside the
tokenizer files, so a vLLM started on that directory serves the very tokenizer the router uses.
Its output is noise; what the tests need from it is real prefill, a real paged KV cache, real
prefix caching and real KV events.  Writing the weights needs the ``safetensors`` package (it
comes with vLLM, so the model is built with the vLLM environment's Python).

    python -m kvroute.replica.tiny_model --out DIR [--vocab-size N] [--model]
    python -P replica/tiny_model.py --out DIR --model    (an interpreter without kvroute: vLLM's)

It imports nothing of kvroute, so any interpreter with ``tokenizers`` runs it as a script
(``build_command``); ``-P`` keeps its folder, which holds a ``vllm.py``, off ``sys.path``.

Two builds with the same arguments give byte-identical files (checked by the tests), so the
committed copy under ``replica/assets/tiny-tokenizer/`` (shipped in the package) can always be regenerated and compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes their ids (0, 1, 2): the trainer puts special tokens first.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

DEFAULT_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 32768
CORPUS_SEED = 20240611

# The split regex of cl100k/Qwen2 tokenizers: contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen2-family models render it (written for this project): an optional system turn
# (with the tool list when tools are given), user/assistant turns, assistant tool calls as
# <tool_call> JSON, tool results grouped into one user turn as <tool_response> blocks.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each call, answer with a JSON object {\"name\": <name>, \"arguments\": <object>} \
inside <tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages and messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('A system message may only come first.') }}
        {%- endif %}
    {%- elif message['role'] == 'user' or (message['role'] == 'assistant' and not message.get('tool_calls')) %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}
            {{- '\\n' + message['content'] }}
        {%- endif %}
        {%- for tool_call in message['tool_calls'] %}
            {%- if tool_call['function'] is defined %}
                {%- set tool_call = tool_call['function'] %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}
            {{- tool_call['arguments'] | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ---------------------------------------------------------------------------------------------
# The training corpus: generated, never downloaded.  Enough variety (prose, numbers, code, JSON,
# chat framing, accented/CJK/emoji text, odd whitespace) that common strings get merges and
# every byte still encodes (the byte-level alphabet is seeded in full).

_WORDS = """
the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has look
two more write go see number no way could people my than first water been call who oil its now
find long down day did get come made may part over new sound take only little work know place
year live me back give most very after thing our just name good sentence man think say great
where help through much before line right too mean old any same tell boy follow came want show
also around form three small set put end does another well large must big even such because turn
here why ask went men read need land different home us move try kind hand picture again change
off play spell air away animal house point page letter mother answer found study still learn
should world high every near add food between own below country plant last school father keep
tree never start city earth eye light thought head under story saw left few while along might
close something seem next hard open example begin life always those both paper together got group
often run important until children side feet car mile night walk white sea began grow took river
four carry state once book hear stop without second later miss idea enough eat face watch far
really almost let above girl sometimes mountain cut young talk soon list song being leave family
model token cache prefix block router replica request session prompt latency server queue memory
""".split()

_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert".split()

_UNICODE_SNIPPETS = (
    "café", "naïve", "façade", "Größe", "straße", "déjà vu", "coöperate", "São Paulo", "Zürich",
    "東京", "こんにちは", "世界", "你好", "안녕하세요", "Привет", "Ελληνικά", "مرحبا", "שלום",
    "😀", "🚀", "👍🏽", "—", "…", "€", "½", "→", "✓", "\u00a0", "\u3000",
)

_CODE_LINES = (
    "def {f}({a}, {b}):\n    return {a} + {b}\n",
    "for {a} in range({n}):\n    print({a})\n",
    "if {a} is None:\n    raise ValueError(\"{w} must be set\")\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    "const {a} = await fetch(`/api/{w}/${{{b}}}`);\n",
    "SELECT {a}, {b} FROM {w} WHERE id = {n};\n",
    "\t{a}[{n}] = {b}.get(\"{w}\", {n})\n",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) if rng.random() < 0.9 else rng.choice(_NAMES) for _ in range(rng.randint(3, 18))]
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10**rng.randint(1, 6))))
    if rng.random() < 0.1:
        words.insert(rng.randrange(len(words)), rng.choice(_UNICODE_SNIPPETS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".......?!;:")


def _code(rng: random.Random) -> str:
    a, b, w = rng.sample(_WORDS, 3)
    return rng.choice(_CODE_LINES).format(f=a + "_" + b, F=a.capitalize() + b.capitalize(), a=a, b=b, w=w, n=rng.randint(0, 999))


def _json(rng: random.Random) -> str:
    obj = {rng.choice(_WORDS): rng.choice([rng.randint(-99, 9999), rng.choice(_WORDS), rng.random() < 0.5, None])
           for _ in range(rng.randint(1, 5))}
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2])) + "\n"


def _chat_turn(rng: random.Random) -> str:
    role = rng.choice(("system", "user", "assistant", "user", "assistant"))
    body = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
    return f"{role}\n{body}\n"


def training_corpus(seed: int = CORPUS_SEED, documents: int = 6000) -> Iterator[str]:
    """Deterministic training documents: prose, code, JSON, chat turns, whitespace variety."""
    rng = random.Random(seed)
    makers = (_sentence, _sentence, _sentence, _code, _json, _chat_turn)
    for _ in range(documents):
        parts = []
        for _ in range(rng.randint(2, 12)):
            parts.append(rng.choice(makers)(rng))
            parts.append(rng.choice((" ", " ", "\n", "\n\n", "  ", "\n    ", "\t", " \n")))
        yield "".join(parts)


# ---------------------------------------------------------------------------------------------


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = CORPUS_SEED) -> Tokenizer:
    """A Qwen2-style byte-level BPE trained on the generated corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_corpus(seed), trainer)
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    """tokenizer_config.json as transformers writes it for a Qwen2-style fast tokenizer."""
    added = {
        str(idx): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for idx, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = CORPUS_SEED) -> Path:
    """Train the tokenizer and write ``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size, seed)
    # Compact JSON: a third of the pretty-printed size, same content.
    (out / "tokenizer.json").write_text(tok.to_str(pretty=False) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(tok), indent=2, sort_keys=True, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------------
# The model: Llama architecture (what every engine supports), sized to cost nothing.

MODEL_SEED = 20240612
WEIGHT_STD = 0.02  # the usual initializer range: logits stay near uniform, no overflow in bf16


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention, as in real models: 2 KV heads per layer
    # 32 is the smallest head size vLLM's CPU attention backend supports.
    head_dim: int = 32
    max_position_embeddings: int = 8192


def model_config(shape: ModelShape, vocab_size: int) -> dict:
    """config.json of a LlamaForCausalLM (tied embeddings: one matrix instead of two)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_theta": 10000.0,  # the spelling of transformers < 5
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": WEIGHT_STD,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
        "torch_dtype": "float32",
        "use_cache": True,
    }


def generation_config() -> dict:
    # Token ids fixed by SPECIAL_TOKENS: <|endoftext|> = 0, <|im_end|> = 2 ends an assistant turn.
    return {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}


def random_weights(shape: ModelShape, vocab_size: int, seed: int = MODEL_SEED) -> dict:
    """Hugging Face Llama tensor names -> float32 arrays; seeded, so every build is identical."""
    import numpy as np

    rng = np.random.default_rng(seed)
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d

    def normal(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(WEIGHT_STD))

    tensors = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "post_attention_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    return tensors


def build_model(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = CORPUS_SEED,
    model_seed: int = MODEL_SEED,
    shape: ModelShape = ModelShape(),
) -> Path:
    """Write the tokenizer files and a random-weight Llama checkpoint into ``out_dir``.

    The result is a directory ``vllm serve DIR`` (or transformers) loads offline.
    """
    from safetensors.numpy import save_file

    out = build_tokenizer(out_dir, vocab_size, seed)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    (out / "config.json").write_text(json.dumps(model_config(shape, vocab), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2, sort_keys=True) + "\n")
    # "format": "pt" is what loaders check to accept a safetensors file as PyTorch weights.
    save_file(random_weights(shape, vocab, model_seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def model_cache_dir(root: str | Path | None = None) -> Path:
    """Where ``ensure_model`` keeps the built model: named after this file's content, so a
    change to the model's definition builds a fresh copy instead of serving a stale one."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    base = Path(root) if root is not None else Path.home() / ".cache" / "kvroute"
    return base / f"tiny-model-{digest}"


def build_command(python: str | Path, out: str | Path, *args: str) -> list[str]:
    """argv of a build into ``out`` by ``python``, which need not have kvroute: this file as a script."""
    return [str(python), "-P", str(Path(__file__).resolve()), "--out", str(out), *args]


def ensure_model(out_dir: str | Path | None = None, python: str | None = None) -> Path:
    """The tiny model's directory, built first if any file is missing.

    ``python`` is an interpreter with ``safetensors`` (the vLLM environment's): the build runs
    there as a subprocess, so callers in an environment without it (the router's) work too.
    The build goes to a temporary sibling renamed into place: concurrent callers never see a
    half-written checkpoint.
    """
    out = Path(out_dir) if out_dir is not None else model_cache_dir()
    if all((out / name).is_file() for name in MODEL_FILES):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        subprocess.run(build_command(python or sys.executable, tmp, "--model"), check=True, stdout=subprocess.DEVNULL)
        try:
            tmp.rename(out)
        except OSError:  # another caller won the race (or out exists half-built): keep theirs
            if not all((out / name).is_file() for name in MODEL_FILES):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.replica.tiny_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the files into")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=CORPUS_SEED, help="seed of the generated training corpus")
    parser.add_argument("--model", action="store_true",
                        help="also write a random-weight Llama checkpoint (needs the safetensors package)")
    parser.add_argument("--model-seed", type=int, default=MODEL_SEED, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.model:
        out = build_model(args.out, args.vocab_size, args.seed, args.model_seed)
    else:
        out = build_tokenizer(args.out, args.vocab_size, args.seed)
    for path in sorted(out.iterdir()):
        print(f"{path}  {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
