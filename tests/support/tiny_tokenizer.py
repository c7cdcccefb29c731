"""The engine tier's tokenizer, also for the gateway's tests without an engine: a
word-level vocabulary (``w4`` .. ``w511`` and four specials), a BOS token added to every
encoded text, and a chat template that writes its own BOS, saved with
``save_pretrained`` (needs ``tokenizers`` and ``transformers``, not torch).

The BOS makes tokenizing "as the engine does" checkable: a chat prompt encoded with
special tokens would start with two of them, a completion encoded without them with none.
"""

from __future__ import annotations

from pathlib import Path

VOCABULARY = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCABULARY)})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def words(tokens: list[int]) -> str:
    """Text that the tokenizer encodes to ``tokens`` (after its BOS)."""
    return " ".join(f"w{t}" for t in tokens)
