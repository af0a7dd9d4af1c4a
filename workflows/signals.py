"""Names shared by workflows that would otherwise import each other."""

# A child's charge was refused for the whole period (cap reached, key revoked): pause it.
PERIOD_BLOCKED = "period_blocked"
# The period resumed or was cancelled: children waiting at a paused gate try again.
PERIOD_CONTROL = "period_control"
