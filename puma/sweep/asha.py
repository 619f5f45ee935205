"""ASHA that keeps its rung records across a resume.

Ray Tune 2.60 restores the searcher on ``Tuner.restore`` but rebuilds the scheduler from the
Tuner's original arguments, so ASHA would forget every value recorded at its rungs and judge the
remaining trials against nothing. This subclass writes its rung records (small JSON) to the sweep
directory after every decision and reads them back on the first trial it sees after a restore.
It relies on ASHA's bracket layout in Ray 2.60 (``_brackets[i]._rungs``: [(milestone, {id: value})]).
"""

from __future__ import annotations

import json

from ray.tune.schedulers import ASHAScheduler

from puma import storage


class ResumableASHA(ASHAScheduler):
    """ASHAScheduler whose rung records live in ``state_uri`` (local path or s3://) as well."""

    def __init__(self, state_uri: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._state_uri = state_uri
        self._loaded = False

    def on_trial_add(self, tune_controller, trial) -> None:
        """Read the saved rung records once (after a restore they are the only copy), then add."""
        if not self._loaded:
            self._loaded = True
            self.load_rungs()
        super().on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        """ASHA's decision, then the rung records saved."""
        action = super().on_trial_result(tune_controller, trial, result)
        self.save_rungs()
        return action

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        """ASHA's bookkeeping, then the rung records saved."""
        super().on_trial_complete(tune_controller, trial, result)
        self.save_rungs()

    def rungs(self) -> list[list[dict]]:
        """Per bracket, per rung: {"milestone": t, "recorded": {trial_id: metric * sign}}."""
        return [[{"milestone": float(m), "recorded": dict(rec)} for m, rec in bracket._rungs]
                for bracket in self._brackets]

    def save_rungs(self) -> None:
        """Write the rung records to ``state_uri``."""
        storage.write_text(self._state_uri, json.dumps({"brackets": self.rungs()}) + "\n")

    def load_rungs(self) -> None:
        """Merge rung records from ``state_uri`` (if present) into this scheduler's brackets."""
        if not storage.exists(self._state_uri):
            return
        saved = json.loads(storage.read_text(self._state_uri))["brackets"]
        for bracket, rungs in zip(self._brackets, saved, strict=False):
            for (milestone, recorded), rung in zip(bracket._rungs, rungs, strict=False):
                if float(milestone) == rung["milestone"]:
                    recorded.update({k: float(v) for k, v in rung["recorded"].items()})
