"""Learning one observed transition: every expert and the mixture learn which label followed a
position, from the one-step prediction made there.

* the count experts count the label (``markov``) and its rank among the recent agents
  (``copy``), through the back-off levels' counts the position's view kept where the tables
  have not been pruned since (the same counts, without looking the levels up);
* the context model learns the true label as a positive and the most likely wrong candidate as
  a negative, skipping a candidate it already scores within ``sure`` of the truth (0 or 1): the
  gradient would be as small, and most steps of a structured workflow are such; its scaler
  learns the request's numeric hints;
* the mixture moves weight towards the experts that gave the label more probability.
"""

from __future__ import annotations

from policyd.models.predictor.forecast import END
from policyd.models.predictor.kinds import TypeModel
from policyd.models.predictor.nodes import Hints, Node
from policyd.models.predictor.onestep import OneStepModel, rank_label
from policyd.models.predictor.position import Position, counted_features

# one learnt transition as the count experts saw it: the ``markov`` levels' keys and the label,
# the ``copy`` levels' keys and the label's rank (what ``BackoffClassifier.add_keys`` replays)
Transition = tuple[tuple[tuple[str, ...], ...], str, tuple[tuple[str, ...], ...], str]


class TransitionLearner:
    """Teaches the experts of a ``OneStepModel`` and a type's mixture one transition.

    ``journal``, when a dict (a fleet's daemon sets one), counts every transition taught to the
    count experts since it was last taken, in mergeable form (``Transition`` -> times)."""

    journal: dict[Transition, int] | None = None  # (a class default: older pickles lack it)

    def __init__(self, one_step: OneStepModel, *, sure: float = 0.02) -> None:
        self._one_step = one_step
        self.sure = sure

    def learn(
        self, model: TypeModel, position: Position, node: Node, hints: Hints, label: str
    ) -> None:
        """Learn that ``label`` followed ``position`` in a workflow of ``model``'s type;
        ``node`` and ``hints`` are the one-step prediction made there and its hints."""
        model.learns += 1
        if label != END and label not in model.known:
            model.known.add(label)
            model.agents.append(label)
        structure = node.structure
        one_step = self._one_step
        rank = rank_label(position.recent, label)
        markov, copy = one_step.markov, one_step.copy
        journal = self.journal
        if journal is not None:
            key = (
                tuple(k for k, _ in structure.markov_keys),
                label,
                tuple(k for k, _ in structure.copy_keys),
                rank,
            )
            journal[key] = journal.get(key, 0) + 1
        resolved = structure.resolved
        if (
            resolved is not None
            and resolved[0] == markov.generation
            and resolved[1] == copy.generation
        ):
            markov.learn_counts(resolved[2], label)
            copy.learn_counts(resolved[3], rank)
        else:
            generations = markov.generation, copy.generation
            markov_counts = markov.learn_keys(structure.markov_keys, label)
            copy_counts = copy.learn_keys(structure.copy_keys, rank)
            if generations == (markov.generation, copy.generation):  # (none dropped meanwhile)
                structure.resolved = (*generations, markov_counts, copy_counts)

        # the context model: the true label as a positive, the most likely wrong one as a
        # negative; a step is skipped where the model is already sure (its gradient is ~0)
        context, sure, crossed = model.context, self.sure, one_step.crossed
        labels = structure.labels
        truth = labels.index(label) if label in labels else -1
        if truth < 0 or node.scores[truth] < 1.0 - sure:
            if truth >= 0:
                relative = node.relative[truth]
            else:
                counted = counted_features(position, label, structure.markov, structure.copy)
                relative = one_step.path(position, label, counted)
            context.learn({**crossed(context, hints, label)[0], **relative}, True)
        wrong, best = -1, -1.0  # the most likely wrong candidate (the first among equals)
        for i, p in enumerate(node.probs):
            if i != truth and p > best:
                wrong, best = i, p
        if wrong >= 0 and node.scores[wrong] > sure:
            features = crossed(context, hints, labels[wrong])[0]
            context.learn({**features, **node.relative[wrong]}, False)
        context.learn_hints(hints.numeric)

        said = [structure.markov.get(label, 0.0), structure.copy.get(label, 0.0)]
        said.append(node.context[truth] if truth >= 0 else 0.0)
        model.mixture.learn(position.history[-1], said)
