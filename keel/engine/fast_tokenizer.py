"""The tokenizer of a folder keel converted from a GGUF file (the default model's), served by
`tokenizers` and `jinja2` alone, so that `keel generate` reaches its first token without
importing transformers (~1-1.5 s of a ~4-7 s start on 2 cores; BENCHMARKS.md, "Start-up").

The first load of such a folder goes through transformers (`TokenizersBackend`, what
AutoTokenizer returns there) and keeps a *snapshot* of what it built in the folder's
`keel_gguf/tokenizer/`: the Rust tokenizer exactly as transformers left it (special tokens
added, truncation and padding set), and the attributes keel reads (special ids, the chat
template). Later loads read the snapshot back, as long as the tokenizer files and the
transformers and tokenizers versions are those it was made from.

`FastTokenizer` answers what the engine asks on every request (encode, decode, the special
ids, the ids' tokens, a chat template over plain messages) as `TokenizersBackend` would: the
same Rust calls on the same tokenizer, and the template rendered by jinja2 in a sandbox set
up as transformers sets up its own. Anything else (tools or documents in a chat, truncation,
`tokenize=True`, any other attribute) loads transformers' tokenizer once and is passed to it,
so a caller sees the same answers either way; only `isinstance` tells them apart."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from keel.model_executor.gguf_loader import KEEL_DIR, TOKENIZER_DIR
from keel.utils import replace_atomically

logger = logging.getLogger(__name__)

_FORMAT = 1
# The files transformers builds a TokenizersBackend from.
_SOURCES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "chat_template.json", "added_tokens.json")
_PLAIN = (str, int, float, bool, type(None))  # exact types: transformers rebuilds others


def _fingerprint(folder: Path) -> dict[str, Any]:
    """What a snapshot is valid for: the tokenizer files' contents and the libraries'
    versions."""
    files = {}
    for name in _SOURCES:
        path = folder / name
        if path.is_file():
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    versions = {}
    for lib in ("transformers", "tokenizers", "jinja2"):
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    return {"format": _FORMAT, "files": files, "versions": versions}


def save_snapshot(tokenizer: Any, folder: str | os.PathLike) -> bool:
    """Keep what `tokenizer` (transformers' TokenizersBackend, loaded from `folder`) built, in a
    folder keel converted. False where the folder is not keel's, or the tokenizer does
    something FastTokenizer would not do the same way (then every load goes through
    transformers, as before)."""
    folder = Path(folder)
    if (not (folder / KEEL_DIR).is_dir()
            or type(tokenizer).__name__ != "TokenizersBackend"):
        return False
    template, special_map = tokenizer.chat_template, dict(tokenizer.special_tokens_map)
    plain_map = all(type(v) is str or (type(v) is list and all(type(t) is str for t in v))
                    for v in special_map.values())
    if (getattr(tokenizer, "clean_up_tokenization_spaces", False)
            or getattr(tokenizer, "split_special_tokens", False)
            or not (template is None or isinstance(template, str)) or not plain_map):
        return False
    meta = {
        "fingerprint": _fingerprint(folder),
        "special_tokens_map": special_map,
        "all_special_ids": list(tokenizer.all_special_ids),
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "chat_template": template,
        "model_max_length": tokenizer.model_max_length,
        "padding_side": tokenizer.padding_side,
        "truncation_side": tokenizer.truncation_side,
        **{f"{name}_id": getattr(tokenizer, f"{name}_id")
           for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
    }
    target = folder / TOKENIZER_DIR
    try:
        target.mkdir(parents=True, exist_ok=True)
        backend = tokenizer._tokenizer.to_str()
        replace_atomically(target / "tokenizer.json", lambda tmp: tmp.write_text(backend))
        # meta.json last: a snapshot without it (a write cut short) is never read.
        replace_atomically(target / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta)))
    except (OSError, TypeError, ValueError) as e:
        logger.debug("Could not keep a tokenizer snapshot in %s (%s)", target, e)
        return False
    return True


def load_snapshot(folder: str | os.PathLike) -> FastTokenizer | None:
    """The folder's snapshot as a FastTokenizer; None where there is none or it is stale."""
    folder = Path(folder)
    target = folder / TOKENIZER_DIR
    try:
        meta = json.loads((target / "meta.json").read_text())
        if meta.get("fingerprint") != _fingerprint(folder):
            logger.debug("Tokenizer snapshot in %s is stale", target)
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str((target / "tokenizer.json").read_text())
        return FastTokenizer(folder, backend, meta)
    except Exception as e:  # noqa: BLE001 - any unreadable snapshot: transformers loads it
        logger.debug("No usable tokenizer snapshot in %s (%s)", target, e)
        return None


class FastTokenizer:
    """See the module docstring. `full` is transformers' tokenizer for the folder, loaded on
    first use."""

    is_fast = True

    def __init__(self, folder: Path, backend: Any, meta: dict[str, Any]) -> None:
        self.name_or_path = str(folder)
        self._tokenizer = backend
        self.special_tokens_map: dict[str, Any] = meta["special_tokens_map"]
        self.all_special_ids: list[int] = meta["all_special_ids"]
        self.all_special_tokens: list[str] = meta["all_special_tokens"]
        self.chat_template: str | None = meta["chat_template"]
        self.model_max_length = meta["model_max_length"]
        self.padding_side = meta["padding_side"]
        self.truncation_side = meta["truncation_side"]
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            setattr(self, name, self.special_tokens_map.get(name))
            setattr(self, f"{name}_id", meta[f"{name}_id"])
        self._full = None

    # -- what the engine asks per request ---------------------------------------------------

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self._tokenizer.get_added_tokens_decoder().items()))

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):  # pairs, truncation, tensors: transformers'
            return self.full.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        # The snapshot is only kept where transformers does no clean-up (save_snapshot).
        if clean_up_tokenization_spaces or kwargs:
            return self.full.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                                    **kwargs)
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            **kwargs: Any) -> Any:
        """Plain messages (dicts of strings), rendered to text: here. Anything else (tools,
        documents, continuing a message, tokenized output, a template of the caller's, a
        template needing transformers' own tags): transformers' apply_chat_template."""
        conversations = _plain_conversations(conversation)
        compiled = _compile(self.chat_template) if isinstance(self.chat_template, str) else None
        if (conversations is None or compiled is None or tools is not None or documents is not None
                or chat_template is not None or continue_final_message or tokenize
                or not all(type(v) in _PLAIN for v in kwargs.values())):
            return self.full.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=tokenize, **kwargs)
        template_kwargs = {**self.special_tokens_map, **kwargs}
        rendered = [compiled.render(messages=chat, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt,
                                    **template_kwargs) for chat in conversations]
        return rendered if isinstance(conversation[0], (list, tuple)) else rendered[0]

    # -- everything else: transformers' tokenizer -------------------------------------------

    @property
    def full(self) -> Any:
        """transformers' tokenizer for the folder (imports transformers the first time)."""
        if self._full is None:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            logger.debug("Loading transformers' tokenizer for %s", self.name_or_path)
            self._full = TokenizersBackend.from_pretrained(self.name_or_path)
        return self._full

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.full(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self.full, name)


# Message keys whose value transformers copies under other names for reasoning templates:
# conversations with them go to transformers.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain_conversations(conversation: Any) -> list[list[dict[str, str]]] | None:
    """The conversation(s) as transformers hands them to the template (keys whose value is
    None dropped), if every message is a dict of strings with no reasoning field; else None."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        return None
    batch = conversation if isinstance(conversation[0], (list, tuple)) else [conversation]
    out = []
    for chat in batch:
        if not isinstance(chat, (list, tuple)):
            return None
        messages = []
        for message in chat:
            if type(message) is not dict:
                return None
            plain = {k: v for k, v in message.items() if v is not None}
            if any(type(k) is not str or type(v) is not str for k, v in plain.items()):
                return None
            if any(field in plain for field in _REASONING_FIELDS):
                return None
            messages.append(plain)
        out.append(messages)
    return out


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template in a jinja2 sandbox set up as transformers sets up its own (the same
    options, filters and globals); None if it does not compile here (e.g. it uses
    transformers' `{% generation %}` tag), which sends its chats to transformers."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        return None  # transformers refuses older jinja2 (sandbox escapes): its error, then
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # jinja's own escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    class TemplateDict:  # dict() and dict.fromkeys() only, no attribute access to the class
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot set underscore-prefixed attributes ({name!r}).")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        logger.debug("Chat template left to transformers (%s)", e)
        return None
