"""``extra_state`` for training loops: the format is :mod:`checkpoint.storage.extra_state`, the
planner :mod:`checkpoint.plan.extra_state`; their public names are here too."""

from ..plan.extra_state import ExtraStateRestore, plan_extra_state
from ..storage.extra_state import (
    EXTRA_STATE_FILE,
    REPORT_PREFIX,
    ExtraStateEntry,
    ExtraStateFile,
    extra_state_file_bytes,
    is_stateful,
    read_extra_state_file,
    snapshot_extra_state,
)

__all__ = [
    "EXTRA_STATE_FILE",
    "REPORT_PREFIX",
    "ExtraStateEntry",
    "ExtraStateFile",
    "ExtraStateRestore",
    "extra_state_file_bytes",
    "is_stateful",
    "plan_extra_state",
    "read_extra_state_file",
    "snapshot_extra_state",
]
