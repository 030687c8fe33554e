"""A deterministic, download-free character-level corpus for the demo trainer.

The text comes from a small seeded probabilistic grammar: English-like sentences with subject-verb
agreement (``the fox sees`` / ``the foxes see``), adjectives, prepositional phrases, relative
clauses, questions and capitalised sentence starts, grouped into paragraphs. It has real structure
for a character-level model to learn (spelling, agreement, punctuation) but far less entropy than
natural text, so a ~1M-parameter model gets well below 2 nats/char in a few hundred CPU steps.

[Note: data-parallel sharding]
Every rank draws the *global* batch (``batch_size * world_size`` window offsets) from an
identically seeded generator and keeps rows ``[rank * batch_size, (rank + 1) * batch_size)``.
So ranks see disjoint rows of one global batch, the generators stay in lock-step without any
communication, and the concatenation over ranks equals the ``world_size=1`` batch of size
``batch_size * world_size`` — a DDP run is comparable to a single-process run of the global batch.
All ranks must therefore call :func:`get_batch` equally often with equally seeded generators.
"""

from __future__ import annotations

import functools
import random
import string
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["ALPHABET", "CharTokenizer", "Corpus", "generate_text", "load_corpus", "get_batch"]

#: Every character the grammar can emit; index = token id. Fixed, so ids never depend on the text.
ALPHABET: str = "\n !',.?" + string.ascii_lowercase + string.ascii_uppercase

Split = Literal["train", "val"]

# ---- grammar ----------------------------------------------------------------------------------
# (singular, plural) nouns; verbs as (3rd-person singular, base form).
_NOUNS = [
    ("fox", "foxes"),
    ("dog", "dogs"),
    ("cat", "cats"),
    ("bird", "birds"),
    ("child", "children"),
    ("farmer", "farmers"),
    ("teacher", "teachers"),
    ("horse", "horses"),
    ("wolf", "wolves"),
    ("sailor", "sailors"),
    ("king", "kings"),
    ("queen", "queens"),
    ("baker", "bakers"),
    ("mouse", "mice"),
    ("owl", "owls"),
    ("girl", "girls"),
    ("boy", "boys"),
    ("friend", "friends"),
]
_OBJECTS = [
    "the river",
    "the old bridge",
    "a small boat",
    "the garden",
    "the bread",
    "a red apple",
    "the letter",
    "the lantern",
    "the forest",
    "a green hill",
    "the market",
    "the door",
    "the village",
    "a quiet song",
    "the map",
    "the winter",
    "the tower",
    "a warm fire",
]
_TRANSITIVE = [
    ("sees", "see"),
    ("finds", "find"),
    ("watches", "watch"),
    ("likes", "like"),
    ("carries", "carry"),
    ("follows", "follow"),
    ("remembers", "remember"),
    ("paints", "paint"),
    ("visits", "visit"),
    ("wants", "want"),
    ("opens", "open"),
    ("reaches", "reach"),
]
_INTRANSITIVE = [
    ("sleeps", "sleep"),
    ("sings", "sing"),
    ("waits", "wait"),
    ("runs", "run"),
    ("laughs", "laugh"),
    ("listens", "listen"),
    ("rests", "rest"),
    ("wanders", "wander"),
]
_ADJECTIVES = [
    "small",
    "old",
    "quick",
    "brave",
    "quiet",
    "tired",
    "clever",
    "young",
    "gentle",
    "hungry",
    "proud",
    "lonely",
]
_ADVERBS = ["slowly", "often", "never", "always", "quietly", "happily", "sometimes", "rarely"]
_PREPOSITIONS = ["near", "behind", "across", "under", "beside", "inside", "beyond", "along"]
_NAMES = ["Anna", "Tom", "Lena", "Max", "Iris", "Omar", "Nora", "Paul"]
_CONNECTIVES = ["and", "but", "so", "because", "while"]


class _Grammar:
    """Sentence sampler over the word lists above (all choices go through one ``random.Random``)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def _pick(self, items: list):  # type: ignore[no-untyped-def]
        return items[self.rng.randrange(len(items))]

    def subject(self) -> tuple[str, bool]:
        """A noun phrase and whether it is plural."""
        if self.rng.random() < 0.15:
            return self._pick(_NAMES), False
        plural = self.rng.random() < 0.4
        noun = self._pick(_NOUNS)[1 if plural else 0]
        det = "the" if plural or self.rng.random() < 0.6 else "a"
        adj = f"{self._pick(_ADJECTIVES)} " if self.rng.random() < 0.5 else ""
        phrase = f"{det} {adj}{noun}"
        if self.rng.random() < 0.15:
            verb = self._pick(_INTRANSITIVE)[1 if plural else 0]
            phrase += f" that {verb}"
        return phrase, plural

    def predicate(self, plural: bool) -> str:
        adverb = f"{self._pick(_ADVERBS)} " if self.rng.random() < 0.3 else ""
        if self.rng.random() < 0.65:
            verb = self._pick(_TRANSITIVE)[1 if plural else 0]
            out = f"{adverb}{verb} {self._pick(_OBJECTS)}"
        else:
            out = f"{adverb}{self._pick(_INTRANSITIVE)[1 if plural else 0]}"
        if self.rng.random() < 0.4:
            out += f" {self._pick(_PREPOSITIONS)} {self._pick(_OBJECTS)}"
        return out

    def clause(self) -> str:
        subj, plural = self.subject()
        return f"{subj} {self.predicate(plural)}"

    def sentence(self) -> str:
        r = self.rng.random()
        if r < 0.15:  # question: auxiliary agrees with the subject, verb in base form
            subj, plural = self.subject()
            verb = self._pick(_TRANSITIVE)[1]
            body, end = f"{'do' if plural else 'does'} {subj} {verb} {self._pick(_OBJECTS)}", "?"
        elif r < 0.45:
            comma = "," if self.rng.random() < 0.3 else ""
            body, end = f"{self.clause()}{comma} {self._pick(_CONNECTIVES)} {self.clause()}", "."
        else:
            body, end = self.clause(), "!" if self.rng.random() < 0.05 else "."
        if self.rng.random() < 0.1:
            body = f"{self._pick(_NAMES)} said that {body}" if end == "." else body
        return body[0].upper() + body[1:] + end


def generate_text(n_chars: int = 300_000, seed: int = 1234) -> str:
    """Generate about ``n_chars`` characters of grammar text (paragraphs of 3-7 sentences).

    Deterministic: the same ``(n_chars, seed)`` always gives the same string, on any machine.

    Args:
        n_chars: target length; the text is cut at the first paragraph end past it.
        seed: seed of the private ``random.Random`` used for every choice.

    Returns:
        The text; every character is in :data:`ALPHABET`.

    Example:
        >>> text = generate_text(2_000, seed=0)
        >>> text[:60]  # doctest: +SKIP
        'The brave fox sees the river near the old bridge. Tom sleeps...'
    """
    if n_chars <= 0:
        raise ValueError(f"n_chars must be positive, got {n_chars}")
    grammar = _Grammar(random.Random(seed))
    parts: list[str] = []
    size = 0
    while size < n_chars:
        paragraph = " ".join(grammar.sentence() for _ in range(grammar.rng.randint(3, 7))) + "\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)


# ---- tokenizer -------------------------------------------------------------------------------
class CharTokenizer:
    """Character-level tokenizer over a fixed alphabet (token id = index in ``alphabet``).

    Args:
        alphabet: the characters, each once.

    Example:
        >>> tok = CharTokenizer()
        >>> ids = tok.encode("The fox.")
        >>> tok.decode(ids)
        'The fox.'
    """

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self._index = {c: i for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        """Encode ``text`` to a 1-D ``torch.long`` tensor of ids.

        Raises:
            ValueError: a character is not in the alphabet.
        """
        try:
            return torch.tensor([self._index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Decode a 1-D tensor or list of ids back to text."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.alphabet[i] for i in ids)


# ---- corpus and batches ------------------------------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """Tokenised text split into train / validation streams (1-D ``torch.uint8`` tensors, CPU).

    The validation stream is the tail of the text (``val_fraction``), so it never overlaps
    training windows.

    Example:
        >>> corpus = load_corpus()
        >>> corpus.tokenizer.vocab_size, corpus.train.numel() > corpus.val.numel()
        (59, True)
    """

    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor

    def split(self, name: Split) -> torch.Tensor:
        """The token stream of ``"train"`` or ``"val"``."""
        if name == "train":
            return self.train
        if name == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {name!r}")


@functools.lru_cache(maxsize=4)
def load_corpus(n_chars: int = 300_000, seed: int = 1234, val_fraction: float = 0.1) -> Corpus:
    """Generate, tokenise and split the corpus (cached per process; ~0.3 s the first time).

    Args:
        n_chars: approximate corpus length in characters (= tokens).
        seed: grammar seed (the corpus is a pure function of the arguments).
        val_fraction: fraction of the stream, taken from the end, held out for validation.

    Returns:
        The :class:`Corpus`.

    Example:
        >>> x, y = get_batch("train", 4, 32, torch.Generator().manual_seed(0), corpus=load_corpus())
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tok = CharTokenizer()
    ids = tok.encode(generate_text(n_chars, seed)).to(torch.uint8)
    n_val = int(ids.numel() * val_fraction)
    return Corpus(tokenizer=tok, train=ids[:-n_val], val=ids[-n_val:])


def get_batch(
    split: Split,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    *,
    rank: int = 0,
    world_size: int = 1,
    corpus: Corpus | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample this rank's share of a global batch of random windows (next-token targets).

    See [Note: data-parallel sharding] at the top of this module.

    Args:
        split: ``"train"`` or ``"val"``.
        batch_size: rows for *this rank*; the global batch is ``batch_size * world_size``.
        seq_len: tokens per row.
        generator: CPU generator, seeded identically on every rank; advanced by one global draw.
        rank: this rank's index among the ``world_size`` data-parallel ranks.
        world_size: number of data-parallel ranks.
        corpus: defaults to :func:`load_corpus` ``()``.
        device: where to put the outputs (default CPU).

    Returns:
        ``(inputs, targets)``, each ``(batch_size, seq_len)`` ``torch.long``; ``targets`` is
        ``inputs`` shifted left by one token.

    Example:
        >>> g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
        >>> x0, _ = get_batch("train", 8, 64, g0, rank=0, world_size=2)
        >>> x1, _ = get_batch("train", 8, 64, g1, rank=1, world_size=2)  # disjoint rows of one batch
    """
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    tokens = (corpus or load_corpus()).split(split)
    n_starts = tokens.numel() - seq_len  # the last window needs seq_len + 1 tokens
    if n_starts <= 0:
        raise ValueError(f"seq_len={seq_len} is too long for the {split} split ({tokens.numel()} tokens)")
    starts = torch.randint(n_starts, (batch_size * world_size,), generator=generator)
    starts = starts[rank * batch_size : (rank + 1) * batch_size]
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    x, y = windows[:, :-1], windows[:, 1:]
    if device is not None and torch.device(device).type != "cpu":
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y
