"""The two workloads of `kvport bench multi-turn` and `kvport bench long-doc`: seeded generators.

Modelled on the workloads the field publishes numbers for (LMCache's multi-round QA and long-document
QA, SGLang's multi-turn benchmark), so kvport's numbers read next to theirs:

- multi-turn: `users` users share a system prompt; each also has its own context (LMCache's "user
  info") and a growing history. Round r sends system + context + history + question r; the driver
  appends the answer to that user's history, so round r+1 extends round r's prompt.
- long-doc: `docs` documents of exactly `doc_len` tokens, each asked `queries` short distinct
  questions, in round-robin order (doc0 q0, doc1 q0, ..., doc0 q1, ...) so that a pool smaller than
  all documents cannot keep them between two questions on the same document.

Work is cut in phases (a round; one query): the driver finishes a phase before it starts the next,
so every configuration sees the same schedule, and a configuration may act between phases (the
cold-host one drops its host tier there). Token ids are real text through the model's tokenizer
(`TextTokens`) or random non-special ids (`RandomTokens`); every length is exact in tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# A fixed vocabulary of plain English words: sentences drawn from it tokenize like real text.
_WORDS = (
    "the a an this that every some each river mountain city market garden library engine "
    "report system network model memory cache block layer token request answer question "
    "history document chapter section table figure result method value number price season "
    "weather morning evening winter summer harbor bridge road train station window door "
    "teacher student doctor farmer writer painter council company village family friend "
    "quickly slowly carefully quietly often rarely always never again together nearly "
    "is was becomes remains seems holds keeps moves carries shows explains describes "
    "builds measures compares finds reads writes opens closes follows changes returns "
    "large small old new early late bright dark simple careful public local central "
    "northern southern ancient modern useful strange common rare warm cold heavy light "
    "of in on at by with from under over between through after before during near "
    "and but because while although so then also only still"
).split()


class TokenSource(Protocol):
    def take(self, n: int) -> list[int]:
        """Exactly `n` token ids; successive calls continue one seeded stream."""


class RandomTokens:
    """Random non-special token ids of the model's vocabulary (common.models.prompt_sampler)."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from kvport.bench.common.models import prompt_sampler

        self._draw = prompt_sampler(model_dir, seed)

    def take(self, n: int) -> list[int]:
        return self._draw(1, n)[0] if n > 0 else []


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class TextTokens:
    """English-looking sentences from `_WORDS` (seeded), tokenized without special tokens and cut
    to exactly `n` tokens: the model sees text-like statistics, not noise."""

    def __init__(self, tokenizer: Encoder, seed: int) -> None:
        self._encode = tokenizer.encode
        self._rng = random.Random(seed)

    def _sentence(self) -> str:
        words = [self._rng.choice(_WORDS) for _ in range(self._rng.randint(6, 14))]
        return " ".join(words).capitalize() + "."

    def take(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            # a leading space keeps word-initial tokens the same as inside running text
            ids.extend(self._encode(" " + self._sentence(), add_special_tokens=False))
        return ids[:n]


def token_source(model: str, model_dir: Path, seed: int) -> TokenSource:
    """Text for models with a real tokenizer; random ids for tiny-llama, whose byte tokenizer and
    random weights make text pointless."""
    if model.startswith("builtin:tiny"):
        return RandomTokens(model_dir, seed)
    from kvport.model.tokenizer import Tokenizer

    return TextTokens(Tokenizer.from_dir(model_dir), seed)


@dataclass(frozen=True)
class Prompt:
    """One request of a workload: who asks (user or document), which round or query, its phase."""

    session: int
    index: int
    phase: int
    token_ids: tuple[int, ...]


class WorkloadSpec(Protocol):
    @property
    def answer_tokens(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def working_set_tokens(self) -> int: ...


class WorkloadState(Protocol):
    """One configuration's progress through a workload."""

    def prompts(self, phase: int) -> list[Prompt]: ...

    def answer(self, prompt: Prompt, output_ids: list[int]) -> None: ...


class Workload(Protocol):
    @property
    def spec(self) -> WorkloadSpec: ...

    @property
    def num_phases(self) -> int: ...

    def start(self) -> WorkloadState: ...


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class MultiTurnSpec:
    users: int = 8
    rounds: int = 6
    system_len: int = 256  # shared by every user
    context_len: int = 1024  # each user's own first-round context
    question_len: int = 32
    answer_tokens: int = 16

    def __post_init__(self) -> None:
        _positive("multi-turn", users=self.users, rounds=self.rounds, system_len=self.system_len,
                  question_len=self.question_len, answer_tokens=self.answer_tokens)
        if self.context_len < 0:
            raise ValueError(f"multi-turn: context_len must be >= 0, got {self.context_len}")

    @property
    def max_seq_len(self) -> int:
        """Tokens of the last round's prompt plus its answer."""
        return self.system_len + self.context_len + self.rounds * (self.question_len + self.answer_tokens)

    @property
    def working_set_tokens(self) -> int:
        """Distinct tokens whose KV is worth keeping: the system prompt once, every user's all."""
        return self.system_len + self.users * (self.max_seq_len - self.system_len)


@dataclass(frozen=True)
class MultiTurnWorkload:
    spec: MultiTurnSpec
    system: tuple[int, ...]
    contexts: tuple[tuple[int, ...], ...]  # [user]
    questions: tuple[tuple[tuple[int, ...], ...], ...]  # [user][round]

    @property
    def num_phases(self) -> int:
        return self.spec.rounds

    def start(self) -> MultiTurnState:
        return MultiTurnState(self)


@dataclass
class MultiTurnState:
    """One configuration's conversations: each user's history grows with its own answers."""

    workload: MultiTurnWorkload
    histories: dict[int, list[int]] = field(default_factory=dict)

    def prompts(self, phase: int) -> list[Prompt]:
        w = self.workload
        out = []
        for user in range(w.spec.users):
            history = self.histories.setdefault(user, list(w.system + w.contexts[user]))
            out.append(Prompt(user, phase, phase, tuple(history) + w.questions[user][phase]))
        return out

    def answer(self, prompt: Prompt, output_ids: list[int]) -> None:
        self.histories[prompt.session] = list(prompt.token_ids) + list(output_ids)


def make_multi_turn(spec: MultiTurnSpec, source: TokenSource) -> MultiTurnWorkload:
    system = tuple(source.take(spec.system_len))
    contexts = tuple(tuple(source.take(spec.context_len)) for _ in range(spec.users))
    questions = tuple(tuple(tuple(source.take(spec.question_len)) for _ in range(spec.rounds))
                      for _ in range(spec.users))
    return MultiTurnWorkload(spec, system, contexts, questions)


@dataclass(frozen=True)
class LongDocSpec:
    docs: int = 8
    doc_len: int = 2048
    queries: int = 3  # per document
    question_len: int = 16
    answer_tokens: int = 8

    def __post_init__(self) -> None:
        _positive("long-doc", docs=self.docs, doc_len=self.doc_len, queries=self.queries,
                  question_len=self.question_len, answer_tokens=self.answer_tokens)

    @property
    def max_seq_len(self) -> int:
        return self.doc_len + self.question_len + self.answer_tokens

    @property
    def working_set_tokens(self) -> int:
        return self.docs * self.doc_len


@dataclass(frozen=True)
class LongDocWorkload:
    spec: LongDocSpec
    documents: tuple[tuple[int, ...], ...]  # [doc]
    questions: tuple[tuple[tuple[int, ...], ...], ...]  # [doc][query]

    @property
    def num_phases(self) -> int:
        return self.spec.docs * self.spec.queries

    def order(self) -> list[tuple[int, int]]:
        """(doc, query) in round-robin order: every other document comes between two queries on
        the same one."""
        return [(d, q) for q in range(self.spec.queries) for d in range(self.spec.docs)]

    def start(self) -> LongDocState:
        return LongDocState(self)


@dataclass
class LongDocState:
    workload: LongDocWorkload

    def prompts(self, phase: int) -> list[Prompt]:
        doc, query = self.workload.order()[phase]
        w = self.workload
        return [Prompt(doc, query, phase, w.documents[doc] + w.questions[doc][query])]

    def answer(self, prompt: Prompt, output_ids: list[int]) -> None:
        """Answers do not feed later questions: each query stands alone on its document."""


def make_long_doc(spec: LongDocSpec, source: TokenSource) -> LongDocWorkload:
    documents = tuple(tuple(source.take(spec.doc_len)) for _ in range(spec.docs))
    questions = tuple(tuple(tuple(source.take(spec.question_len)) for _ in range(spec.queries))
                      for _ in range(spec.docs))
    return LongDocWorkload(spec, documents, questions)
