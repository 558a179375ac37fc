"""The daemon's live tunables and learnt models, and the policy built from them."""

from __future__ import annotations

import inspect
from typing import Final

from policyd.core.engine import Engine
from policyd.core.policy import Policy
from policyd.core.profiles import get_profile
from policyd.core.types import TIERS
from policyd.daemon.model_checkpoints import ModelCheckpoints
from policyd.daemon.predictions import PredictionLog, resize_predictor
from policyd.daemon.settings import DaemonSettings, default_tunables, validate_tunables
from policyd.models.mrc import GiB
from policyd.models.predictor import Predictor
from policyd.models.shards import Shards
from policyd.policies import POLICIES, make_policy

# live settings -> the constructor parameter a policy takes for it (policies/*.py); a policy
# without the parameter ignores the setting (it is still stored and shown)
POLICY_PARAMS: Final[dict[str, str]] = {
    "lookahead_k": "k",
    "discount": "discount",
    "write_filter_mode": "mode",
    "write_filter_kappa_chunks": "kappa_chunks",
    "write_filter_theta": "theta",
    "host_tier_gib": "host_blocks",
}


class PolicyHolder:
    """The live tunables (``tunables``: key -> value, as ``settings.default_tunables`` names
    them), the models every policy shares (``predictor``, the SHARDS estimator ``shards``), the
    cache's geometry (``gpu_blocks``, ``kv_bytes_per_block``), and building a policy from them.

    At construction it restores the models and the persisted tunables from ``checkpoints`` (the
    policy named in ``settings`` wins over a persisted one; a persisted value that does not
    validate is reported there and its default kept); ``restored_predictions`` is the
    prediction log the checkpoint held, if any.

    Not locked itself: after the service started, ``rebuild`` and every change to ``tunables``
    run under the service's lock; ``int_setting`` / ``float_setting`` read the current dict
    without it (one lookup). ``predictor`` and ``shards`` are fixed once construction returns.
    """

    def __init__(self, settings: DaemonSettings, checkpoints: ModelCheckpoints) -> None:
        self.settings = settings
        self.checkpoints = checkpoints
        self.tunables: dict[str, object] = default_tunables(settings.policy)
        profile = get_profile(settings.profile)
        self.kv_bytes_per_block = profile.kv_bytes_per_block
        self.gpu_blocks = (
            settings.gpu_blocks if settings.gpu_blocks is not None else profile.gpu_blocks()
        )
        # forecasts are rolled out when the policy, the API or the prediction log asks
        self.predictor = Predictor(
            k=int(str(self.tunables["lookahead_k"])), roll_out_unserved=False
        )
        self.shards = Shards(
            rate=settings.shards_rate, max_tracked_blocks=settings.shards_max_tracked_blocks
        )
        self.restored_predictions: PredictionLog | None = None
        self.restored_fleet: object = None
        self._restore()

    def int_setting(self, key: str) -> int:
        value = self.tunables[key]
        assert isinstance(value, int)
        return value

    def float_setting(self, key: str) -> float:
        value = self.tunables[key]
        assert isinstance(value, int | float)
        return float(value)

    def host_blocks(self) -> int:
        """The host tier's size in blocks, from the live ``host_tier_gib``."""
        return int(self.float_setting("host_tier_gib") * GiB // self.kv_bytes_per_block)

    def owns_predictor(self, policy: Policy) -> bool:
        """Whether ``policy`` feeds the shared predictor itself (else the service does)."""
        return getattr(policy, "predictor", None) is self.predictor

    def build_policy(self, name: str) -> Policy:
        """The named policy with the live settings it takes (by constructor parameter name)."""
        cls = POLICIES[name]
        accepted = set(inspect.signature(cls.__init__).parameters)
        params: dict[str, object] = {
            pname: self.tunables[key] for key, pname in POLICY_PARAMS.items() if pname in accepted
        }
        if "guard" in accepted:
            params["guard"] = self.tunables["recency_guard"] == "on"
        if "host_blocks" in params:
            params["host_blocks"] = self.host_blocks()
        if "gpu_blocks" in accepted:
            params["gpu_blocks"] = self.gpu_blocks
        if "kv_bytes_per_block" in accepted:
            params["kv_bytes_per_block"] = self.kv_bytes_per_block
        if "predictor" in accepted:
            resize_predictor(self.predictor, self.int_setting("lookahead_k"))
            params["predictor"] = self.predictor
        return make_policy(name, **params)

    def start_policy(self) -> Policy:
        """The policy at start, from the restored settings; settings the policy refuses (a
        value a later daemon no longer accepts) are reported and their defaults used."""
        try:
            return self.build_policy(str(self.tunables["policy"]))
        except Exception as exc:
            defaults = default_tunables(self.settings.policy)
            changed = [k for k in POLICY_PARAMS if self.tunables.get(k) != defaults[k]]
            self.checkpoints.report_rejected({k: f"refused by the policy: {exc}" for k in changed})
            self.tunables.update({k: defaults[k] for k in changed})
            return self.build_policy(str(self.tunables["policy"]))

    def rebuild(self, engine: Engine, requests_seen: int) -> None:
        """Swap a freshly built policy into ``engine`` (under the lock); the EngineState, the
        predictor and the estimator carry over, and the policy's own derived state is
        recomputed from them (``requests_seen``: the calls a policy that counts them has seen,
        when the old policy did not count)."""
        old = engine.policy
        new = self.build_policy(str(self.tunables["policy"]))
        state = engine.state
        if hasattr(new, "retired"):
            new.retired = {b for tier in TIERS for b in state.resident[tier] if state.is_retired(b)}
        if hasattr(new, "calls_seen"):
            new.calls_seen = getattr(old, "calls_seen", requests_seen)
        if not self.owns_predictor(old) and getattr(new, "predictor", None) is not self.predictor:
            resize_predictor(self.predictor, self.int_setting("lookahead_k"))
        engine.policy = new

    def checkpoint_models(self, predictions: PredictionLog) -> dict[str, object]:
        """What a checkpoint holds (taken under the lock)."""
        return {
            "predictor": self.predictor,
            "predictions": predictions,
            "shards": self.shards,
            "tunables": dict(self.tunables),
        }

    def _restore(self) -> None:
        models = self.checkpoints.load()
        if not models:
            return
        predictor, shards = models.get("predictor"), models.get("shards")
        self.restored_fleet = models.get("fleet")  # the fleet link's state (policyd.fleet)
        predictions = models.get("predictions")
        if isinstance(predictions, PredictionLog):
            self.restored_predictions = predictions
        if isinstance(predictor, Predictor):
            predictor.roll_out_unserved = False
            self.predictor = predictor
            self.tunables["lookahead_k"] = predictor.k
        if isinstance(shards, Shards):
            self.shards = shards
        saved = models.get("tunables")
        if isinstance(saved, dict):
            # a persisted setting that does not validate (out of range, from an older daemon,
            # a hand-edited file) is reported and its default kept: the daemon always starts
            good, errors = validate_tunables(saved)
            good.pop("policy", None)  # the policy named at start (flag, env, default) wins
            self.tunables.update(good)
            self.checkpoints.report_rejected(errors)
        self.checkpoints.mark_restored()
