"""collector.toml, read once: every section checked, each mistake one sentence naming the section and key
(a ``CollectorConfigError``), and each section handed to the code that owns it.

| table | owner |
|---|---|
| [analyzer], [[baselines.declared]], [pricing], [metrics] | ``analysis/settings.py`` (AnalyzerConfig) |
| [storage] (and whether [lake] is on) | ``store/maintenance_config.py`` (MaintenanceConfig) |
| [lake] | ``lake/export.py`` (LakeConfig) |
| [actions] | ``actions/config.py`` (ActionsConfig) |
| [fabric] | ``fabric/coordinator.py`` (FabricConfig) |
| [auth] | here: two file paths, which `serve`'s --tokens-file and --tls-client-ca override |
| [console] | here: `listen` (HOST:PORT of the web console, views/console.py), which `serve --ui-listen` overrides |

The owners raise the error type of ``config_file.py`` (the floor this module shares with them), so nothing
below imports this module; the commands that take ``--config`` call ``load`` once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpuagent.collector.actions.config import ActionsConfig
from gpuagent.collector.analysis.settings import AnalyzerConfig
from gpuagent.collector.config_file import CollectorConfigError, check_tables, read_toml
from gpuagent.collector.fabric.coordinator import FabricConfig
from gpuagent.collector.lake.export import LakeConfig
from gpuagent.collector.store.maintenance_config import MaintenanceConfig

AUTH_KEYS = ("tokens_file", "tls_client_ca")


@dataclass(frozen=True)
class CollectorConfig:
    """Every section of one collector.toml, each as its owner's config; the defaults without a file."""

    analyzer: AnalyzerConfig = field(default_factory=AnalyzerConfig)
    maintenance: MaintenanceConfig = field(default_factory=MaintenanceConfig)
    lake: LakeConfig = field(default_factory=LakeConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    fabric: FabricConfig | None = None                        # None: the file has no [fabric]
    auth: Mapping[str, str] = field(default_factory=dict)     # [auth] key -> absolute path
    console: Mapping[str, Any] = field(default_factory=dict)  # [console] listen, fleet_cache_s


def load(path: str | Path | None) -> CollectorConfig:
    """Read and check ``path`` (None: the defaults); raises CollectorConfigError with one sentence."""
    if not path:
        return CollectorConfig()
    doc = read_toml(path)
    check_tables(doc)
    return CollectorConfig(analyzer=AnalyzerConfig.from_mapping(doc),
                           maintenance=MaintenanceConfig.from_mapping(doc),
                           fabric=_fabric(doc, path),
                           auth=_auth(doc, path), console=_console(doc, path),
                           lake=LakeConfig.from_mapping(doc),
                           actions=ActionsConfig.from_document(doc))


def _fabric(doc: Mapping[str, Any], path: str | Path) -> FabricConfig | None:
    if "fabric" not in doc:
        return None
    try:
        return FabricConfig.from_mapping(doc["fabric"])
    except ValueError as exc:
        raise CollectorConfigError(f"config file {path}: {exc}") from None


def _console(doc: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """[console]: listen = "HOST:PORT" (the web console is off without it); fleet_cache_s (default 30): how
    long the fleet page's figures are reused, 0 to compute them for every request."""
    out: dict[str, Any] = {}
    for key, value in (doc.get("console") or {}).items():
        if key == "listen":
            if not isinstance(value, str) or not value.strip():
                raise CollectorConfigError(f"config file {path}: console.listen must be HOST:PORT, for example "
                                           "127.0.0.1:9480")
            out[key] = value.strip()
        elif key == "fleet_cache_s":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise CollectorConfigError(f"config file {path}: console.fleet_cache_s must be a number of "
                                           "seconds, 0 or more")
            out[key] = float(value)
        else:
            raise CollectorConfigError(f"config file {path}: unknown key console.{key} (expected listen or "
                                       "fleet_cache_s)")
    return out


def _auth(doc: Mapping[str, Any], path: str | Path) -> dict[str, str]:
    """[auth]: file paths, relative ones taken from the config file's directory."""
    out = {}
    for key, value in (doc.get("auth") or {}).items():
        if key not in AUTH_KEYS:
            raise CollectorConfigError(f"config file {path}: unknown key auth.{key} "
                                       f"(expected {' or '.join(AUTH_KEYS)})")
        if not isinstance(value, str) or not value:
            raise CollectorConfigError(f"config file {path}: auth.{key} must be a file path")
        out[key] = os.path.join(os.path.dirname(os.path.abspath(path)), value)
    return out
