"""What a refresh checks before any work (`draftflow refresh` before Prefect starts; the deployment's flow first)."""

from __future__ import annotations

from draftflow.promotion import promoted_export
from draftflow.refresh.batches import check_traffic
from draftflow.refresh.history import finished
from draftflow.store import Store
from draftflow.training.warm import resolve


def check_refresh(cfg) -> None:
    """Before any work (the CLI: before Prefect starts): the traffic path, unless a batch waits to be resumed
    (`check_traffic`), and the promoted drafter a warm start will read (its export deleted by hand, say).

    Args:
        cfg: the run config (`draftflow.config.RunConfig`).

    Raises:
        ConfigError: in one line.
    """
    store = Store(cfg.root)
    check_traffic(store, cfg.refresh, finished(store))
    if not cfg.train.init_from and promoted_export(store) is not None:
        resolve(cfg.root, "promoted")
