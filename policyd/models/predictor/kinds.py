"""What the predictor learns per workflow type besides the shared counts, and when a type
changes mode.

``TypeModels`` keeps one ``TypeModel`` per workflow type, made when the type is first met: its
context model, the experts' mixture weights, the count models' cached views of its positions,
the agent names its workflows called, and whether its new workflows are modelled over aliases.

Some workflow types name their agents per workflow (group chats name their experts per
task), so counts over names never recur. Once most of a type's recent workflows
(``alias_share`` of the last ``alias_window``, after ``alias_after``) brought a name the type
had not seen, its new workflows are modelled over aliases (``aliasing``; below half that share
it goes back to names). Every model then learns the shape of the conversation, which does recur.

A type is forgotten (``forget``) after a drift towards more errors, and when it changes mode
(the labels are not the same any more): its counts decay in the shared count models by
``drift_decay``, its context model and mixture start afresh, its views are dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Final

from policyd.models.predictor.backoff import BackoffClassifier
from policyd.models.predictor.context import ContextModel
from policyd.models.predictor.mixture import Mixture
from policyd.models.predictor.nodes import Structure

EXPERTS: Final = ("markov", "copy", "context")  # the mixture's experts, in its weights' order


class TypeModel:
    """What is learnt per workflow type besides the counts (checkpoints pickle its slots by
    name: one may be added, never renamed)."""

    __slots__ = (
        "agents",
        "aliased",
        "context",
        "known",
        "learns",
        "mixture",
        "names",
        "novel",
        "structures",
    )

    def __init__(self, context: ContextModel, mixture: Mixture, window: int = 64) -> None:
        self.context = context
        self.mixture = mixture
        self.agents: list[str] = []  # labels in order of first appearance (noise draws them)
        self.known: set[str] = set()
        self.learns = 0
        self.structures: dict[tuple[object, ...], Structure] = {}
        self.names: set[str] = set()  # agent names called by this type's workflows
        self.novel: deque[bool] = deque(maxlen=window)  # per finished workflow: a new name?
        self.aliased = False  # new workflows are modelled over aliases

    def met(self, agent: str, most: int) -> bool:
        """Note that a workflow of this type called ``agent``: True when the type had not met
        that name before (the names kept are forgotten all at once past ``most``).

        >>> model = TypeModel(ContextModel(), Mixture(3))
        >>> model.met("coder", 10), model.met("coder", 10)
        (True, False)
        """
        names = self.names
        if agent in names:
            return False
        if len(names) >= most:
            names.clear()
        names.add(agent)
        return True


class TypeModels:
    """The ``TypeModel`` of every workflow type met, and what changes them as a whole.

    >>> from policyd.models.predictor.backoff import BackoffClassifier
    >>> types = TypeModels({}, BackoffClassifier(), BackoffClassifier())
    >>> types.model("code") is types.model("code"), len(types)
    (True, 1)
    """

    def __init__(
        self,
        models: dict[str, TypeModel],
        markov: BackoffClassifier,
        copy: BackoffClassifier,
        *,
        learning_rate: float = 0.1,
        expert_rate: float = 0.5,
        expert_floor: float = 0.02,
        drift_decay: float = 0.1,
        alias_share: float | None = 0.5,
        alias_window: int = 64,
        alias_after: int = 16,
    ) -> None:
        self._models = models
        self._markov = markov
        self._copy = copy
        self.learning_rate = learning_rate
        self.expert_rate = expert_rate
        self.expert_floor = expert_floor
        self.drift_decay = drift_decay
        self.alias_share = alias_share
        self.alias_window = alias_window
        self.alias_after = alias_after

    def model(self, kind: str) -> TypeModel:
        """The model of type ``kind``, made fresh the first time the type is met."""
        model = self._models.get(kind)
        if model is None:
            mixture = Mixture(len(EXPERTS), rate=self.expert_rate, floor=self.expert_floor)
            context = ContextModel(learning_rate=self.learning_rate)
            model = self._models[kind] = TypeModel(context, mixture, self.alias_window)
        return model

    def counts_changed(self, kind: str) -> None:
        """The shared counts of type ``kind`` changed outside its own learning (another
        replica's merged in): its cached views are dropped, to be rebuilt from the counts."""
        model = self._models.get(kind)
        if model is not None:
            model.structures.clear()

    def __len__(self) -> int:
        return len(self._models)

    def values(self) -> Iterator[TypeModel]:
        return iter(self._models.values())

    def aliasing(self, kind: str) -> bool:
        """Whether a new workflow of type ``kind`` is modelled over aliases; a type that changes
        mode forgets most of what it learnt (as after a drift: the labels are not the same)."""
        model = self._models.get(kind) or self.model(kind)
        share, novel = self.alias_share, model.novel
        if share is None or len(novel) < self.alias_after:
            return model.aliased
        seen = sum(novel) / len(novel)
        aliased = seen >= share if not model.aliased else seen >= share / 2
        if aliased != model.aliased:
            model.aliased = aliased
            self.forget(kind, model)
            model.agents, model.known = [], set()  # the labels are the new mode's from now
        return aliased

    def forget(self, kind: str, model: TypeModel) -> None:
        """Decay the type's counts, reset its context model and mixture, drop its views."""
        self._markov.decay(kind, self.drift_decay)
        self._copy.decay(kind, self.drift_decay)
        model.context.reset()
        model.mixture.reset()
        model.structures.clear()

    def aliased(self) -> list[str]:
        """The types whose new workflows are modelled over aliases, sorted."""
        return sorted(kind for kind, model in self._models.items() if model.aliased)

    def labels(self) -> int:
        """Labels known, summed over the types (agents, or aliases where aliased)."""
        return sum(len(model.agents) for model in self._models.values())

    def expert_weights(self) -> dict[str, dict[str, float]]:
        """Per type, the experts' type-wide mixture weights."""
        return {
            kind: dict(zip(EXPERTS, model.mixture.typewide, strict=True))
            for kind, model in self._models.items()
        }
