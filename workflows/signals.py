"""Names shared by workflows that would otherwise import each other."""

CHILD_FINISHED = "child_finished"
