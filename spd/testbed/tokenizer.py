"""The testbed's tokenizer: a byte-level BPE trained on the corpus, with chat-role markers and a chat template."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .corpus import _read_texts

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_ROLES = ("system", "user", "assistant")
# Special tokens: BOS/EOS/PAD plus one marker per chat role, so chat-data code paths can be exercised.
SPECIAL_TOKENS = [BOS, EOS, PAD] + [f"<|{role}|>" for role in CHAT_ROLES]
# Each turn is "<|role|>\n{content}<|eos|>\n"; the assistant's turn ends with EOS like in most chat models.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(corpus_dir: Path, vocab_size: int, model_max_length: int):
    """A byte-level BPE trained on the train split, as a Hugging Face tokenizer with the testbed's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _read_texts(corpus_dir / "train.jsonl")
    tok.train_from_iterator(tqdm(texts, desc="tokenizer", unit="file"), trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # Every encoded text starts with BOS, as every training document does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[f"<|{r}|>" for r in CHAT_ROLES],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    return hf_tok


def tokenize_split(corpus_dir: Path, split: str, tokenizer) -> np.ndarray:
    """All files of a split as one uint16 token stream: ``BOS text EOS`` per file, in file order."""
    texts = _read_texts(corpus_dir / f"{split}.jsonl")
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for start in tqdm(range(0, len(texts), 64), desc=f"tokenize {split}", unit="batch"):
        for row in tokenizer(texts[start : start + 64], verbose=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)
