"""The demo model's tokenizer: byte-level BPE whose pre-tokenizer keeps ids, amounts
and enum values the same token sequence wherever they appear.

A small model copies a customer id from the task into ``lookup_customer``, or an
invoice total into ``approve_payment``, by attending to the same tokens it must emit.
An ordinary BPE merges ``" C115"``, ``"C115"`` and ``":"C1`` differently, and digits
into arbitrary chunks, so the copy would have to be learned once per context. Here:

- every digit is its own token (``1109.0`` is ``1 1 0 9 . 0`` in JSON, prose or a call);
- an id's letter prefix (the capitals before its digits: ``C``, ``KB``, ``INV``, ``PO``,
  ``T``, ``V``) is its own token, never merged with a space or punctuation before it;
- words are letters with at most one leading space, never merged with ``_`` or digits,
  so ``price_mismatch`` is ``price _ mismatch`` in a JSON list and in a call;
- runs of punctuation (``":"``, ``","``, ``{"``) may merge, which keeps JSON from
  costing a token a character, as whitespace runs do.

The chat template, special tokens and Hermes ``<tool_call>`` markers are the random
tiny model's (``warmloop.infra.tiny_model``), so prompts render byte-identically with
either model and vLLM's ``hermes`` parser finds its markers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from warmloop.infra.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS

PRE_TOKENIZER_PATTERN = (
    r"[A-Z]+(?=[0-9])"           # an id's prefix: C115 -> C, INV1001 -> INV
    r"| ?[A-Za-z]++(?![0-9])"    # a word, with one optional leading space
    r"|[A-Za-z]+"                # letters right before digits (lowercase: x86)
    r"|[0-9]"                    # one digit
    r"|[^\sA-Za-z0-9]+"          # a run of punctuation
    r"|\s+(?!\S)|\s"             # whitespace (the last one before a word stays apart)
)

__all__ = ["CHAT_TEMPLATE", "PRE_TOKENIZER_PATTERN", "build_tokenizer"]


def build_tokenizer(corpus: Iterable[str], *, vocab_size: int = 4096) -> Any:
    """Train the tokenizer on ``corpus``; returns a ``PreTrainedTokenizerFast`` with the
    chat template, ready for ``save_pretrained``. Deterministic for a given corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   pad_token="<pad>", unk_token=None)
    fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 32768
    return fast
