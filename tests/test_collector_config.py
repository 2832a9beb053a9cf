"""collector.toml has one reader (collector/config.py): every section is checked there, and a bad value in
any of them is one ``CollectorConfigError`` sentence that names the section and the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuagent.collector.config import CollectorConfig, load
from gpuagent.collector.config_file import CollectorConfigError

# (section, key, TOML with one mistake in that section)
BAD_VALUES = [
    ("analyzer", "window", '[analyzer]\nwindow = "forever"\n'),
    ("analyzer", "noise_k", '[analyzer]\nnoise_k = "lots"\n'),
    ("baselines.declared", "value", '[[baselines.declared]]\ncomponent = "h2d"\nvalue = "fast"\n'),
    ("pricing", "h100", '[pricing]\nh100 = "cheap"\n'),
    ("metrics", "listen", '[metrics]\nlisten = 5\n'),
    ("fabric", "group_size", '[fabric]\nenabled = true\ngroup_size = "big"\n'),
    ("auth", "tokens_file", '[auth]\ntokens_file = 3\n'),
    ("storage", "raw_retention", '[storage]\nraw_retention = "soon"\n'),
    ("lake", "enabled", '[lake]\nenabled = "yes"\n'),
    ("actions", "mode", '[actions]\nmode = "maybe"\n'),
    ("console", "listen", '[console]\nlisten = 9480\n'),
    ("console", "fleet_cache_s", '[console]\nfleet_cache_s = -1\n'),
]

UNKNOWN_KEYS = [
    ("analyzer", "wndow"), ("metrics", "port"), ("baselines", "declard"), ("fabric", "budget_percent"),
    ("auth", "token"), ("storage", "raw_retension"), ("lake", "pth"), ("actions", "dryrun"), ("console", "port"),
]


def _write(tmp_path, text):
    path = tmp_path / "collector.toml"
    path.write_text(text)
    return path


def _names(message, section, key):
    """The message names ``section`` and ``key``, as "[section] key", "section.key" or "[[section]] ... key"."""
    return section in message and key in message


@pytest.mark.parametrize("section,key,text", BAD_VALUES, ids=[f"{s}.{k}" for s, k, _ in BAD_VALUES])
def test_a_bad_value_in_each_section_is_one_sentence_naming_section_and_key(tmp_path, section, key, text):
    with pytest.raises(CollectorConfigError) as err:
        load(_write(tmp_path, text))
    message = str(err.value)
    assert _names(message, section, key), message
    assert "\n" not in message and "Traceback" not in message


@pytest.mark.parametrize("section,key", UNKNOWN_KEYS, ids=[f"{s}.{k}" for s, k in UNKNOWN_KEYS])
def test_an_unknown_key_in_each_section_is_refused_by_name(tmp_path, section, key):
    with pytest.raises(CollectorConfigError) as err:
        load(_write(tmp_path, f"[{section}]\n{key} = 1\n"))
    assert _names(str(err.value), section, key), str(err.value)


def test_an_unknown_table_is_refused_not_ignored(tmp_path):
    with pytest.raises(CollectorConfigError, match="unknown table or key 'analyser'"):
        load(_write(tmp_path, "[analyser]\nwindow = \"1h\"\n"))
    with pytest.raises(CollectorConfigError, match=r"\[storage\] in the collector config must be a table"):
        load(_write(tmp_path, "storage = 3\n"))


def test_missing_and_broken_files_are_one_sentence(tmp_path):
    with pytest.raises(CollectorConfigError, match="does not exist"):
        load(tmp_path / "nope.toml")
    with pytest.raises(CollectorConfigError, match="is not valid TOML"):
        load(_write(tmp_path, "[analyzer\n"))


def test_one_good_file_reaches_every_owner(tmp_path):
    config = load(_write(tmp_path, "\n".join([
        '[analyzer]\nwindow = "2h"', '[pricing]\nh100-sxm = 4.1', '[metrics]\nlisten = "127.0.0.1:9403"',
        '[storage]\nraw_retention = "3d"', '[auth]\ntokens_file = "tokens"', '[actions]\nenabled = true',
        '[fabric]\nenabled = true', '[lake]\nenabled = false', '[console]\nlisten = "127.0.0.1:9480"', ''])))
    assert config.analyzer.window_s == 7200 and config.analyzer.pool_prices == {"h100-sxm": 4.1}
    assert config.analyzer.metrics_listen == "127.0.0.1:9403"
    assert config.maintenance.raw_retention_s == 3 * 86_400
    assert config.auth == {"tokens_file": str(tmp_path / "tokens")}   # relative to the config file's folder
    assert config.actions.enabled and config.actions.mode == "dry-run"
    assert config.fabric is not None and config.fabric.enabled
    assert not config.lake.enabled
    assert config.console == {"listen": "127.0.0.1:9480"}
    assert load(None) == CollectorConfig() and load(None).fabric is None


def test_serve_stops_on_a_bad_value_with_one_line_and_creates_no_database(tmp_path):
    config = _write(tmp_path, '[storage]\nraw_retention = "soon"\n')
    db = tmp_path / "fleet.duckdb"
    proc = subprocess.run([sys.executable, "-m", "gpuagent.collector.cli", "serve", "--config", str(config),
                           "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "Error: storage.raw_retention must be a duration such as 7d, 12h or 30m, not 'soon'"
    assert not db.exists()
