"""Domain rules and infrastructure shared by the workflows, activities, worker and CLI."""
