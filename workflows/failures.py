"""What a workflow catches when an activity fails."""

from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TemporalTimeoutError

# A local activity's last failure reaches the workflow as itself (an ApplicationError, or
# Temporal's TimeoutError), not inside the ActivityError a regular activity's comes in:
# catching ActivityError alone let such a failure end the workflow.
LOCAL_ACTIVITY_FAILURES = (ActivityError, ApplicationError, TemporalTimeoutError)
