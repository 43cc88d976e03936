"""slime's plugin-facing modules, for plugins written for slime to run in Reservoir unchanged.

A slime plugin imports ``from slime.utils.types import Sample``, ``from slime.utils.http_utils
import post``, ``from slime.rollout.sglang_rollout import GenerateState`` and so on. When slime
itself is not installed, the import alias of ``plugins/slime_alias.py`` answers ``slime`` and
``slime.<x>`` with this package's ``slime_compat.<x>``: the very same module objects
(``slime.utils.types.Sample is buffer.sample.Sample``), so ``isinstance`` checks in plugins hold.
``plugins.loader.load_function`` installs it before it imports any plugin; ``install`` and
``uninstall`` are re-exported here for code that imports ``slime.*`` without the loader.

Only the modules and names slime's example plugins and its ``*_hub`` files import are provided
(docs/slime.md lists them); importing another ``slime.*`` module raises ``ModuleNotFoundError``
naming it. What these modules need of the rollout manager they take from its public plugin API
(``rollout_manager/plugin_api.py``) and its public functions, never from a private name.
"""

from __future__ import annotations

from plugins.slime_alias import install, slime_installed, uninstall

__all__ = ["install", "slime_installed", "uninstall"]
