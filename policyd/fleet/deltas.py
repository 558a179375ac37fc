"""What a daemon's online models learnt, in mergeable form, and merging another replica's.

Two models are shared across a fleet, both as counts that add:

* the next-agent predictor's transition counts (``Predictor.take_journal``): per transition, the
  back-off levels' keys of the ``markov`` and ``copy`` experts and the label, with how many
  times it was learnt. A replica adds them to its own count experts (``merge_transitions``);
  the context models and mixtures stay local (their weights do not add);
* the SHARDS stack-distance histogram's increments (bucket weights, the cold count and the
  reference counters), added to the replica's own histogram: the pooled estimate of the reuse
  distances that replicas with the same kind of traffic see.

``FleetLearning`` takes this replica's learning since its last take as a ``LearningDelta`` and
merges other replicas' into the same models. It never re-publishes what it merged: the
predictor's journal records only local learning, and the histogram's baseline moves with every
merge. Not thread-safe: the daemon calls it under its lock.

Delivery (``FleetOutbox``, ``OriginLedger``): a delta is *sealed* (numbered, encoded once) before
it is published and kept until JetStream acknowledged it; receivers apply each
(replica, incarnation, number) once. The sealed, unacknowledged deltas are saved with the model
checkpoint (``FleetState``), so a daemon that restarts republishes them under the same ids, and
its new learning goes out under a new incarnation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec

from policyd.models.predictor import Predictor
from policyd.models.predictor.learning import Transition
from policyd.models.shards import Shards

SUBJECT_PREFIX: Final = "agentkv.learn"


class HistogramDelta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Increments of a SHARDS estimator's histogram and counters since the last take."""

    sub_buckets: int
    weights: dict[int, float]
    cold: float
    references: int
    sampled_references: int
    prompt_tokens: int
    prompts: int


class LearningDelta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One replica's learning over an interval: ``number`` counts its deltas from 0 within an
    ``incarnation`` (one start of the daemon)."""

    replica: str
    incarnation: str
    number: int
    transitions: list[tuple[Transition, int]]
    histogram: HistogramDelta | None = None

    @property
    def origin(self) -> tuple[str, str]:
        return self.replica, self.incarnation

    @property
    def msg_id(self) -> str:
        """JetStream's de-duplication id (``Nats-Msg-Id``)."""
        return f"{self.replica}.{self.incarnation}.{self.number}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LearningDelta)


def encode(delta: LearningDelta) -> bytes:
    return _encoder.encode(delta)


def decode(payload: bytes) -> LearningDelta:
    """A delta from its wire form; anything else raises ``msgspec.DecodeError`` /
    ``msgspec.ValidationError``."""
    return _decoder.decode(payload)


def subject_of(replica: str) -> str:
    return f"{SUBJECT_PREFIX}.{replica}"


def new_incarnation() -> str:
    """An id for one start of a daemon: unique across its restarts."""
    return f"{time.time_ns():x}{os.getpid():x}"


@dataclass
class HistogramBaseline:
    """What of a SHARDS estimator's histogram was already taken or merged."""

    weights: dict[int, float] = field(default_factory=dict)
    cold: float = 0.0
    references: int = 0
    sampled_references: int = 0
    prompt_tokens: int = 0
    prompts: int = 0


class FleetLearning:
    """This replica's learning as deltas, and other replicas' merged into its models.

    ``shards_of`` returns the daemon's current SHARDS estimator (it may be replaced: a fresh
    one restarts the baseline). ``merged`` counts the transitions and histogram deltas merged.
    """

    def __init__(
        self,
        predictor: Predictor,
        shards_of: Callable[[], Shards],
        baseline: HistogramBaseline | None = None,
    ) -> None:
        self.predictor = predictor
        self.shards_of = shards_of
        self.baseline = baseline or HistogramBaseline()
        self.merged_transitions = 0
        self.merged_histograms = 0
        self.refused_histograms = 0  # another bucket layout (``sub_buckets``): not mergeable
        predictor.start_journal()

    def take(self) -> tuple[list[tuple[Transition, int]], HistogramDelta | None]:
        """The local learning since the last take (both parts empty: nothing new)."""
        transitions = list(self.predictor.take_journal().items())
        return transitions, self._histogram_delta()

    def _histogram_delta(self) -> HistogramDelta | None:
        shards, base = self.shards_of(), self.baseline
        if shards.references < base.references:  # a fresh estimator replaced the old one
            base = self.baseline = HistogramBaseline()
        if shards.references == base.references:
            return None
        histogram = shards.histogram
        weights = {
            i: w - base.weights.get(i, 0.0)
            for i, w in histogram.weights.items()
            if w != base.weights.get(i, 0.0)
        }
        delta = HistogramDelta(
            sub_buckets=histogram._sub,
            weights=weights,
            cold=histogram.cold - base.cold,
            references=shards.references - base.references,
            sampled_references=shards.sampled_references - base.sampled_references,
            prompt_tokens=shards.prompt_tokens - base.prompt_tokens,
            prompts=shards.prompts - base.prompts,
        )
        self.baseline = HistogramBaseline(
            dict(histogram.weights),
            histogram.cold,
            shards.references,
            shards.sampled_references,
            shards.prompt_tokens,
            shards.prompts,
        )
        return delta

    def merge(self, delta: LearningDelta) -> None:
        """Add another replica's ``delta`` to this replica's models."""
        self.merged_transitions += self.predictor.merge_transitions(delta.transitions)
        if delta.histogram is not None:
            self._merge_histogram(delta.histogram)

    def _merge_histogram(self, delta: HistogramDelta) -> None:
        shards, base = self.shards_of(), self.baseline
        histogram = shards.histogram
        if delta.sub_buckets != histogram._sub:
            self.refused_histograms += 1
            return
        weights = histogram.weights
        for i, w in delta.weights.items():
            weights[i] = weights.get(i, 0.0) + w
            base.weights[i] = base.weights.get(i, 0.0) + w
        histogram.cold += delta.cold
        base.cold += delta.cold
        shards.references += delta.references
        base.references += delta.references
        shards.sampled_references += delta.sampled_references
        base.sampled_references += delta.sampled_references
        shards.prompt_tokens += delta.prompt_tokens
        base.prompt_tokens += delta.prompt_tokens
        shards.prompts += delta.prompts
        base.prompts += delta.prompts
        self.merged_histograms += 1


@dataclass
class FleetOutbox:
    """This replica's sealed deltas, oldest first, until JetStream acknowledges each.

    ``seal`` numbers what ``FleetLearning.take`` returns within ``incarnation`` and encodes it
    once: a sealed delta is published (and republished after a failure or a restart) with the
    same bytes and the same id, so it counts once wherever it lands."""

    replica: str
    incarnation: str
    next_number: int = 0
    sealed: list[tuple[str, bytes]] = field(default_factory=list)  # (msg id, payload)

    def seal(self, learning: FleetLearning) -> int:
        """Seal the learning since the last seal (nothing new: nothing sealed); returns how
        many deltas wait to be published."""
        transitions, histogram = learning.take()
        if transitions or histogram is not None:
            delta = LearningDelta(
                replica=self.replica,
                incarnation=self.incarnation,
                number=self.next_number,
                transitions=transitions,
                histogram=histogram,
            )
            self.sealed.append((delta.msg_id, encode(delta)))
            self.next_number += 1
        return len(self.sealed)

    def acknowledged(self, msg_id: str) -> None:
        if self.sealed and self.sealed[0][0] == msg_id:
            self.sealed.pop(0)


@dataclass
class OriginLedger:
    """Which deltas were applied: the stream sequence applied through, and per origin
    (replica, incarnation) the last delta number applied, with the duplicates and the gaps
    (numbers never seen: deltas lost) counted."""

    applied_through: int = 0  # the stream sequence of the last message handled
    last_number: dict[tuple[str, str], int] = field(default_factory=dict)
    applied: int = 0
    duplicates: int = 0  # a delta seen again (redelivered, or republished after a restart)
    own: int = 0  # this replica's own deltas, read back and skipped
    gaps: int = 0  # delta numbers skipped over: deltas lost
    undecodable: int = 0

    def admit(self, delta: LearningDelta, replica: str) -> bool:
        """Whether ``delta`` is to be applied (first time seen, another replica's)."""
        if delta.replica == replica:
            self.own += 1
            return False
        last = self.last_number.get(delta.origin, -1)
        if delta.number <= last:
            self.duplicates += 1
            return False
        self.gaps += delta.number - last - 1
        self.last_number[delta.origin] = delta.number
        self.applied += 1
        return True


@dataclass
class FleetState:
    """What the model checkpoint keeps of the fleet link: with the models it describes."""

    ledger: OriginLedger
    outbox: FleetOutbox
    baseline: HistogramBaseline
