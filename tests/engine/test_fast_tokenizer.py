"""keel's FastTokenizer (keel/engine/fast_tokenizer.py): in a folder keel converted, the
tokenizer transformers built is kept as a snapshot and served without transformers, with the
same answers as transformers' tokenizer; anything it does not do itself goes to transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from keel.engine.fast_tokenizer import FastTokenizer, load_snapshot, save_snapshot
from keel.engine.llm import load_tokenizer
from keel.model_executor.gguf_loader import TOKENIZER_DIR
from keel.model_executor.hf_config import load_hf_config
from tests.hf_models import make_hf_model

# Exercises what transformers' sandbox adds (tojson with its options, namespace, dict,
# raise_exception, loop controls, trimmed blocks) and the special tokens it passes in.
RICH_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- if messages[0]['role'] == 'system' %}{{ bos_token }}[SYS] {{ messages[0]['content'] }}
{% endif -%}
{%- for m in messages %}
  {%- if m['role'] == 'system' %}{% continue %}{% endif %}
  {%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {%- set ns.n = ns.n + 1 %}
{{ ns.n }}|{{ m['role'] }}|{{ m['content'] | trim }}|{{ m | tojson }}|{{ dict(k=m['role']) | tojson(indent=1) }}{{ eos_token }}
  {%- if ns.n > 5 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<s>assistant{% if flag is defined and flag %}+{% endif %}: {% endif %}"""

TEXTS = ["hello world, the quick brown fox", "", "  leading and trailing  ",
         "<s>special</s> inside text</s>", "naïve café 東京 🙂 ∑", "line\nbreaks\ttabs  "]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello \"quoted\""},
     {"role": "assistant", "content": " spaced "}, {"role": "user", "content": "é🙂"}],
    [{"role": "user", "content": "x", "name": None}],  # a None value is dropped, as transformers does
]


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory):
    """A small llama folder with plain RoPE, whose config keel reads itself, like the default
    model's (the test models' llama uses llama3 scaling, which keel leaves to AutoConfig)."""
    return make_hf_model("llama", tmp_path_factory.mktemp("plain_llama"),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture
def keel_folder(plain_llama, tmp_path):
    """A copy of it marked as a folder keel converted (keel_gguf/)."""
    folder = tmp_path / "converted"
    shutil.copytree(plain_llama, folder)
    (folder / "keel_gguf").mkdir()
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    return folder


def _load(folder):
    return load_tokenizer(folder, load_hf_config(folder))


def test_snapshot_answers_as_transformers(keel_folder):
    ref = _load(keel_folder)  # the first load: transformers', which keeps the snapshot
    assert type(ref).__name__ == "TokenizersBackend"
    assert (keel_folder / TOKENIZER_DIR / "meta.json").is_file()
    fast = _load(keel_folder)
    assert isinstance(fast, FastTokenizer)

    for text in TEXTS:
        for add in (True, False):
            assert fast.encode(text, add_special_tokens=add) == ref.encode(
                text, add_special_tokens=add), text
    ids = ref.encode("<s>hi there</s> é🙂 fox")
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip)
        assert fast.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
            ref.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert fast.decode(ids[1]) == ref.decode(ids[1])
    assert fast.convert_ids_to_tokens(ids[1]) == ref.convert_ids_to_tokens(ids[1])
    tokens = ref.convert_ids_to_tokens(ids)
    assert fast.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids", "all_special_tokens", "special_tokens_map", "chat_template",
                 "vocab_size", "bos_token", "eos_token", "pad_token", "model_max_length"):
        assert getattr(fast, name) == getattr(ref, name), name
    assert len(fast) == len(ref)
    assert {i: str(t) for i, t in fast.added_tokens_decoder.items()} == {
        i: str(t) for i, t in ref.added_tokens_decoder.items()}

    for chat in CHATS:
        for gen in (True, False):
            assert fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    assert fast.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False,
                                    flag=True) == ref.apply_chat_template(
        CHATS[0], add_generation_prompt=True, tokenize=False, flag=True)
    assert fast.apply_chat_template(CHATS, tokenize=False) == ref.apply_chat_template(
        CHATS, tokenize=False)  # a batch of conversations
    # The template's own error, as transformers raises it.
    with pytest.raises(Exception, match="bad role tool") as here:
        fast.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="bad role tool") as there:
        ref.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    assert type(here.value) is type(there.value)
    assert fast._full is None  # nothing above loaded transformers' tokenizer


def test_the_rest_goes_to_transformers(keel_folder):
    ref = _load(keel_folder)
    fast = _load(keel_folder)
    assert isinstance(fast, FastTokenizer) and fast._full is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert fast.apply_chat_template(CHATS[0], tools=tools, tokenize=False) == \
        ref.apply_chat_template(CHATS[0], tools=tools, tokenize=False)
    assert fast._full is not None  # tools: transformers' apply_chat_template
    assert fast.apply_chat_template(CHATS[1], add_generation_prompt=True)["input_ids"] == \
        ref.apply_chat_template(CHATS[1], add_generation_prompt=True)["input_ids"]
    assert fast.tokenize("hello world") == ref.tokenize("hello world")  # not FastTokenizer's
    assert fast("hello world", truncation=True, max_length=2)["input_ids"] == \
        ref("hello world", truncation=True, max_length=2)["input_ids"]
    with pytest.raises(AttributeError):
        fast.no_such_attribute  # noqa: B018


def test_stale_or_broken_snapshots_are_not_read(keel_folder, plain_llama, tmp_path):
    _load(keel_folder)
    assert isinstance(_load(keel_folder), FastTokenizer)
    # The template changed: the snapshot is stale, transformers loads it and a new one is kept.
    (keel_folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    again = _load(keel_folder)
    assert type(again).__name__ == "TokenizersBackend"
    fast = _load(keel_folder)
    assert isinstance(fast, FastTokenizer)
    assert fast.apply_chat_template(CHATS[0], tokenize=False) == "hi!"
    # A broken snapshot file: not read, and replaced by the next load through transformers.
    (keel_folder / TOKENIZER_DIR / "tokenizer.json").write_text("{not json")
    assert load_snapshot(keel_folder) is None
    assert type(_load(keel_folder)).__name__ == "TokenizersBackend"
    assert isinstance(_load(keel_folder), FastTokenizer)
    # A record without one of its fields (a snapshot of another keel): not read.
    meta_path = keel_folder / TOKENIZER_DIR / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "eos_token_id"}))
    assert load_snapshot(keel_folder) is None
    # Another library version than the snapshot's: stale.
    meta["fingerprint"]["versions"]["transformers"] = "0.0.1"
    meta_path.write_text(json.dumps(meta))
    assert load_snapshot(keel_folder) is None
    # A folder keel did not convert gets no snapshot: transformers' tokenizer every time.
    plain = tmp_path / "plain"
    shutil.copytree(plain_llama, plain)
    assert not save_snapshot(_load(plain), plain)
    assert not (plain / TOKENIZER_DIR).exists()
    assert type(_load(plain)).__name__ == "TokenizersBackend"


def test_chat_and_generate_without_importing_transformers(keel_folder):
    """The point of it: LLM.chat on a converted folder, with its snapshot, tokenizes, renders
    the chat template and detokenizes without transformers, and gets what transformers would."""
    ref = _load(keel_folder)
    chat = [{"role": "user", "content": "hello world"}]
    prompt_ids = ref.encode(ref.apply_chat_template(chat, add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
    probe = (
        "import json, sys\n"
        "from keel import LLM, SamplingParams\n"
        f"llm = LLM(model={str(keel_folder)!r}, kv_cache_memory_gib=0.05, max_model_len=256)\n"
        "out = llm.chat([{'role': 'user', 'content': 'hello world'}],\n"
        "               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),\n"
        "               use_tqdm=False)[0]\n"
        "print(json.dumps({'transformers': sorted(m for m in sys.modules\n"
        "                                         if m.split('.')[0] == 'transformers'),\n"
        "                  'tokenizer': type(llm.tokenizer).__name__,\n"
        "                  'prompt': out.prompt_token_ids, 'ids': out.outputs[0].token_ids,\n"
        "                  'text': out.outputs[0].text}))\n")
    proc = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokenizer"] == "FastTokenizer"
    assert got["transformers"] == []
    assert got["prompt"] == prompt_ids
    assert got["text"] == ref.decode(got["ids"], skip_special_tokens=True)


def test_default_model_tokenizer(tmp_path):
    """The default model's own tokenizer (a 49k-token byte-level BPE and its chat template),
    from a copy of its converted folder: the snapshot answers as transformers does."""
    from keel.config import resolve_model_path

    source = resolve_model_path(None)
    folder = tmp_path / "default"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    (folder / "keel_gguf").mkdir()
    ref = _load(folder)
    fast = _load(folder)
    assert type(ref).__name__ == "TokenizersBackend" and isinstance(fast, FastTokenizer)
    texts = [*TEXTS, "<|im_start|>user\nWhat is the capital of France?<|im_end|>",
             "def f(x):\n    return x ** 2  # 🙂"]
    for text in texts:
        ids = ref.encode(text)
        assert fast.encode(text) == ids, text
        assert fast.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert fast.decode(ids) == ref.decode(ids)
    for chat in CHATS:
        assert fast.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert fast.eos_token_id == ref.eos_token_id
    assert fast.all_special_ids == ref.all_special_ids
    assert fast._full is None
