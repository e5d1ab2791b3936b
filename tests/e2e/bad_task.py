"""A user entrypoint that cannot build its task: the control loop must end its job FAILED."""


def explode() -> None:
    raise ValueError("deliberately broken task")
