"""The tiny preset's tokenizer: UTF-8 bytes are ids 0-255, special tokens fill the rest of its
vocabulary, and a ChatML chat template, so that the demo's model takes chats like a real one."""

from __future__ import annotations

from engine.tokenizer import Tokenizer

BOS, EOS, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (BOS, EOS, IM_START, IM_END)  # ids 256-259; the tiny preset's eos_token_ids name 257
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """Byte-level with no merges, so a byte's id is its value (as the tiny preset has always
    read text), built in memory: the preset needs no files."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(SPECIALS))]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, *reserved)])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=IM_END,
                                 chat_template=CHAT_TEMPLATE)
    return Tokenizer(hf)
