"""attune runners: how trials are launched and how their logs are read."""
