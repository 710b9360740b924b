"""Tokenizer built from a model's own vocabulary, chat-template rendering, and streaming detokenization.

GGUF files carry the vocabulary, merges and pre-tokenizer name: a SentencePiece vocabulary is tokenized by
our kernel (spm.py), a byte-level BPE one too (bpe.py), each built with the `tokenizers` library (no hub
access) where the kernels do not load. HF folders bring a tokenizer.json. Any stands behind
``vocabulary.Vocabulary``.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from kvserve.bpe import byte_level_bpe
from kvserve.errors import ModelLoadError
from kvserve.fim import FimTokens, fim_prompt, find_fim_tokens
from kvserve.lazy_torch import require
from kvserve.pretokenizers import pre_tokenizer_for
from kvserve.vocabulary import HFVocabulary, Vocabulary

# Chat formats of architectures whose GGUF files may lack tokenizer.chat_template.
KNOWN_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}{% set sys = '' %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set sys = m['content'] + '\n\n' %}{% else %}"
        "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
        "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% "
        "endif %}"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}


# Stand-ins for message contents while the chat template renders (private-use characters): where they
# land in the output tells which characters came from a message and which from the template.
_CONTENT_MARK = re.compile("\ue000([0-9]+)\ue001")


def check_unicode(text: str) -> None:
    """Raise ValueError on a lone UTF-16 surrogate (JSON's "\\ud800" escape): not valid Unicode, and
    the tokenizer cannot take it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the text holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, "
            "which is not valid Unicode; send whole characters"
        ) from None


THINK_TAGS = ("<think>", "</think>")  # a thought, as reasoning models write it


class Tokenizer:
    """Encode/decode, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: Vocabulary,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | None,
        add_bos: bool,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # False where the model file brings no template of its own (a pretrained base model, most often):
        # chats then get a guessed format (KNOWN_TEMPLATES, else plain lines) and `kvserve run` warns.
        self.template_from_file = chat_template is not None
        self.add_bos = add_bos
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.size

    @functools.cached_property
    def fim(self) -> FimTokens | None:
        """The model's fill-in-the-middle tokens; None for a model trained without them."""
        return find_fim_tokens(self.backend, self.eos_token_ids)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (at least 1): a text of n characters is at least
        n / max_token_bytes tokens, so a prompt far over the context is refused before it is tokenized."""
        return self.backend.max_token_bytes

    @functools.cached_property
    def thinks(self) -> bool:
        """A reasoning model: ``<think>`` and ``</think>`` are tokens of its own and its template knows them
        (Qwen3, DeepSeek-R1 distills, QwQ; not a model whose vocabulary merely has the words)."""
        tags = [self.backend.token_to_id(t) for t in THINK_TAGS]
        template = self.chat_template or ""
        return None not in tags and ("think" in template or "reasoning" in template)

    def encode_fim(self, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
                   middle: str = "") -> list[int]:
        """A fill-in-the-middle prompt (``fim.fim_prompt``); ValueError for a model without FIM tokens."""
        return fim_prompt(self, prefix, suffix, list(extra), middle)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str:
        return self.id_to_token(self.bos_token_id) or "" if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return (self.id_to_token(self.eos_token_ids[0]) or "") if self.eos_token_ids else ""

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Special-token strings in ``text`` become those tokens (a raw prompt is the caller's own)."""
        check_unicode(text)
        return self._with_bos(self.backend.ids(text), add_special)

    def _with_bos(self, ids: list[int], add_special: bool) -> list[int]:
        if add_special and self.add_bos and self.bos_token_id is not None and (
            not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """Render messages with the model's template in a sandboxed jinja2 environment; ``variables``
        are further template variables (``tools``)."""
        if not self.chat_template:
            return _plain_chat(messages, add_generation_prompt)
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **variables,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special: bool = True,
        special_tokens_in_content: bool = False,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The messages through the chat template. Special-token strings inside a message's content
        (a user typing "<|im_start|>system") stay text, so a client cannot forge turns, unless
        ``special_tokens_in_content``; the template's own special tokens are tokens."""
        variables = variables or {}
        rendered = self.apply_chat_template(messages, add_generation_prompt, **variables)
        contents = [m.get("content") for m in messages]
        found = None if special_tokens_in_content else next(
            (s for c in contents if isinstance(c, str) and (s := self.backend.first_special(c))), None)
        if found is None:
            return self.encode(rendered, add_special)
        check_unicode(rendered)
        segments = self._content_segments(messages, rendered, add_generation_prompt, variables)
        if segments is None:
            raise ValueError(
                f"a message's content holds the special token {found!r}, and this model's chat template "
                "changes contents so that it cannot be kept as text; remove it"
            )
        ids: list[int] = []
        for text, from_content in segments:
            ids.extend(self.backend.ids(text, literal=from_content))
        return self._with_bos(ids, add_special)

    def _content_segments(
        self, messages: list[dict[str, Any]], rendered: str, add_generation_prompt: bool,
        variables: dict[str, Any]
    ) -> list[tuple[str, bool]] | None:
        """``rendered`` cut into (text, came from a message's content) pieces, found by rendering again
        with a mark in place of each string content. None when the template changed a content other
        than by trimming it (the pieces would not add up to ``rendered``)."""
        contents: list[str] = []
        marked = []
        for m in messages:
            if isinstance(m.get("content"), str):
                marked.append({**m, "content": f"\ue000{len(contents)}\ue001"})
                contents.append(m["content"])
            else:
                marked.append(m)
        pieces = _CONTENT_MARK.split(self.apply_chat_template(marked, add_generation_prompt, **variables))
        segments: list[tuple[str, bool]] = []
        at = 0
        for j, piece in enumerate(pieces):
            if j % 2 == 0:
                if not rendered.startswith(piece, at):
                    return None
                segments.append((piece, False))
                at += len(piece)
                continue
            following = pieces[j + 1]
            for text in (contents[int(piece)], contents[int(piece)].strip()):
                if rendered.startswith(text, at) and rendered.startswith(following, at + len(text)):
                    break
            else:
                return None
            segments.append((text, True))
            at += len(text)
        return segments if at == len(rendered) else None

    # --- constructors -------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf) -> Tokenizer:
        model = gf.get("tokenizer.ggml.model")
        tokens = gf.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise ModelLoadError(f"{gf.path}: the GGUF file carries no tokenizer")
        token_types = gf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        default_bos = model == "llama"
        if model == "gpt2":
            merges = gf.get("tokenizer.ggml.merges") or []
            pre = pre_tokenizer_for(gf.get("tokenizer.ggml.pre"), gf.path)
            backend = byte_level_bpe(tokens, merges, token_types, pre)
            default_bos = pre.add_bos
        elif model == "llama":
            from kvserve.spm import spm_vocabulary

            backend = spm_vocabulary(tokens, gf.get("tokenizer.ggml.scores"), token_types,
                                     bool(gf.get("tokenizer.ggml.add_space_prefix", True)))
        else:
            raise ModelLoadError(f"{gf.path}: tokenizer model '{model}' is not supported (gpt2, llama are)")
        bos = gf.get("tokenizer.ggml.bos_token_id")
        eos = gf.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        eot = gf.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        add_bos = gf.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = default_bos
        template = gf.get("tokenizer.chat_template") or KNOWN_TEMPLATES.get(gf.architecture)
        if gf.architecture == "gemma3":  # Gemma ends its turns with <end_of_turn>
            eot_id = backend.token_to_id("<end_of_turn>")
            if eot_id is not None and eot_id not in eos_ids:
                eos_ids.append(eot_id)
        tokenizer = cls(backend, int(bos) if bos is not None else None, eos_ids, template, bool(add_bos))
        tokenizer.template_from_file = bool(gf.get("tokenizer.chat_template"))
        return tokenizer

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        require("tokenizers")
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json in the model folder")
        hf = HFTokenizer.from_file(str(path))
        backend = HFVocabulary(hf)
        cfg_path = folder / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        model_cfg = json.loads((folder / "config.json").read_text())

        def token_id(value) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return hf.token_to_id(value) if isinstance(value, str) else None

        bos = token_id(tcfg.get("bos_token"))
        eos = token_id(tcfg.get("eos_token"))
        eos_ids = [eos] if eos is not None else []
        cfg_eos = model_cfg.get("eos_token_id")
        for e in cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]:
            if isinstance(e, int) and e not in eos_ids:
                eos_ids.append(e)
        template = tcfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(backend, bos, eos_ids, template, bool(tcfg.get("add_bos_token", False)))


def _plain_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Invariant: ``text`` is the decoding of every id seen so far, minus a tail that is still an
    incomplete byte sequence (held back until the bytes that finish it arrive).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            # the last emitted tokens stay as left context: decoders that strip a leading space
            # (SentencePiece) then strip it from both texts alike
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of a stream (an incomplete character decodes as U+FFFD)."""
        rest = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        delta = rest[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta
