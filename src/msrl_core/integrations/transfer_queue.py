"""TransferQueue storage backend "MsrlDock" (work in progress)."""


def register() -> None:
    """Registers the backend with TransferQueue's registries (a Ray worker_process_setup_hook)."""
