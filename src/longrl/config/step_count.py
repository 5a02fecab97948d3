"""How long a supervised run is: ``train.max_steps`` or ``sft.num_train_epochs``, whichever the user gave.

Both can count an SFT run. The rule, applied when a config is loaded for ``longrl sft`` (and ``plan --sft``): the
most specific place that gives one of them decides, the command line (``KEY=VALUE``) over the config file, the file
over a base config (the demo's).

- ``longrl sft run.yaml train.max_steps=3`` runs 3 steps although run.yaml says ``num_train_epochs: 1``
  (sft.num_train_epochs becomes null, and the log says so); ``sft.num_train_epochs=2`` on the command line wins over
  the file's max_steps;
- both on the command line is an error naming both;
- both in the file (a run's saved config.yaml holds every key): sft.num_train_epochs decides, as it always has, and
  the log says that max_steps is not used.

Python's ``SFTConfig`` follows TRL's rule instead (``max_steps > 0`` wins), as TRL scripts expect.
"""

from __future__ import annotations

import logging

from .errors import ConfigError

log = logging.getLogger(__name__)

STEPS, EPOCHS = "train.max_steps", "sft.num_train_epochs"


def _given(tree: dict, key: str) -> bool:
    section, leaf = key.split(".")
    node = tree.get(section)
    return isinstance(node, dict) and node.get(leaf) is not None


def settle_step_count(cfg, file_tree: dict, override_tree: dict, config_file=None) -> None:
    """Apply the rule above to ``cfg`` (built from the base, ``file_tree`` of the YAML file, then ``override_tree``
    of the KEY=VALUE overrides)."""
    steps, epochs = _given(override_tree, STEPS), _given(override_tree, EPOCHS)
    if steps and epochs:
        raise ConfigError(f"config keys '{STEPS}' and '{EPOCHS}' are both given on the command line: the run's length "
                          "is one of them (max_steps: optimizer steps; num_train_epochs: passes over the examples)")
    if not (steps or epochs):  # the file decides, then the base
        steps, epochs = _given(file_tree, STEPS), _given(file_tree, EPOCHS)
        where = f"in {config_file}"
    else:
        where = "on the command line"
    if cfg.sft.num_train_epochs is None:
        return
    if steps and not epochs:
        log.info("train.max_steps=%d given %s: it wins over sft.num_train_epochs=%g", cfg.train.max_steps, where,
                 cfg.sft.num_train_epochs)
        cfg.sft.num_train_epochs = None
    elif steps:
        log.info("sft.num_train_epochs=%g decides the run's length (train.max_steps=%d %s is not used)",
                 cfg.sft.num_train_epochs, cfg.train.max_steps, where)
