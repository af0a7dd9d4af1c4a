"""Workflows: orchestration only; every piece of I/O is an activity.

This package imports none of its modules: the sandbox imports a workflow's module, and its
package, afresh for every workflow run, so a child should not pay for the period's code.
The worker registers them (worker.WORKFLOWS).
"""
