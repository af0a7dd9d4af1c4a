"""Workflows: orchestration only; every piece of I/O is an activity.

The period and its children run outside Temporal's sandbox (`sandboxed=False`), which cost
the worker 11 of its 25 ms of CPU per customer; the tests run and replay them inside it, so
its checks still hold (docs/performance.md, "Why the figures look like this").

This package imports none of its modules: the sandbox, where the other workflows still run,
imports a workflow's module and its package afresh for every run. The worker registers them
(worker.WORKFLOWS).
"""
