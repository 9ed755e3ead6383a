"""The lifecycle: the supervisor loop, its dependencies, the state machine, signals, stop and drain."""
