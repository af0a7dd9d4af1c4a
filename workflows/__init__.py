"""Workflows: orchestration only; every piece of I/O is an activity.

The period and its children run outside Temporal's sandbox (`sandboxed=False`). The sandbox
imports a workflow's module afresh for every run and routes every payload through its own
globals: at 30 children/s that was a quarter of the worker's CPU. The tests replay every
recorded history inside the sandbox as well (tests/integration/test_replay.py), so a
non-deterministic call (the clock, randomness, I/O) in workflow code still fails there.

This package imports none of its modules: the sandbox, where the other workflows still run,
imports a workflow's module and its package afresh for every run. The worker registers them
(worker.WORKFLOWS).
"""
