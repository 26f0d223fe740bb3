"""Quality evaluations run by `kvforge eval`."""
