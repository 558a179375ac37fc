"""Checkpoints of earlier versions of the predictor restore into this one.

``data/predictor_flat.pickle.gz`` was pickled by the predictor before it was split into parts
(one flat dict of settings, learnt state and counters): ``Predictor(**FIXTURE_SETTINGS)`` fed
the first ``FIXTURE_EVENTS`` of ``events()`` (data/README.md says how it was made). Every
field of that dict must land in the part that reads it, and a setting it lacks must read as its
default.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from policyd.core.types import HintValue
from policyd.models.predictor import END, Forecast, Predictor
from policyd.models.predictor.kinds import TypeModel

FIXTURE = Path(__file__).parent / "data" / "predictor_flat.pickle.gz"
FIXTURE_SETTINGS: dict[str, Any] = {
    "k": 2,
    "beam": 3,
    "min_branch": 0.1,
    "refresh": 8,
    "max_paths": 64,
    "sure": 0.05,
    "noise": 0.2,
    "seed": 7,
    "alias_window": 8,
    "alias_after": 4,
    "roll_out_unserved": False,
}
FIXTURE_EVENTS = 160

Event = tuple[str, str | None, str | None, dict[str, HintValue]]


def events() -> Iterator[Event]:
    """(workflow id, type, agent, hints) per call, (workflow id, None, None, {}) per finish:
    group chats that name their experts per chat, and coding workflows whose first hint picks
    the branch, four active at a time in a seeded random order."""
    rng = random.Random(20)
    streams: list[tuple[str, str, list[str], dict[str, HintValue]]] = []
    for n in range(16):
        expert, verifier = f"Expert{n}", f"Verifier{n % 3}"
        streams.append((f"chat{n}", "chat", [expert, verifier, expert, verifier], {}))
        x = rng.randint(0, 1)
        agents = ["P", "B" if x else "C", "T", "C" if n % 4 else "T", "R"]
        streams.append((f"code{n}", "code", agents, {"x": x, "repo": f"r{n % 2}"}))
    active: list[list[Any]] = []
    while streams or active:
        while streams and len(active) < 4:
            active.append([*streams.pop(0), 0])
        item = active[rng.randrange(len(active))]
        wid, kind, agents, hints, i = item
        if i == len(agents):
            active.remove(item)
            yield wid, None, None, {}
        else:
            yield wid, kind, agents[i], hints if i == 0 else {"i": i}
            item[4] += 1


def feed(predictor: Predictor, part: list[Event]) -> list[Forecast]:
    """Observe ``part``, asking for a forecast after every call."""
    out = []
    for n, (wid, kind, agent, hints) in enumerate(part):
        if kind is None or agent is None:
            predictor.observe_finished(wid)
        else:
            predictor.observe_call(wid, kind, agent, hints, float(n))
            out.append(predictor.predict(wid))
    return out


class _Flat:
    """Stands in for the Predictor while the fixture is unpickled: keeps its state as is."""

    state: dict[str, Any]

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.state = state


class _FlatUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("policyd.models.predictor.fusion", "Predictor"):
            return _Flat
        return super().find_class(module, name)


def flat_state() -> dict[str, Any]:
    """The fixture's flat state, as pickled (its own copy of every object)."""
    flat = _FlatUnpickler(io.BytesIO(gzip.decompress(FIXTURE.read_bytes()))).load()
    assert isinstance(flat, _Flat)
    return flat.state


def restored_from(state: dict[str, Any]) -> Predictor:
    predictor = Predictor.__new__(Predictor)
    predictor.__setstate__(state)
    return predictor


def _same(a: object, b: object) -> bool:
    """The same state: pickled alike (for objects without an equality of their own)."""
    return pickle.dumps(a) == pickle.dumps(b)


def _settings_of(predictor: Predictor) -> dict[str, dict[str, object]]:
    """Per part, its plain settings (numbers, flags): what the parameters configured."""
    parts = ("_types", "_workflows", "_one_step", "_learner", "_rollout", "_server")
    counters = ("evaluations", "forecasts")
    settings: dict[str, dict[str, object]] = {
        "": {"roll_out_unserved": predictor.roll_out_unserved, "k": predictor.k}
    }
    for part in parts:
        settings[part] = {
            name: value
            for name, value in vars(getattr(predictor, part)).items()
            if isinstance(value, int | float | type(None)) and name not in counters
        }
    return settings


def test_the_fixture_is_of_the_flat_layout() -> None:
    state = flat_state()
    assert {"markov", "copy", "tracker", "_types", "_workflows", "_rng", "_path"} <= set(state)
    assert {name: state[name] for name in FIXTURE_SETTINGS} == FIXTURE_SETTINGS
    assert state["_calls"] == sum(1 for e in list(events())[:FIXTURE_EVENTS] if e[1] is not None)


def test_every_field_of_a_flat_checkpoint_lands_in_the_part_that_reads_it() -> None:
    state = flat_state()
    predictor = pickle.loads(gzip.decompress(FIXTURE.read_bytes()))
    assert isinstance(predictor, Predictor)
    # its settings: those a predictor made with them has, part by part
    assert _settings_of(predictor) == _settings_of(Predictor(**FIXTURE_SETTINGS))
    # its learnt state
    for mine, pickled in (
        (predictor.markov, state["markov"]),
        (predictor.copy, state["copy"]),
        (predictor.tracker, state["tracker"]),
        (predictor._one_step.path, state["_path"]),
    ):
        assert _same(mine, pickled)
    assert predictor._server._rng.getstate() == state["_rng"].getstate()
    assert predictor.stats()["aliased_types"] == ["chat"]
    for kind, model in state["_types"].items():
        assert _same(predictor._types.model(kind), model)
    assert predictor.active() == list(state["_workflows"]) != []
    for wid, workflow in state["_workflows"].items():
        assert _same(predictor._workflows[wid], workflow)
        if workflow.forecast is not None:
            assert predictor.predict(wid) == workflow.forecast
    # its counters
    stats = predictor.stats()
    assert (stats["calls"], stats["finished"]) == (state["_calls"], state["_finished"])
    assert (stats["evaluations"], stats["forecasts"]) == (state["_nodes"], state["_forecasts"])


def test_a_restored_flat_checkpoint_goes_on_learning() -> None:
    predictor = pickle.loads(gzip.decompress(FIXTURE.read_bytes()))
    again = pickle.loads(pickle.dumps(predictor))  # pickled as parts this time
    rest = list(events())[FIXTURE_EVENTS:]
    forecasts = feed(predictor, rest)
    assert forecasts == feed(again, rest)
    for forecast in forecasts:
        assert len(forecast.alive) == FIXTURE_SETTINGS["k"]
        assert all(0.0 <= alive <= 1.0 for alive in forecast.alive)
        assert all(sum(step.values()) <= 1.0 + 1e-9 for step in forecast.agents)
    stats = predictor.stats()
    assert stats["active"] == 0 and stats["finished"] == 32
    assert stats["calls"] == sum(1 for e in events() if e[1] is not None)
    # the coding workflows' branch is learnt from the hint by now
    predictor.observe_call("probe", "code", "P", {"x": 1, "repo": "r0"}, 0.0)
    predictor._server.noise = 0.0
    assert predictor.predict("probe").top(1) == "B"


def test_settings_a_flat_checkpoint_lacks_read_as_their_defaults() -> None:
    """A checkpoint from before a setting existed behaves as that version did: the setting's
    default (rolling out every position, caching 256 paths, aliasing as by default)."""
    state = flat_state()
    added = ("roll_out_unserved", "max_paths", "alias_share", "alias_window", "alias_after")
    for name in added:
        del state[name]
    predictor = restored_from(state)
    kept = {name: value for name, value in FIXTURE_SETTINGS.items() if name not in added}
    assert _settings_of(predictor) == _settings_of(Predictor(**kept))
    assert predictor.roll_out_unserved is True


def test_a_flat_checkpoint_from_before_the_caches_and_aliases_drops_them() -> None:
    """Older still: count models without generations, context models without weight
    versions, types and workflows without aliasing. The caches are dropped, types and
    workflows are modelled by name, and it forecasts."""
    state = flat_state()
    for classifier in (state["markov"], state["copy"]):
        del classifier.__dict__["generation"]
    blank: dict[str, TypeModel] = {}
    for kind, model in state["_types"].items():
        del model.context.version
        blank[kind] = TypeModel.__new__(TypeModel)
        for slot in ("agents", "context", "known", "learns", "mixture", "structures"):
            setattr(blank[kind], slot, getattr(model, slot))
    state["_types"] = blank
    for workflow in state["_workflows"].values():
        del workflow.aliases, workflow.named, workflow.novel
    predictor = restored_from(state)
    assert predictor.markov.generation == predictor.copy.generation == 0
    assert predictor.stats()["aliased_types"] == []
    assert all(not model.structures for model in predictor._types.values())
    for wid in predictor.active():
        workflow = predictor._workflows[wid]
        assert workflow.node is None and workflow.hints is None and workflow.named is None
        forecast = predictor.predict(wid)
        assert len(forecast.alive) == 2 and END not in forecast.agents[0]
        assert all(math.isclose(sum(s.values()), 1.0) for s in forecast.agents if s)
