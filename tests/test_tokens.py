"""kvroute.common.tokens and the tiny tokenizer of kvroute.replica.tiny_model.

The reference for every encoding is ``tokenizers`` itself encoding the whole string, loaded fresh
from the same tokenizer.json: the segment cache must never change a single id.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HfTokenizer

from kvroute.replica import tiny_model
from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.common.tokens import (
    ChatTemplateError,
    Tokenizer,
    TokenizerLoadError,
    TokenizerNotFoundError,
    TokenizerRegistry,
    UnsupportedContentError,
    detect_content_format,
)

ROOT = Path(__file__).resolve().parents[1]
ASSET = TINY_TOKENIZER  # the committed, packaged copy
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(ASSET)


@pytest.fixture(scope="module")
def reference() -> HfTokenizer:
    return HfTokenizer.from_file(str(ASSET / "tokenizer.json"))


# ------------------------------------------------------------------ the asset


def test_tokenizer_builds_deterministically_and_matches_committed_asset(tmp_path):
    tiny_model.build_tokenizer(tmp_path / "a")
    # Second build in a fresh process (other hash seeds), through the CLI.
    subprocess.run([sys.executable, "-m", "kvroute.replica.tiny_model", "--out", str(tmp_path / "b")], cwd=ROOT, check=True, capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        built = (tmp_path / "a" / name).read_bytes()
        assert built == (tmp_path / "b" / name).read_bytes(), f"two builds of {name} differ"
        assert built == (ASSET / name).read_bytes(), (
            f"committed {name} is stale: regenerate with `python -m kvroute.replica.tiny_model --out replica/assets/tiny-tokenizer`")
    total = sum(p.stat().st_size for p in ASSET.iterdir())
    assert total < 300_000, f"asset is {total} bytes"


def test_asset_is_in_hugging_face_format(reference):
    config = json.loads((ASSET / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["add_bos_token"] is False
    assert config["model_max_length"] > 0
    assert "<|im_start|>" in config["chat_template"]
    # added_tokens_decoder agrees with tokenizer.json, and every named special token exists.
    for idx, spec in config["added_tokens_decoder"].items():
        assert reference.token_to_id(spec["content"]) == int(idx)
        assert spec["special"] and not spec["normalized"]
    for key in ("bos_token", "eos_token", "pad_token"):
        assert reference.token_to_id(config[key]) is not None
    assert [reference.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]


# ------------------------------------------------------------------ chat rendering

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Zürich?"},
]
EXPECTED_CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
)


def test_render_chat_is_chatml(tok):
    assert tok.render_chat(CHAT) == EXPECTED_CHATML + "<|im_start|>assistant\n"
    assert tok.render_chat(CHAT, add_generation_prompt=False) == EXPECTED_CHATML
    assert tok.render_chat(CHAT[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_render_chat_content_parts_are_flattened_like_vllm(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}, "again"]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
             {"role": "user", "content": None}]
    assert tok.render_chat(parts, add_generation_prompt=False) == (
        "<|im_start|>user\nHi\nthere\nagain<|im_end|>\n<|im_start|>assistant\nNo.<|im_end|>\n<|im_start|>user\n<|im_end|>\n")
    with pytest.raises(UnsupportedContentError):
        tok.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_render_chat_tools_and_tool_calls(tok):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Zürich"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "warm"}]},
    ]
    rendered = tok.render_chat(messages, tools=tools)
    # tojson as transformers defines it: no HTML escaping, non-ASCII kept, keys in order.
    assert ('\n{"type": "function", "function": {"name": "weather", "description": null, '
            '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>') in rendered
    # String arguments were decoded to an object, as vLLM does before rendering.
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n' in rendered
    assert rendered.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="JSON"):
        tok.render_chat([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_tools_are_dumped_as_vllm_dumps_them(tok):
    # vLLM validates tools into pydantic models and dumps them: absent optional fields become
    # null, declared fields first, extra fields kept after them.
    rendered = tok.render_chat(CHAT[1:2], tools=[{"function": {"strict": True, "name": "f"}, "x": 1}])
    assert '\n{"type": "function", "function": {"name": "f", "description": null, "parameters": null, "strict": true}, "x": 1}\n' in rendered
    with pytest.raises(ChatTemplateError, match="name"):
        tok.render_chat(CHAT, tools=[{"type": "function", "function": {}}])


def test_render_chat_template_errors_are_chat_template_errors(tok):
    with pytest.raises(ChatTemplateError, match="only come first"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="Unknown role"):
        tok.render_chat([{"role": "wizard", "content": "a"}])
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"content": "no role"}])
    with pytest.raises(ChatTemplateError):
        tok.render_chat(CHAT, add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_cuts_after_the_last_text(tok):
    messages = CHAT + [{"role": "assistant", "content": "The weather is"}]
    assert tok.render_chat(messages, add_generation_prompt=False, continue_final_message=True) == (
        EXPECTED_CHATML + "<|im_start|>assistant\nThe weather is")


def test_template_globals_and_kwargs(tok):
    template = ("{{ bos_token }}|{{ eos_token }}|{{ additional_special_tokens | length }}|{{ custom }}|"
                "{{ {'b': '<x>', 'a': 1} | tojson }}|{{ strftime_now('%Y') | length }}|"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
                "{% generation %}G{% endgeneration %}")
    out = tok.render_chat(CHAT, chat_template=template, custom="kw", messages="ignored")
    assert out == '<|endoftext|>|<|im_end|>|2|kw|{"b": "<x>", "a": 1}|4|You are terse.G'
    # A request's chat_template_kwargs override the flags, as in vLLM, but never the template.
    flags = tok.render_chat(CHAT, template_kwargs={"add_generation_prompt": False, "chat_template": "{{ oops }}"})
    assert flags == EXPECTED_CHATML


def test_openai_content_format_keeps_parts():
    template = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    assert detect_content_format(template) == "openai"
    assert detect_content_format(tiny_model.CHAT_TEMPLATE) == "string"
    tok = Tokenizer.from_dir(ASSET, chat_template=template)
    assert tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}, "c"]}]) == "[a][b][c]"


# ------------------------------------------------------------------ segment-cached encoding == whole-string encoding

FRAGMENTS = SPECIALS + [
    " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u00a0", "\u3000", "\u2028", "\x1c",
    "a", "hello", "Hello", " world", "'s", "'LL", "123", "4.5", "café", "e\u0301", "\u0301", "東京", "😀", "👍🏽",
    "<|", "|>", "<|im_", "im_end|>", "<|im_start", "def f(x):\n    return x\n", '{"k": [1, 2]}',
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=30).map("".join)
contents = st.one_of(texts, st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), min_size=1, max_size=3))


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(contents)})
    for i in range(draw(st.integers(1, 8))):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(contents)})
    return messages


@PROPERTY
@given(text=texts)
def test_encode_equals_whole_string_encoding(tok, reference, text):
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tok.encode_prompt(text) == reference.encode(text, add_special_tokens=True).ids


@PROPERTY
@given(messages=conversations(), add_generation_prompt=st.booleans())
def test_encode_chat_equals_whole_string_encoding(tok, reference, messages, add_generation_prompt):
    rendered = tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.encode(rendered, add_special_tokens=False).ids
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected
    # Again, now from the cache, and growing the conversation by one turn (the multi-turn case).
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected
    longer = messages + [{"role": "user", "content": "and then?"}]
    assert tok.encode_chat(longer) == reference.encode(tok.render_chat(longer), add_special_tokens=False).ids


def test_multi_turn_reuses_cached_segments(tmp_path):
    tok = Tokenizer.from_dir(ASSET)
    tok.encode_chat(CHAT)
    before = tok.cache.stats()
    tok.encode_chat(CHAT + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}])
    after = tok.cache.stats()
    # Only the two new turns (and the new generation prompt segment) are tokenized.
    assert after.misses - before.misses == 2
    assert after.hits - before.hits >= len(CHAT) * 2 - 1


def _variant_dir(tmp_path: Path, config_update: dict, edit=None) -> Path:
    """A copy of the asset with an edited tokenizer.json and/or tokenizer_config.json."""
    out = tmp_path / "variant"
    out.mkdir()
    backend = HfTokenizer.from_file(str(ASSET / "tokenizer.json"))
    if edit:
        edit(backend)
    backend.save(str(out / "tokenizer.json"))
    config = json.loads((ASSET / "tokenizer_config.json").read_text())
    config.update(config_update)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _strip_tokens(backend: HfTokenizer) -> None:
    backend.add_special_tokens([AddedToken("<|end|>", lstrip=True, rstrip=True, normalized=False),
                                AddedToken("<|pad|>", rstrip=True, normalized=False)])
    backend.add_tokens([AddedToken("kvroute", normalized=True)])


@pytest.fixture(scope="module")
def strip_variant(tmp_path_factory) -> tuple[Tokenizer, HfTokenizer]:
    d = _variant_dir(tmp_path_factory.mktemp("strip"), {}, _strip_tokens)
    return Tokenizer.from_dir(d), HfTokenizer.from_file(str(d / "tokenizer.json"))


STRIP_FRAGMENTS = ["<|end|>", "<|pad|>", "kvroute", "KVROUTE", " ", "  ", "\n", "\t", "\u00a0", "\u3000", "\x1c", "x", "é"]


@PROPERTY
@given(text=st.lists(st.sampled_from(STRIP_FRAGMENTS + FRAGMENTS), max_size=30).map("".join))
def test_lstrip_rstrip_and_normalized_added_tokens_stay_exact(strip_variant, text):
    tok, reference = strip_variant
    assert tok.segmented
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_config_add_bos_token_wraps_prompts_but_not_chats(tmp_path, reference):
    tok = Tokenizer.from_dir(_variant_dir(tmp_path, {"add_bos_token": True}))
    bos = reference.token_to_id("<|endoftext|>")
    text = "Hello<|im_end|> there"
    assert tok.encode_prompt(text) == [bos] + reference.encode(text, add_special_tokens=False).ids
    assert tok.encode_prompt(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    assert tok.encode_chat(CHAT)[0] == reference.token_to_id("<|im_start|>")  # vLLM: add_special_tokens=False for chat


def test_config_special_tokens_missing_from_tokenizer_json_are_added(tmp_path):
    tok = Tokenizer.from_dir(_variant_dir(tmp_path, {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|extra|>"]}))
    extra = tok.token_to_id("<|extra|>")
    assert extra is not None
    assert tok.encode("a<|extra|>b").count(extra) == 1
    assert tok.decode(tok.encode("a<|extra|>b"), skip_special_tokens=True) == "ab"
    assert tok.render_chat(CHAT, chat_template="{{ additional_special_tokens | join(',') }}") == "<|im_start|>,<|im_end|>,<|extra|>"


def _train_small(tmp_path: Path, name: str, pre_tokenizer, normalizer=None) -> tuple[Tokenizer, HfTokenizer]:
    backend = HfTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        backend.normalizer = normalizer
    corpus = ["hello world and more words here", "the world says hello  again\n\nok"] * 50
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path / name
    d.mkdir()
    backend.save(str(d / "tokenizer.json"))
    return Tokenizer.from_dir(d), backend


SMALL_FRAGMENTS = ["hello", " world", "  ", " ", "\n", "</s>", "<s>", "x", "the", "ok", "\u00a0"]
PRE_TOKENIZERS = {
    "byte-level, prefix space": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=True), None, True),
    "metaspace always": (lambda: pre_tokenizers.Metaspace(prepend_scheme="always"), None, True),
    "metaspace never": (lambda: pre_tokenizers.Metaspace(prepend_scheme="never"), None, True),
    "whitespace + prepend normalizer": (lambda: pre_tokenizers.WhitespaceSplit(), lambda: normalizers.Prepend("_"), True),
    "metaspace first (position-dependent)": (lambda: pre_tokenizers.Metaspace(prepend_scheme="first"), None, False),
}


@pytest.mark.parametrize("kind", list(PRE_TOKENIZERS))
def test_other_pre_tokenizers_split_exactly_or_fall_back(tmp_path, kind):
    make_pre, make_norm, splits = PRE_TOKENIZERS[kind]
    tok, backend = _train_small(tmp_path, "t", make_pre(), make_norm() if make_norm else None)
    assert tok.segmented is splits

    @settings(max_examples=100, deadline=None)
    @given(text=st.lists(st.sampled_from(SMALL_FRAGMENTS), max_size=14).map("".join))
    def check(text):
        assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids

    check()


def test_position_dependent_pre_tokenizer_falls_back_to_whole_strings(tmp_path):
    # Metaspace(prepend_scheme="first") prepends "▁" only to the piece at the start of the input,
    # so encoding the pieces separately would differ: the tokenizer must not split.
    backend = HfTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = ["hello world and more words here", "the world says hello"] * 50
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    d = tmp_path / "metaspace"
    d.mkdir()
    backend.save(str(d / "tokenizer.json"))
    text = "hello</s>world</s> hello"
    pieces = ["hello", "</s>", "world", "</s>", " hello"]
    naive = [i for p in pieces for i in backend.encode(p, add_special_tokens=False).ids]
    whole = backend.encode(text, add_special_tokens=False).ids
    assert naive != whole  # the reason for the fallback
    tok = Tokenizer.from_dir(d)
    assert not tok.segmented
    assert tok.encode(text) == whole
    assert tok.encode(text) == whole  # cached whole string


# ------------------------------------------------------------------ cache bounds


def test_cache_is_bounded_by_chars_and_entries():
    tok = Tokenizer.from_dir(ASSET, cache_max_chars=400, cache_max_entries=5)
    for i in range(40):
        tok.encode(f"segment number {i} with some words<|im_end|>")
        assert len(tok.cache) <= 5 and tok.cache.chars <= 400
    stats = tok.cache.stats()
    assert stats.evictions > 0 and stats.entries == len(tok.cache)
    # Least recently used goes first: touching an old entry keeps it.
    tok = Tokenizer.from_dir(ASSET, cache_max_chars=10_000, cache_max_entries=3)
    for s in ("one", "two", "three"):
        tok.encode(s)
    tok.encode("one")
    tok.encode("four")
    assert "one" in tok.cache and "two" not in tok.cache
    # A segment over a quarter of the char budget is not cached at all.
    tok = Tokenizer.from_dir(ASSET, cache_max_chars=100)
    tok.encode("x" * 26 + "<|im_end|>" + "short")
    assert "x" * 26 not in tok.cache and "short" in tok.cache


# ------------------------------------------------------------------ async


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


async def test_async_encoding_uses_the_pool_only_for_long_new_text(reference):
    pool = CountingExecutor()
    try:
        tok = Tokenizer.from_dir(ASSET, executor=pool, inline_max_chars=1000)
        small = await tok.aencode_chat(CHAT)
        assert small == reference.encode(tok.render_chat(CHAT), add_special_tokens=False).ids
        assert pool.submitted == 0
        long_history = CHAT + [{"role": "assistant", "content": " ".join(tiny_model.training_corpus(3, 4))}]
        expected = reference.encode(tok.render_chat(long_history), add_special_tokens=False).ids
        results = await asyncio.gather(tok.aencode_chat(long_history), tok.aencode_prompt("x" * 5000))
        assert results[0] == expected
        assert results[1] == reference.encode("x" * 5000, add_special_tokens=True).ids
        assert pool.submitted == 2
        # The long turn is cached now: one more short turn stays on the event loop.
        assert await tok.aencode_chat(long_history + [{"role": "user", "content": "ok"}]) == reference.encode(
            tok.render_chat(long_history + [{"role": "user", "content": "ok"}]), add_special_tokens=False).ids
        assert pool.submitted == 2
    finally:
        pool.shutdown()


# ------------------------------------------------------------------ decode, errors, registry


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_missing_directory_errors_are_clear(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError, match=r"no tokenizer\.json .*config\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="cannot load"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((ASSET / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerNotFoundError, match="chat template"):
        Tokenizer.from_dir(ASSET, chat_template=tmp_path / "missing.jinja")


def test_no_chat_template_is_a_clear_error(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((ASSET / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(d)
    assert tok.encode_prompt("hello") == tok.encode("hello")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat(CHAT)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    assert Tokenizer.from_dir(d).render_chat(CHAT[:2]) == "system:You are terse.;user:Hi;"
    assert Tokenizer.from_dir(ASSET, chat_template=d / "chat_template.jinja").render_chat(CHAT[:1]) == "system:You are terse.;"


def test_registry_maps_models_to_tokenizers(tmp_path):
    registry = TokenizerRegistry.from_config({"tiny": ASSET, "tiny-lora": ASSET})
    assert registry["tiny"] is registry["tiny-lora"]  # one directory, one tokenizer and cache
    assert registry.models() == ["tiny", "tiny-lora"] and len(registry.tokenizers()) == 1
    assert "other" not in registry and registry.get("other") is None
    with pytest.raises(KeyError, match="no tokenizer configured for model 'other'"):
        registry["other"]
    with_default = TokenizerRegistry.from_config({}, default_dir=ASSET)
    assert with_default["anything"].encode("hi") == registry["tiny"].encode("hi")
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        TokenizerRegistry.from_config({"tiny": tmp_path / "missing"})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["Hello", " world", "<|im_start|>", "<|im_end|>", "\n", "  ", "é漢", "user"]), max_size=30),
       st.booleans())
def test_aencode_bytes_equals_the_bytes_of_aencode(pieces, special):
    """The router hashes the bytes form; it must be exactly the ids of the list form."""
    from kvroute.common.blocks import token_bytes

    tokenizer = Tokenizer.from_dir(ASSET)
    text = "".join(pieces)

    async def both() -> tuple[bytes, list[int]]:
        first = await tokenizer.aencode_bytes(text, add_special_tokens=special)
        again = await tokenizer.aencode_bytes(text, add_special_tokens=special)  # from the cache
        assert first == again
        return first, await tokenizer.aencode(text, add_special_tokens=special)

    data, ids = asyncio.run(both())
    assert data == token_bytes(ids)


# ------------------------------------------------------------------ length limits and long texts


def test_a_long_text_encodes_exactly_off_the_loop_and_a_limit_refuses_it(reference):
    from kvroute.common.blocks import token_bytes
    from kvroute.common.tokens import PromptTooLong

    tok = Tokenizer.from_dir(ASSET)
    text = ("Hello world<|im_end|>\n" + " ".join(tiny_model.training_corpus(5, 40))) * 4  # > 64 K chars: the pool path
    assert len(text) > 65_536
    expected = reference.encode(text, add_special_tokens=False).ids
    # one piece of 300 K characters (no special token to cut at): encoded in verified chunks
    long_piece = " ".join(tiny_model.training_corpus(6, 600))
    for special in SPECIALS:
        long_piece = long_piece.replace(special, "")
    long_piece = long_piece[:300_000]
    assert len(long_piece) == 300_000
    assert len(long_piece) == 300_000
    long_expected = reference.encode(long_piece, add_special_tokens=False).ids

    async def run():
        assert await tok.aencode_bytes(text, max_tokens=len(expected)) == token_bytes(expected)
        with pytest.raises(PromptTooLong, match=f"is {len(expected)} tokens long, more than the limit of {len(expected) - 1}"):
            await tok.aencode_bytes(text, max_tokens=len(expected) - 1)
        # far over the limit: refused after the first chunks, "at least" what they held
        with pytest.raises(PromptTooLong, match="at least") as err:
            await tok.aencode_bytes(long_piece, max_tokens=1000)
        assert 1000 < err.value.tokens < len(long_expected)
        assert await tok.aencode_bytes(long_piece) == token_bytes(long_expected)

    asyncio.run(run())


LONG_TEXTS = {
    "prose and code": " ".join(tiny_model.training_corpus(11, 60))[:20_000],
    "whitespace runs": ("word " + " " * 700 + "x\n\n\n") * 25,
    "no spaces (CJK)": "東京の天気は晴れです。" * 2000,
    "one long word": "a" * 9000 + "b" * 9000,
    "mixed": "".join(["  ", "\n", "\t", "é", "東", "ab", "1234", "'s", " the", "\n\n  "][(i * 7919) % 10] for i in range(8000)),
}


@pytest.mark.parametrize("name", list(LONG_TEXTS))
def test_chunked_encoding_equals_whole_string_encoding(reference, name):
    from kvroute.common.tokens.long_text import encode_long

    text = LONG_TEXTS[name]
    got = encode_long(lambda texts: reference.encode_batch(texts, add_special_tokens=False), text, chunk_chars=2000)
    assert list(got) == reference.encode(text, add_special_tokens=False).ids


async def test_a_large_chat_renders_and_tokenizes_on_the_pool(reference):
    """The event loop only dispatches: a chat of many turns is rendered on the pool as well."""
    pool = CountingExecutor()
    try:
        tok = Tokenizer.from_dir(ASSET, executor=pool)
        chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words and more words " * 10}
                for i in range(400)]
        ids = await tok.aencode_chat(chat)
        assert ids == reference.encode(tok.render_chat(chat), add_special_tokens=False).ids
        assert pool.submitted == 2  # the render, then the long text's split + encode
    finally:
        pool.shutdown()


# ------------------------------------------------------------------ lower bounds before tokenizing (bounds.py)

ROLES = ["system", "user", "assistant", "tool", "developer"]


@st.composite
def any_chats(draw):
    """Any sequence of roles (the template renders each as it does), contents of any text."""
    return [{"role": draw(st.sampled_from(ROLES)), "content": draw(texts)} for _ in range(draw(st.integers(1, 12)))]


def test_the_tiny_template_marks_user_and_assistant_messages(tok):
    assert tok.message_tokens["user"] == tok.message_tokens["assistant"] == 2  # <|im_start|> and <|im_end|>
    assert tok.max_chars_per_token == 4 * max(len(p) for p in tok.backend.get_vocab())  # NFC: up to 4 to 1


@PROPERTY
@given(messages=any_chats(), add_generation_prompt=st.booleans(), continue_final=st.booleans())
def test_the_message_bound_never_exceeds_the_tokens(tok, messages, add_generation_prompt, continue_final):
    """What refuses a chat before it is rendered is at most its real count, however it is rendered."""
    try:
        ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt and not continue_final,
                              continue_final_message=continue_final)
    except ChatTemplateError:
        return
    roles = [m["role"] for m in messages]
    assert tok.chat_tokens_at_least(roles[:-1]) <= len(ids)


@PROPERTY
@given(text=texts)
def test_the_character_bound_never_exceeds_the_tokens(tok, text):
    assert -(-len(text) // tok.max_chars_per_token) <= len(tok.encode(text))


def test_the_character_bound_refuses_without_tokenizing(tok):
    from kvroute.common.tokens import PromptTooLong

    text = "x" * (tok.max_chars_per_token * 100 + 1)
    with pytest.raises(PromptTooLong, match="at least 101 tokens"):
        asyncio.run(tok.aencode_bytes(text, max_tokens=100))
    assert len(asyncio.run(tok.aencode_bytes("x " * 40, max_tokens=100))) // 4 <= 100  # a short one is encoded


@pytest.mark.parametrize("normalizer, pre_tokenizer, model, bounded", [
    (None, {"type": "ByteLevel"}, {"type": "BPE", "vocab": {"ab": 0, "abcd": 1}}, 4),
    ({"type": "NFKC"}, {"type": "Metaspace"}, {"type": "BPE", "vocab": {"ab": 0}}, 8),
    ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, None, {"type": "BPE", "vocab": {"a": 0}}, 2),
    ({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}, None, {"type": "BPE", "vocab": {"a": 0}}, None),
    ({"type": "BertNormalizer"}, None, {"type": "BPE", "vocab": {"a": 0}}, None),
    (None, {"type": "Whitespace"}, {"type": "BPE", "vocab": {"a": 0}}, None),
    (None, {"type": "Split", "behavior": "Removed"}, {"type": "BPE", "vocab": {"a": 0}}, None),
    (None, None, {"type": "WordPiece", "vocab": {"a": 0}}, None),
    (None, None, {"type": "BPE", "vocab": {"a": 0}, "unk_token": "<unk>", "fuse_unk": True}, None),
    (None, None, {"type": "Unigram", "vocab": [["abc", -1.0]], "byte_fallback": True}, 3),
    (None, None, {"type": "Unigram", "vocab": [["abc", -1.0]]}, None),
])
def test_the_character_bound_holds_only_where_no_step_drops_characters(normalizer, pre_tokenizer, model, bounded):
    from kvroute.common.tokens.bounds import max_chars_per_token

    config = {"normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "model": model}
    assert max_chars_per_token(config, ["<s>"]) == (max(bounded, 3) if bounded else None)


def test_a_template_that_drops_messages_gives_no_message_bound(tmp_path):
    """A template that renders only the last message: no role counts."""
    d = tmp_path / "last-only"
    d.mkdir()
    (d / "tokenizer.json").write_text((ASSET / "tokenizer.json").read_text())
    config = json.loads((ASSET / "tokenizer_config.json").read_text())
    config["chat_template"] = "<|im_start|>{{ messages[-1]['content'] }}<|im_end|>"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert set(Tokenizer.from_dir(d).message_tokens.values()) == {0}
