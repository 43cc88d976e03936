"""``slime.rollout.data_source``: slime's data source classes, built as ``cls(args)``.

``--data-source-path`` names a class the rollout manager builds with ``cls(args)`` and draws groups
from with ``get_samples(n)`` (unfinished groups come back through ``add_samples``). These are
slime's, on top of Reservoir's prompt loading (``--prompt-data``, ``--input-key``, ``--label-key``,
``--apply-chat-template``...: bad lines skipped and counted, prompt tokens computed once):

- ``RolloutDataSource``: prompts in order (shuffled per epoch with ``--rollout-shuffle``), forever
  or for ``--num-epoch`` passes; read-only (``add_samples`` raises, as in slime);
- ``RolloutDataSourceWithBuffer``: the same plus a buffer of given-back groups served first,
  picked by ``--buffer-filter-path`` (``fn(args, rollout_id, buffer, n)``, default ``pop_first``).

Subclass them as in slime (override ``get_samples``...). The position is saved with Reservoir's
checkpoints (``state_dict``); ``save(rollout_id)`` / ``load(rollout_id)`` also write/read it under
``--save`` / ``--load`` as slime does.
"""

from __future__ import annotations

import abc
import json
import logging
import os
from dataclasses import fields
from typing import Any

from buffer.sample import Sample

log = logging.getLogger(__name__)


class DataSource(abc.ABC):
    """slime's abstract data source: the methods a ``--data-source-path`` class provides."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Return ``num_samples`` groups."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Take groups back."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Save the position."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Load the position."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of prompts."""


class _Dataset:
    """slime's ``Dataset`` as far as data sources read it: ``samples`` (one prompt Sample each)."""

    def __init__(self, records: list[Any]):
        self.samples = [Sample(prompt=r.prompt, label=r.label, metadata=dict(r.metadata), tokens=list(r.input_ids))
                        for r in records]

    def __len__(self) -> int:
        return len(self.samples)


class RolloutDataSource(DataSource):
    """Groups of ``--n-samples-per-prompt`` fresh samples from ``--prompt-data`` (see the module doc)."""

    def __init__(self, args: Any):
        from rollout_manager.data_source import DataSource as PromptSource, load_prompts
        from rollout_manager.settings import DataSettings
        from slime_compat.utils.processing_utils import load_tokenizer

        self.args = args
        self.metadata: dict = {}
        self._source: PromptSource | None = None
        self._dataset: _Dataset | None = None
        self.report = None
        if getattr(args, "rollout_global_dataset", True) and getattr(args, "prompt_data", None) is not None:
            settings = DataSettings(**{f.name: getattr(args, f.name) for f in fields(DataSettings)
                                       if hasattr(args, f.name)})
            records, self.report = load_prompts(args.prompt_data, settings, load_tokenizer(args.hf_checkpoint))
            self._source = PromptSource(records, args.n_samples_per_prompt, settings.rollout_shuffle,
                                        settings.rollout_seed, getattr(args, "num_epoch", None))

    # slime's position attributes, read-only views of the prompt source
    @property
    def epoch_id(self) -> int:
        """The current epoch: passes over the prompts completed so far (0 without a dataset)."""
        return self._source.epoch if self._source else 0

    @property
    def sample_offset(self) -> int:
        """Position of the next prompt in the current epoch's order (0 without a dataset)."""
        return self._source.offset if self._source else 0

    @property
    def sample_group_index(self) -> int:
        """The ``group_index`` the next new group gets (0 without a dataset)."""
        return self._source.next_group_index if self._source else 0

    @property
    def dataset(self) -> _Dataset | None:
        """slime's ``dataset``: one prompt Sample per loaded prompt, built on first access; None without a dataset."""
        if self._dataset is None and self._source is not None:
            self._dataset = _Dataset(self._source.records)
        return self._dataset

    @property
    def exhausted(self) -> bool:
        """True once all ``--num-epoch`` passes are served; never without ``--num-epoch`` or without a dataset."""
        return self._source is not None and self._source.exhausted

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Up to ``num_samples`` groups of fresh samples (fewer once the last epoch runs out).

        Without a dataset: groups of empty Samples, for a custom generate function to fill in.
        """
        if self._source is not None:
            return self._source.get_samples(num_samples)
        groups = []  # no dataset (--disable-rollout-global-dataset in slime): empty samples to fill in
        for _ in range(num_samples):
            groups.append([Sample() for _ in range(self.args.n_samples_per_prompt)])
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Always raises RuntimeError: this data source is read-only, as in slime."""
        raise RuntimeError(f"Cannot add samples to {type(self).__name__}. This is a read-only data source.")

    def state_dict(self) -> dict[str, Any]:
        """The position and ``metadata``, as saved with Reservoir's checkpoints."""
        return {"source": self._source.state_dict() if self._source else None, "metadata": self.metadata}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned.

        Raises RuntimeError when the saved position is for other prompts or another shuffle or seed.
        """
        if state.get("source") is not None and self._source is not None:
            self._source.load_state_dict(state["source"])
        self.metadata = state.get("metadata", {})

    def _path(self, root: str, rollout_id: int | None) -> str:
        return os.path.join(root, f"rollout/global_dataset_state_dict_{rollout_id}.json")

    def save(self, rollout_id: int) -> None:
        """Write ``state_dict()`` as JSON under ``--save`` (``rollout/global_dataset_state_dict_{rollout_id}.json``).

        Does nothing without ``--save``.
        """
        if getattr(self.args, "save", None):
            path = self._path(self.args.save, rollout_id)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.state_dict(), f)

    def load(self, rollout_id: int | None = None) -> None:
        """Read back what ``save(rollout_id)`` wrote under ``--load``; does nothing without ``--load`` or the file."""
        if not getattr(self.args, "load", None):
            return
        path = self._path(self.args.load, rollout_id)
        if not os.path.exists(path):
            log.info("data source state %s does not exist", path)
            return
        with open(path) as f:
            self.load_state_dict(json.load(f))

    def __len__(self) -> int:
        return len(self._source.records) if self._source else 0


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """``RolloutDataSource`` with a buffer of given-back groups, served first (see the module doc)."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        path = getattr(args, "buffer_filter_path", None)
        if path is None:
            self.buffer_filter = pop_first
        else:
            from slime_compat.utils.misc import load_function
            self.buffer_filter = load_function(path)

    @property
    def exhausted(self) -> bool:
        """True when the buffer is empty and the prompts are exhausted (``RolloutDataSource.exhausted``)."""
        return not self.buffer and super().exhausted

    @property
    def num_returned(self) -> int:
        """Number of given-back groups waiting in the buffer."""
        return len(self.buffer)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Up to ``num_samples`` groups: buffered ones first (picked by ``--buffer-filter-path``), then fresh ones."""
        samples = self._get_samples_from_buffer(num_samples)
        if num_samples - len(samples) > 0:
            samples += super().get_samples(num_samples - len(samples))
        return samples

    def _get_samples_from_buffer(self, num_samples: int) -> list[list[Sample]]:
        if not self.buffer or num_samples == 0:
            return []
        return self.buffer_filter(self.args, None, self.buffer, num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Put given-back groups in the buffer; raises TypeError for an entry that is not a list."""
        for group in samples or []:
            if not isinstance(group, list):
                raise TypeError(f"add_samples: each entry must be a group (a list), got {type(group).__name__}")
            self.buffer.append(group)

    def state_dict(self) -> dict[str, Any]:
        """``RolloutDataSource.state_dict`` plus the buffered groups (as ``Sample.to_dict`` dicts)."""
        return {**super().state_dict(), "buffer": [[s.to_dict() for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the saved buffer replaces the current one."""
        super().load_state_dict(state)
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state.get("buffer", [])]

    def update_metadata(self, metadata: dict) -> None:
        """Merge ``metadata`` into the source's metadata (saved with its state)."""
        self.metadata.update(metadata)

    def get_metadata(self) -> dict:
        """The source's metadata dict (the object itself, not a copy)."""
        return self.metadata

    def get_buffer_length(self) -> int:
        """Number of groups in the buffer (slime's name for ``num_returned``)."""
        return len(self.buffer)


def pop_first(args: Any, rollout_id: Any, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The first ``num_samples`` groups of the buffer (removed from it)."""
    n = min(len(buffer), num_samples)
    out = buffer[:n]
    del buffer[:n]
    return out
