"""The top-level ``recipes/`` folder as Hydra's ``recipe`` config group.

Hydra finds a group as a sub-folder of a search-path root, and the recipes
live in ``recipes/`` (one file per recipe) rather than in ``conf/recipe/``.
This config source presents that folder as a root holding a single group,
``recipe``, so ``+recipe=NAME`` works the same from a checkout and a wheel.
"""

from __future__ import annotations

import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

GROUP = "recipe"
SCHEME = "rdkeras-recipes"


class RecipesSource(ConfigSource):
    """``rdkeras-recipes:///abs/recipes``: ``recipe/NAME`` is ``/abs/recipes/NAME.yaml``."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _inside(self, config_path: str) -> str | None:
        """The path inside the recipes folder, or None for anything outside the ``recipe`` group."""
        parts = config_path.strip("/").split("/", 1)
        if parts[0] != GROUP:
            return None
        return os.path.join(self.path, parts[1]) if len(parts) > 1 else self.path

    def load_config(self, config_path: str) -> ConfigResult:
        full = self._inside(self._normalize_file_name(config_path))
        if full is None or not os.path.isfile(full):
            raise ConfigLoadError(f"Config not found : {config_path}")
        with open(full, encoding="utf-8") as f:
            header = ConfigSource._get_header_dict(f.read(512))
            f.seek(0)
            return ConfigResult(
                config=OmegaConf.load(f), path=f"{SCHEME}://{self.path}", provider=self.provider, header=header
            )

    def available(self) -> bool:
        return os.path.isdir(self.path)

    def is_group(self, config_path: str) -> bool:
        if config_path.strip("/") == "":
            return True
        full = self._inside(config_path)
        return full is not None and os.path.isdir(full)

    def is_config(self, config_path: str) -> bool:
        full = self._inside(self._normalize_file_name(config_path))
        return full is not None and os.path.isfile(full)

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        files: list[str] = []
        if config_path.strip("/") == "":
            if results_filter in (None, ObjectType.GROUP):
                files.append(GROUP)
            return files
        full = self._inside(config_path)
        if full is None or not os.path.isdir(full):
            return files
        for name in os.listdir(full):
            self._list_add_result(
                files=files,
                file_path=f"{config_path.strip('/')}/{name}",
                file_name=name,
                results_filter=results_filter,
            )
        return sorted(set(files))


class RecipesSearchPath(SearchPathPlugin):
    """Appends the recipes folder to every search path this process builds."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from rdkeras.train.config import config_dirs

        search_path.append(provider="rdkeras", path=f"{SCHEME}://{config_dirs()[1]}")
