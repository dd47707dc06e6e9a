"""The packing shape: how the orchestrator lays out a batch for the trainer, declared once.

The orchestrator packs samples into rows of at most `seq_len` tokens and splits the rows over
`dp_world_size` data-parallel ranks. Both numbers belong to the trainer (its `data.seq_len` and its
number of processes): the orchestrator's `batch.seq_len` and `batch.dp_world_size` are *derived* from
them by whoever wires the services together (`gyre rl`: `gyre.local.runs`; the Helm chart: its
orchestrator template, and its schema generator refuses the two keys in values). A batch packed to
another shape is refused by the trainer (a wrong split, or a row longer than its `data.seq_len`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyre.config.mistakes import ConfigError

DEFAULT_SEQ_LEN = 2048  # the default of both trainer.data.seq_len and orchestrator.batch.seq_len
# The orchestrator keys the packing shape fills (dotted, as in the orchestrator's config): never set by hand.
ORCHESTRATOR_KEYS = ("batch.seq_len", "batch.dp_world_size")


@dataclass(frozen=True)
class PackingShape:
    seq_len: int
    dp_world_size: int

    def orchestrator_values(self) -> dict[str, Any]:
        """The orchestrator's config values of this shape (`batch.*`)."""
        return {"batch": {"seq_len": self.seq_len, "dp_world_size": self.dp_world_size}}

    @classmethod
    def derive(cls, trainer: dict[str, Any], orchestrator: dict[str, Any], world_size: int) -> PackingShape:
        """The shape of a trainer of `world_size` processes, from the user's trainer and orchestrator tables.

        The trainer's `data.seq_len` wins (else an orchestrator `batch.seq_len` given alone, else the default);
        an orchestrator value that contradicts the trainer is a ConfigError naming both keys, raised before
        anything starts rather than dead-lettering every batch later."""
        trainer_len = trainer.get("data", {}).get("seq_len")
        batch = orchestrator.get("batch", {})
        orchestrator_len, user_dp = batch.get("seq_len"), batch.get("dp_world_size")
        if trainer_len is not None and orchestrator_len is not None and int(trainer_len) != int(orchestrator_len):
            raise ConfigError(
                f"orchestrator.batch.seq_len ({orchestrator_len}) != trainer.data.seq_len ({trainer_len}): the "
                "orchestrator's is derived from the trainer's; set trainer.data.seq_len only"
            )
        if user_dp is not None and int(user_dp) != world_size:
            raise ConfigError(
                f"orchestrator.batch.dp_world_size = {user_dp} contradicts the trainer's world size {world_size} "
                "(gyre rl: trainer_nproc): it is derived from the trainer; remove orchestrator.batch.dp_world_size"
            )
        chosen = trainer_len if trainer_len is not None else orchestrator_len
        return cls(int(chosen) if chosen is not None else DEFAULT_SEQ_LEN, world_size)
