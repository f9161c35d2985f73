"""Drift on the control plane (DESIGN 4.7, docs/drift.md): devices' drift reports stored and
summed per model version and time bucket, rules that raise retraining triggers, and each
device's drift for the rollout gates.

- :mod:`.sample`: a report in memory (:class:`~.sample.DriftSample`) and its fast decoder;
- :mod:`.scoring`: a version's baseline as one flat layout, reports aligned to it, PSI of many
  reports at once and of their sum;
- :mod:`.rules`: drift rules and their evaluation (pure);
- :mod:`.service`: :class:`~.service.DriftService`, the store, aggregation and triggers;
- :mod:`.admin`: :class:`~.admin.DriftAdmin`, rules, triggers and figures for REST and CLI;
- :mod:`.gate`: each device's drift of a rollout's new version (the ``drift`` gate);
- :mod:`.bench`: what one window of a fleet's reports costs (``bench/drift.py``).
"""
